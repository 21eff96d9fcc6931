"""Find a Hugging Face model folder, read its config and tokenizer, and load its weights into
the model class its architecture names."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors import safe_open
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from config import ModelConfig
from engine.default_model import default_model_dir
from engine.errors import ModelLoadError
from engine.hub import WEIGHT_INDEX, download_model, index_shards, is_repo_id
from engine.models.interface import CausalLM
from engine.models.layers.linear import CheckpointTensor
from engine.models.registry import model_class, resolve_architecture
from engine.parallel.shard import Shard

if TYPE_CHECKING:
    from engine.model_spec import ModelSpec

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_path(config: ModelConfig) -> Path:
    if config.model is None:
        return default_model_dir(config.model_cache_dir)
    path = Path(config.model).expanduser()
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


def iter_safetensors(path: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of a single-file or sharded (index.json) safetensors checkpoint, as a lazy
    slice: a tensor-parallel rank reads only the part it indexes."""
    index = path / WEIGHT_INDEX
    if index.is_file():
        files = index_shards(index)
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights in {path}")
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict: it has no __iter__
                yield key, f.get_slice(key)


def load_model(spec: ModelSpec, shard: Shard, device: torch.device) -> CausalLM:
    """This rank's shard of the model on `device` (a rank's own GPU), weights loaded, in eval
    mode."""
    with torch.device("meta"):
        model = model_class(spec.architecture)(spec.hf_config, shard)
    module = cast(torch.nn.Module, model).to_empty(device=device).to(spec.dtype).eval()
    model = cast(CausalLM, module)
    model.load_weights(iter_safetensors(spec.path))
    where = f", rank {shard.rank} of {shard.size}" if shard.size > 1 else ""
    log.info(
        "loaded %s (%s, %s%s) from %s", spec.architecture, spec.dtype, device, where, spec.path
    )
    return model
