"""The config and tokenizer of a GGUF file, written once by transformers into a folder of the
model cache (keyed by the file's path, size and modification time), so that everything that
reads a model folder reads this one; the weights stay in the file (engine/loading/gguf_loader)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from engine.errors import ModelLoadError
from engine.loading.folder_once import write_once
from engine.loading.gguf_checkpoint import read_tensors

log = logging.getLogger(__name__)


def is_gguf(model: str) -> bool:
    return model.endswith(".gguf")


def metadata_dir(path: Path, cache_dir: Path) -> Path:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = Path(cache_dir) / f"gguf-{path.stem}-{key[:12]}"
    return write_once(
        target, lambda folder: (folder / "config.json").is_file(), lambda out: _write(path, out)
    )


def _write(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    # Our own checks first: transformers' errors on a bad file name neither it nor the tensor.
    for _ in read_tensors(path):
        pass
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers raises whatever its GGUF parser met
        raise ModelLoadError(
            f"{path}: cannot read its config and tokenizer ({type(exc).__name__}: {exc})"
        ) from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are read by pagedserve, not transformers
    if not getattr(config, "architectures", None) and config.model_type == "llama":
        config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
