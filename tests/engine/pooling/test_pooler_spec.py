"""The pooler read off a checkpoint's sentence-transformers files, settings over them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config import ModelConfig
from engine.errors import ModelLoadError
from engine.pooling import resolve_pooler
from tests.support.embedding import minilm_dir


def _folder(tmp_path: Path, modes: dict[str, bool], normalize: bool, **st: object) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if st:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(st))
    return tmp_path


def test_bundled_minilm_is_mean_normalized_without_truncation() -> None:
    spec = resolve_pooler(ModelConfig(), minilm_dir(), 384, encoder=True)
    assert (spec.pooling_type, spec.normalize, spec.dimensions) == ("mean", True, 384)
    assert not spec.supports_truncation


def test_last_token_unnormalized_matryoshka(tmp_path: Path) -> None:
    path = _folder(
        tmp_path, {"pooling_mode_lasttoken": True}, False, matryoshka_dimensions=[64, 32]
    )
    spec = resolve_pooler(ModelConfig(), path, 64, encoder=False)
    assert (spec.pooling_type, spec.normalize, spec.supports_truncation) == ("last", False, True)
    override = ModelConfig(pooling_type="cls", normalize=True)
    assert resolve_pooler(override, path, 64, False).pooling_type == "cls"
    assert resolve_pooler(override, path, 64, False).normalize


def test_defaults_without_files(tmp_path: Path) -> None:
    assert resolve_pooler(ModelConfig(), tmp_path, 8, encoder=False).pooling_type == "last"
    assert resolve_pooler(ModelConfig(), tmp_path, 8, encoder=True).pooling_type == "cls"
    assert resolve_pooler(ModelConfig(), tmp_path, 8, encoder=True).normalize


def test_unsupported_mode_refused(tmp_path: Path) -> None:
    path = _folder(tmp_path, {"pooling_mode_max_tokens": True}, True)
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens"):
        resolve_pooler(ModelConfig(), path, 8, encoder=True)
