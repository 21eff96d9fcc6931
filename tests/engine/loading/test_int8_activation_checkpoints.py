"""compressed-tensors checkpoints that declare dynamic int8 activations (W4A8, W8A8, as
llm-compressor's presets save them) are served without a flag: their integer weights as stored,
their activations rounded to int8 as `--quantize-activations int8` rounds them. The same weights
saved weight-only (W4A16, W8A16) are the oracle: with that flag they give the very same logprobs,
and the declaring checkpoint with `--quantize-activations none` the weight-only ones. Where the
integer products cannot run, the activations stay 16-bit instead of failing to start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from config import ConfigError, EngineConfig
from engine import LLM, SamplingParams
from engine.loading import model_spec
from engine.models.base import DecoderModel
from engine.models.layers.linear import PackableLinear
from tests.support.models import build_random_model, narrow_llama
from tests.support.quantized_checkpoints import compress

try:
    from kernels.cpu import quant_linear

    VNNI = quant_linear.VNNI
except ImportError:  # pragma: no cover - KernelUnavailable is an ImportError
    VNNI = False

PROMPTS = [[1, 5, 77, 300, 12], [9, 400, 31, 2, 250, 8, 64, 3, 3, 90]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
ENGINE = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128}
# name -> (the preset declaring int8 activations, its weight-only twin, format, group size)
PAIRS = {
    "w4a8": ("W4A8", "W4A16", "pack-quantized", 32),
    "w8a8": ("W8A8", "W8A16", "int-quantized", None),  # one scale per output row
}
Trace = list[list[tuple[int, float]]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("a8")
    src = build_random_model(root / "src", "llama", "llama", vocab_size=512)
    return {
        name: (
            compress(src, root / declared, declared, fmt, group),
            compress(src, root / twin, twin, fmt, group),
        )
        for name, (declared, twin, fmt, group) in PAIRS.items()
    }


def run(folder: Path, activations: str | None = None, marked: bool = False) -> Trace:
    """Greedy tokens and their logprobs; `marked`: every quantized linear takes int8 inputs."""
    with LLM(str(folder), quantize_activations=activations, **ENGINE) as llm:
        model = llm.engine.executor.runner.model
        assert isinstance(model, DecoderModel)
        linears = [m for m in model.modules() if isinstance(m, PackableLinear) and m.quantized]
        assert len(linears) == 2 * 4  # two layers: q/k/v, o, gate/up, down
        assert [m.int8_activations for m in linears] == [marked] * len(linears)
        outs = llm.generate(PROMPTS, PARAMS)
    return [
        [(t, float(next(iter(lp.values())))) for t, lp in zip(s.token_ids, s.logprobs or [])]
        for s in (o.outputs[0] for o in outs)
    ]


@pytest.mark.skipif(not VNNI, reason="this CPU lacks AVX512-VNNI/VBMI/BF16: 16-bit activations")
@pytest.mark.parametrize("name", list(PAIRS))
def test_declared_int8_activations_run_as_the_flag_does_on_the_same_weights(
    folders, name: str
) -> None:
    declared, twin = folders[name]
    integer = run(declared, marked=True)
    assert integer == run(twin, "int8", marked=True)
    exact = run(declared, "none")
    assert exact == run(twin)
    assert exact != integer  # the int8 path really ran: its logprobs moved


def test_where_integer_products_cannot_run_the_activations_stay_16_bit(
    folders, monkeypatch, caplog
) -> None:
    declared, _ = folders["w4a8"]
    monkeypatch.setattr(model_spec, "activation_quantization_unfit", lambda q, p: "no VNNI here")
    config = EngineConfig.from_kwargs(model=str(declared), **ENGINE)
    with caplog.at_level(logging.INFO, logger="engine.loading.model_spec"):
        assert model_spec.resolve_model_spec(config).quantize_activations is None
    assert "activations: 16-bit, not the checkpoint's dynamic int8 (no VNNI here)" in caplog.text
    # Asked for by name, it is refused instead, naming the flag.
    config = EngineConfig.from_kwargs(model=str(declared), quantize_activations="int8", **ENGINE)
    with pytest.raises(ConfigError, match="--quantize-activations int8: no VNNI here"):
        model_spec.resolve_model_spec(config)


def test_a_declared_checkpoint_whose_linears_cannot_take_int8_stays_16_bit(
    tmp_path, caplog, monkeypatch
) -> None:
    """Rows of 48 and 80 inputs (no whole blocks of 32): the flag would be refused; the
    checkpoint's own declaration is not, and its activations stay as they are. (The CPU's
    integer path is taken as present: no linear reaches it.)"""
    monkeypatch.setattr(model_spec, "activation_quantization_unfit", lambda q, p: None)
    src = narrow_llama(tmp_path / "src", head_dim=12)  # o: 4 x 12 = 48 inputs too
    folder = compress(src, tmp_path / "w8a8", "W8A8", "int-quantized")
    with (
        caplog.at_level(logging.INFO, logger="engine.worker.model_runner"),
        LLM(str(folder), **ENGINE) as llm,
    ):
        model = llm.engine.executor.runner.model
        assert isinstance(model, DecoderModel)
        linears = [m for m in model.modules() if isinstance(m, PackableLinear) and m.quantized]
        assert len(linears) == 2 * 4 and not any(m.int8_activations for m in linears)
        (out,) = llm.generate(PROMPTS[:1], PARAMS)
        assert len(out.outputs[0].token_ids) == PARAMS.max_tokens
    assert "0 of 8 quantized linears take int8 activations (the rest: groups" in caplog.text
    with pytest.raises(ConfigError, match="--quantize-activations int8: none of the model's 8"):
        LLM(str(folder), quantize_activations="int8", **ENGINE)


def test_the_flag_on_an_fp8_checkpoint_is_refused_before_loading(folders, tmp_path) -> None:
    src = folders["w4a8"][0].parent / "src"
    folder = compress(src, tmp_path / "fp8", "FP8_DYNAMIC", "float-quantized")
    config = EngineConfig.from_kwargs(model=str(folder), quantize_activations="int8", **ENGINE)
    with pytest.raises(ConfigError, match=r"--quantize-activations int8: .*checkpoint's are FP8"):
        model_spec.resolve_model_spec(config)
