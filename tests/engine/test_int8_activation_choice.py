"""--quantize-activations auto: the start-up timing's rule, that the engine marks the linears as
the timing chose (each way, by moving the margin so that the choice is known), and that where
int8 activations cannot run the engine starts with 16-bit ones instead of refusing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.models.base import DecoderModel
from engine.models.layers.linear import PackableLinear
from engine.worker.cpu import activation_choice
from engine.worker.cpu.activation_choice import ActivationTiming
from tests.engine.test_int8_activations import needs_vnni
from tests.support.models import narrow_llama

RUNNER_LOG = "engine.worker.model_runner"


def test_int8_only_where_clearly_faster_at_every_row_count() -> None:
    def timing(int8_ms: tuple[float, float]) -> ActivationTiming:
        return ActivationTiming(9, (1, 16), (10.0, 40.0), int8_ms)

    assert timing((9.0, 36.0)).int8  # 0.9x at both: taken
    assert not timing((9.5, 20.0)).int8  # 0.95x at one row
    assert not timing((5.0, 39.0)).int8  # 0.975x at 16 rows
    described = timing((5.0, 20.0)).describe()
    assert "int8 activations" in described and "the 9 linears" in described
    assert "1 row: 10.00 ms exact, 5.00 ms int8 (2.00x)" in described
    assert "16 rows: 40.00 ms exact, 20.00 ms int8 (2.00x)" in described


def _auto(folder: Path, quantization: str | None = "int8") -> LLM:
    return LLM(
        str(folder),
        quantization=quantization,
        quantize_activations="auto",
        num_kv_blocks=16,
        max_model_len=64,
        max_num_seqs=4,
    )


def _marks(llm: LLM) -> list[bool]:
    model = llm.engine.executor.runner.model
    assert isinstance(model, DecoderModel)
    return [
        m.int8_activations
        for m in model.modules()
        if isinstance(m, PackableLinear) and m.quantized is not None
    ]


@needs_vnni
@pytest.mark.parametrize("margin", [1e9, 1e-9])
def test_the_linears_are_marked_as_the_timing_chose(
    llama_dir: Path,
    margin: float,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(activation_choice, "MARGIN", margin)  # 1e9: int8 always wins; 1e-9: never
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG), _auto(llama_dir) as llm:
        marks = _marks(llm)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        (out,) = llm.generate([[1, 2, 3, 4]], params)
    assert len(out.outputs[0].token_ids) == 4
    (line,) = [r.getMessage() for r in caplog.records if "activations auto" in r.getMessage()]
    assert "the 9 linears took 1 row:" in line and "4 rows:" in line  # 2 layers x 4 + the head
    assert len(marks) == 9
    assert marks == [margin > 1] * 9
    assert line.startswith(
        "--quantize-activations auto: int8" if margin > 1 else "--quantize-activations auto: 16-bit"
    )


def test_without_quantized_weights_it_starts_16_bit(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO), _auto(llama_dir, quantization=None) as llm:
        assert _marks(llm) == []
    assert any(
        "activations: 16-bit (--quantize-activations auto; int8: it needs quantized weights"
        in r.getMessage()
        for r in caplog.records
    )


@needs_vnni
def test_with_no_linear_in_whole_blocks_of_32_it_starts_16_bit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = narrow_llama(tmp_path, head_dim=12)  # no linear's inputs are whole blocks of 32
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG), _auto(folder) as llm:
        assert _marks(llm) == [False] * 9
    assert "activations: 16-bit (no linear takes int8)" in caplog.text
