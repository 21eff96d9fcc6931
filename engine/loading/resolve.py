"""Settings resolved before anything loads: the model folder (a local path, a Hub repo id or the
bundled default), its config and tokenizer, the device and the dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from config import ModelConfig
from engine.errors import ModelLoadError
from engine.loading.default_model import (
    default_embedding_model_dir,
    default_model_dir,
    gguf_path,
)
from engine.loading.gguf_metadata import is_gguf, metadata_dir
from engine.loading.hub import download_model, is_repo_id
from engine.models.registry import resolve_architecture

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_path(config: ModelConfig) -> Path:
    if config.model is None:
        if config.runner == "pooling":
            return default_embedding_model_dir()
        return default_model_dir(config.model_cache_dir)
    path = Path(config.model).expanduser()
    if is_gguf(config.model):  # its config and tokenizer, written once; its weights stay in it
        if path.is_file() and path.resolve() == gguf_path().resolve():
            return default_model_dir(config.model_cache_dir)  # the default model's: already
        return metadata_dir(path, config.model_cache_dir)
    if not path.is_dir() and is_repo_id(config.model):  # an existing folder wins over a repo id
        path = download_model(config.model, config.revision, config.download_dir, _check_servable)
    if not path.is_dir():
        raise ModelLoadError(
            f"model folder {config.model!r} does not exist (pagedserve loads local Hugging Face folders "
            "and Hub repo ids org/name; omit the model to serve the bundled default)"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} has no config.json")
    return path


def _check_servable(path: Path) -> None:
    resolve_architecture(load_hf_config(path))


def load_hf_config(path: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        # Never code from the folder, and never a prompt asking whether to run it.
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {exc}") from exc


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc


def resolve_device(name: str) -> str:
    """`auto`: the GPU when torch sees one, else the CPU."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), read from the
    kernel's CPU flags: there bf16 matmuls run ~4x faster than float32; elsewhere they are emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to tell, keep the safe choice
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(
    name: str, hf_config: PretrainedConfig, device: torch.device
) -> tuple[torch.dtype, str]:
    """The dtype to run in, and why (for the start-up log)."""
    if name != "auto":
        return _DTYPES[name], "--dtype"
    if device.type == "cpu":
        if cpu_multiplies_bf16():
            return (
                torch.bfloat16,
                "auto: this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)",
            )
        return (
            torch.float32,
            "auto: this CPU has no native bfloat16 (AVX512-BF16 or AMX), where float32 is faster",
        )
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    declared = _DTYPES.get(str(declared).removeprefix("torch."), torch.bfloat16)
    if declared == torch.float32:
        return torch.bfloat16, "auto: the checkpoint's float32 served as bfloat16 on the GPU"
    return declared, "auto: the checkpoint's dtype"
