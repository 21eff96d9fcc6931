"""GPTQ and AWQ checkpoints (built in tests from their documented packing: known integers,
zero points and float16 scales) served without a flag: each layer's integers, scales and mins in
the quantized kernel's layout equal the ones packed, de-quantizing exactly to the weights they
stand for; float32 greedy tokens equal transformers' on those weights. Then what is refused:
groups out of input order (desc_act), unsupported bits or packing, missing or misshapen tensors,
and a flag that names another format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config import ConfigError, EngineConfig
from engine import LLM, SamplingParams
from engine.distributed.shard import Shard
from engine.errors import ModelLoadError
from engine.loading.model_loader import load_model
from engine.loading.model_spec import resolve_model_spec
from engine.models.base import DecoderModel
from engine.models.layers.linear import ColumnParallelLinear, PackableLinear
from kernels.cpu.quant_layout import unpack
from tests.support.gptq_awq_checkpoints import Expected, Layout, write_checkpoint
from tests.support.models import build_random_model, hf_greedy

PROMPTS = [[1, 5, 77, 300, 12], [9, 400, 31, 2, 250, 8, 64]]
MAX_TOKENS = 6
ENGINE = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128}

LAYOUTS = {
    # desc_act, but every input's group is its index // 32: served as it is.
    "gptq-int4-g32-desc-act-in-order": Layout("gptq", 4, 32, "gptq", desc_act=True),
    "gptq_v2-int8-per-row": Layout("gptq", 8, -1, "gptq_v2"),
    "awq-gemm-int4-g32": Layout("awq", 4, 32),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("gptq-src"), "llama", "llama", vocab_size=512)


@dataclass
class Served:
    layout: Layout
    dense: Path
    expected: dict[str, Expected]
    llm: LLM


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def served(request, src: Path, tmp_path_factory) -> Iterator[Served]:
    layout = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    expected = write_checkpoint(src, root / "quantized", root / "dense", layout)
    with LLM(str(root / "quantized"), **ENGINE) as llm:  # no flag: the format is detected
        yield Served(layout, root / "dense", expected, llm)


def test_layers_hold_the_packed_integers_scales_and_mins(served: Served) -> None:
    model = served.llm.engine.executor.runner.model
    assert len(served.expected) == 2 * 7
    for prefix, want in served.expected.items():
        name, part = model._locate(f"{prefix}.weight")
        module = model.get_submodule(name.rpartition(".")[0])
        assert module.weight is None and module.quantized is not None, prefix
        assert module.quantized.bits == served.layout.bits, prefix
        weight = unpack(module.quantized)
        rows = slice(None)
        if part is not None:
            assert isinstance(module, ColumnParallelLinear)
            start = module.starts[part]
            rows = slice(start, start + want.q.shape[0])
        # 4-bit: the stored value; 8-bit: its int8, less 128 (the min puts it back).
        offset = 0 if served.layout.bits == 4 else 128
        assert torch.equal(weight.q[rows].to(torch.int64), want.q - offset), prefix
        assert torch.equal(weight.scales[rows], want.scales), prefix
        assert torch.equal(weight.dequantize()[rows], want.weight), prefix


def test_float32_greedy_equals_transformers_on_the_weights_they_stand_for(served: Served) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in served.llm.generate(PROMPTS, params)]
    assert got == hf_greedy(served.dense, PROMPTS, MAX_TOKENS)


def test_awq_modules_to_not_convert_stay_dense(src: Path, tmp_path: Path) -> None:
    """Layers that AWQ's modules_to_not_convert names (substrings: every down_proj, all of
    layer 1's attention, q/k/v fused among them) are read as the dense weights they are, the
    rest as integers; the float32 tokens are transformers' on the same weights."""
    skip = ["layers.1.self_attn", "down_proj"]
    layout = Layout("awq", 4, 32, extra={"modules_to_not_convert": skip})
    expected = write_checkpoint(src, tmp_path / "awq", tmp_path / "dense", layout)
    dense = {
        k.removesuffix(".weight"): t
        for k, t in load_file(str(tmp_path / "dense" / "model.safetensors")).items()
        if k.endswith("_proj.weight")
    }
    assert len(dense) == 2 * 7 and len(expected) == 2 * 7 - 4 - 2
    with LLM(str(tmp_path / "awq"), **ENGINE) as llm:
        model = llm.engine.executor.runner.model
        assert isinstance(model, DecoderModel)
        for prefix, weight in dense.items():
            name, part = model._locate(f"{prefix}.weight")  # type: ignore[misc]
            module = model.get_submodule(name.rpartition(".")[0])
            assert isinstance(module, PackableLinear)
            rows = slice(None)
            if part is not None:
                assert isinstance(module, ColumnParallelLinear)
                start = module.starts[part]
                rows = slice(start, start + weight.shape[0])
            if prefix in expected:
                assert module.weight is None and module.quantized is not None, prefix
                assert torch.equal(unpack(module.quantized).dequantize()[rows], weight), prefix
            else:
                assert module.quantized is None and module.weight is not None, prefix
                assert torch.equal(module.weight[rows], weight), prefix
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == hf_greedy(tmp_path / "dense", PROMPTS, MAX_TOKENS)


