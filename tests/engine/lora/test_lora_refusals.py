"""What --enable-lora refuses at start-up, before any weight is loaded: a mixture of experts,
quantized weights, a pooling runner and --batch-invariant, each a ConfigError naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import ConfigError
from engine import LLM
from kernels.cpu.packed_linear import fixed_order_available
from tests.support.models import build_random_model


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"quantization": "int8"}, "quantized weights"),
        ({"runner": "pooling"}, "generating decoder"),
    ],
)
def test_refused_combinations(llama_dir: Path, settings: dict, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"--enable-lora: .*{why}"):
        LLM(str(llama_dir), enable_lora=True, **settings)


@pytest.mark.skipif(
    not fixed_order_available(), reason="--batch-invariant is refused earlier on this CPU"
)
def test_not_with_batch_invariant(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--enable-lora: not with --batch-invariant"):
        LLM(str(llama_dir), enable_lora=True, dtype="bfloat16", batch_invariant=True)


def test_not_for_a_mixture_of_experts(tmp_path: Path) -> None:
    folder = build_random_model(tmp_path / "mixtral", "mixtral", "llama")
    with pytest.raises(ConfigError, match="--enable-lora: adapters are for generating decoder"):
        LLM(str(folder), enable_lora=True)
