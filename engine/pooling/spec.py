"""The pooler a checkpoint declares, in sentence-transformers' files: `modules.json` lists the
modules in order (Transformer, Pooling, Normalize, ...), the Pooling module's folder holds its
`config.json` (which of mean / cls / last-token). A checkpoint without them gets vLLM's defaults:
last token and normalized for a decoder, CLS for an encoder."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from config import ModelConfig
from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

PoolingType = Literal["mean", "cls", "last"]

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_DENSE_MODULE = "sentence_transformers.models.Dense"
# 1_Pooling/config.json switches -> our pooling type (one of them is set)
_MODES: dict[str, PoolingType] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True)
class PoolerSpec:
    pooling_type: PoolingType
    normalize: bool
    dimensions: int  # the embedding's length
    # Matryoshka checkpoints declare it: a prefix of the embedding is itself an embedding.
    supports_truncation: bool = False


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _from_checkpoint(path: Path) -> tuple[PoolingType | None, bool | None]:
    """(pooling type, normalize) as the checkpoint's sentence-transformers files say; None for
    what they do not say."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file} is not a list of modules")
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    if _DENSE_MODULE in types:
        raise ModelLoadError(
            f"{modules_file} has a Dense module after pooling, which is not supported"
        )
    normalize = _NORMALIZE_MODULE in types
    pooling: PoolingType | None = None
    for module in modules:
        if isinstance(module, dict) and module.get("type") == _POOLING_MODULE:
            cfg = _read_json(path / str(module.get("path", "")) / "config.json")
            if not isinstance(cfg, dict):
                raise ModelLoadError(f"{path}'s pooling config is not an object")
            chosen = [mode for key, mode in _MODES.items() if cfg.get(key)]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
            if len(chosen) != 1 or len(others) != 1:
                raise ModelLoadError(
                    f"{path}'s pooling config asks for {others or 'no mode'}; supported: exactly "
                    f"one of {', '.join(_MODES)}"
                )
            pooling = chosen[0]
    return pooling, normalize


def resolve_pooler(config: ModelConfig, path: Path, hidden_size: int, encoder: bool) -> PoolerSpec:
    """Settings first, then the checkpoint's files, then the defaults."""
    pooling, normalize = _from_checkpoint(path)
    if config.pooling_type != "auto":
        pooling = config.pooling_type
    if pooling is None:
        pooling = "cls" if encoder else "last"
    if config.normalize is not None:
        normalize = config.normalize
    if normalize is None:
        normalize = True
    matryoshka = False
    st_config = path / "config_sentence_transformers.json"
    if st_config.is_file():
        data = _read_json(st_config)
        matryoshka = isinstance(data, dict) and bool(data.get("matryoshka_dimensions"))
    log.info("pooling: %s tokens, %snormalized", pooling, "" if normalize else "not ")
    return PoolerSpec(pooling, normalize, hidden_size, matryoshka)