# ---------------------------------------------------------------- refused at start-up


def _load(folder: Path, **flags: object) -> None:
    """Start-up as far as the weights: the spec resolved, the model loaded."""
    config = EngineConfig.from_kwargs(model=str(folder), **ENGINE, **flags)
    load_model(resolve_model_spec(config), Shard(0, 1), torch.device("cpu"))


@pytest.fixture
def gptq(src: Path, tmp_path: Path) -> Path:
    write_checkpoint(src, tmp_path / "gptq", tmp_path / "dense", Layout("gptq", 4, 32))
    return tmp_path / "gptq"


def _edit(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _rewrite(folder: Path, change) -> None:  # type: ignore[no-untyped-def]
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_groups_out_of_input_order_are_refused_naming_g_idx(gptq: Path) -> None:
    key = "model.layers.1.mlp.up_proj.g_idx"

    def shuffle(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors[key].flip(0).contiguous()

    _edit(gptq, desc_act=True)
    _rewrite(gptq, shuffle)
    with pytest.raises(ModelLoadError, match=rf"gptq: tensor {key} puts inputs in groups out"):
        _load(gptq)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"bits": 3}, r"bits is 3"),
        ({"quant_method": "awq", "version": "gemv"}, r"version is 'gemv'"),
        ({"quant_method": "awq", "bits": 8}, r"bits is 8"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format is 'marlin'"),
        ({"group_size": 0}, r"group_size is 0"),
    ],
    ids=["bits-3", "awq-gemv", "awq-8-bit", "marlin", "group-0"],
)
def test_settings_it_cannot_serve_are_refused_naming_the_field(
    gptq: Path, changes: dict, field: str
) -> None:
    _edit(gptq, **changes)
    with pytest.raises(ConfigError, match=rf"config\.json: quantization_config\.{field}"):
        _load(gptq)


def test_a_group_size_that_does_not_divide_the_inputs_is_refused(gptq: Path) -> None:
    _edit(gptq, group_size=48)
    with pytest.raises(ModelLoadError, match=r"gptq: .*qweight: a group size of 48"):
        _load(gptq)


def test_a_missing_scales_tensor_is_refused_naming_the_file_and_tensor(gptq: Path) -> None:
    _rewrite(gptq, lambda t: t.pop("model.layers.0.self_attn.o_proj.scales"))
    with pytest.raises(
        ModelLoadError, match=r"gptq: no tensor model\.layers\.0\.self_attn\.o_proj\.scales"
    ):
        _load(gptq)


def test_a_tensor_of_the_wrong_rank_is_refused_naming_the_file_and_layer(gptq: Path) -> None:
    key = "model.layers.0.mlp.down_proj.qweight"
    _rewrite(gptq, lambda t: t.update({key: t[key].reshape(-1).contiguous()}))
    with pytest.raises(ModelLoadError, match=r"gptq: model\.layers\.0\.mlp\.down_proj \(gptq\)"):
        _load(gptq)


def test_packing_that_does_not_fit_the_model_is_refused(gptq: Path) -> None:
    # 8 bits declared over words that hold 4-bit values: half the inputs, so twice the groups
    # of 32 that the scales hold.
    _edit(gptq, bits=8)
    with pytest.raises(
        ModelLoadError,
        match=r"gptq: tensor model\..*\.scales is \(4, 64\), its layer's settings need \(2, 64\)",
    ):
        _load(gptq)


@pytest.mark.parametrize("flag", ["awq", "compressed-tensors", "fp8", "int8"])
def test_a_flag_that_contradicts_the_checkpoint_names_both(gptq: Path, flag: str) -> None:
    with pytest.raises(ConfigError, match=rf"--quantization {flag} contradicts.*quant_method gptq"):
        _load(gptq, quantization=flag)
