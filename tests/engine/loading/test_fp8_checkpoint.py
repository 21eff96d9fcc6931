"""compressed-tensors FP8 checkpoints (e4m3 weights, FP8_DYNAMIC's per-token activations),
written by compressed-tensors' own compressors from a tiny random Llama, per row and per tensor:

- on a (mocked) Hopper the start-up keeps the checkpoint's e4m3 bytes, bit for bit, in FP8
  linears (q/k/v and gate/up joined with each part's own scale on its rows), the layers that
  `ignore` leaves dense stay dense, and a layer computes the float32 product of its
  activations' FP8 rounding and the checkpoint's de-quantized weight, rounded once to bf16;
- below sm89 the weights are de-quantized at load to the model's dtype, the log says so;
- on the CPU they are de-quantized one layer at a time, as the model's loader consumes them.

The mock (as in tests/engine/test_gpu_quantization.py) stands only for what needs CUDA: the
device found and the compute capability; torch._scaled_mm runs on the CPU."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config import EngineConfig
from engine.distributed.shard import Shard
from engine.errors import ModelLoadError
from engine.loading import fp8_layers, model_spec
from engine.loading.compressed_tensors import CompressedTensorsFormat
from engine.loading.model_loader import load_model
from engine.models.base import DecoderModel
from engine.models.layers.linear import ColumnParallelLinear, PackableLinear
from engine.worker.gpu_quantize import quantize_for_gpu
from kernels.attention.platform import Platform, import_error
from kernels.gpu_quant.fp8 import Fp8Weight, quantize_activations
from tests.support.models import build_random_model
from tests.support.quantized_checkpoints import compress

HOPPER, AMPERE = (9, 0), (8, 0)
DENSE = "re:.*down_proj$"  # left dense by `ignore`: a mixed checkpoint
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    src = build_random_model(root / "src", "llama", "llama", vocab_size=512)
    return {
        "channel": compress(
            src, root / "channel", "FP8_DYNAMIC", "float-quantized", ignore=("lm_head", DENSE)
        ),
        # The head quantized too: it is de-quantized, as the head stays in the model's dtype.
        "tensor": compress(
            src,
            root / "tensor",
            "FP8_DYNAMIC",
            "float-quantized",
            ignore=(),
            weight_strategy="tensor",
        ),
    }


def _on_a_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(model_spec, "resolve_device", lambda name: "cuda")

    def detect(device: str, dtype: torch.dtype, head_dim: int) -> Platform:
        return Platform(device, dtype, head_dim, capability, import_error)

    monkeypatch.setattr(model_spec.Platform, "detect", staticmethod(detect))


def _loaded(folder: Path) -> tuple[DecoderModel, int]:
    """Start-up as a runner takes it: the spec, the model (on the CPU), the GPU form."""
    config = EngineConfig.model_validate({"model": {"model": str(folder), "dtype": "bfloat16"}})
    spec = model_spec.resolve_model_spec(config)
    model = load_model(spec, Shard(0, 1), torch.device("cpu"))
    assert isinstance(model, DecoderModel) and spec.quantization == "compressed-tensors"
    return model, quantize_for_gpu(model, spec.quantization, torch.device("cpu"))


def _layers(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's linear tensors by layer prefix."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(folder / "model.safetensors")).items():
        prefix, _, name = key.rpartition(".")
        if prefix.rpartition(".")[2] in LINEARS:
            layers.setdefault(prefix, {})[name] = tensor
    return layers


def _rows(model: DecoderModel, prefix: str) -> tuple[PackableLinear, slice]:
    """Our module holding the checkpoint's linear `prefix`, and its rows there."""
    name, part = model._locate(f"{prefix}.weight")  # type: ignore[misc]
    module = model.get_submodule(name.rpartition(".")[0])
    assert isinstance(module, PackableLinear)
    if part is None:
        return module, slice(None)
    assert isinstance(module, ColumnParallelLinear)
    count = next(p.count for p in module.part_list if p.name == part)
    return module, slice(module.starts[part], module.starts[part] + count)


def _dequantized(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    scale = tensors["weight_scale"].to(torch.float32).reshape(-1, 1)
    return tensors["weight"].to(torch.float32) * scale


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_hopper_keeps_the_checkpoints_fp8_bytes(
    folders: dict[str, Path],
    strategy: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _on_a_gpu(monkeypatch, HOPPER)
    with caplog.at_level(logging.INFO):
        model, count = _loaded(folders[strategy])
    assert "FP8 weights kept as stored, run through torch._scaled_mm" in caplog.text
    # Checkpoint tensors: without down_proj's, or with them and the head (de-quantized).
    kept, dense = (12, 0) if strategy == "channel" else (14, 1)
    counts = f"0 linear weights read as integers, {kept} kept as FP8, {dense} de-quantized"
    assert counts in caplog.text
    layers = _layers(folders[strategy])
    fp8_modules = set()
    for prefix, tensors in layers.items():
        module, rows = _rows(model, prefix)
        if strategy == "channel" and prefix.endswith("down_proj"):
            assert "weight_scale" not in tensors, prefix  # `ignore` left it dense
            assert module.gpu_quantized is None and module.weight is not None, prefix
            assert torch.equal(module.weight, tensors["weight"].to(torch.bfloat16)), prefix
            continue
        assert module.weight is None and isinstance(module.gpu_quantized, Fp8Weight), prefix
        stored = module.gpu_quantized
        assert stored.q.dtype == torch.float8_e4m3fn, prefix
        got = stored.q[rows].view(torch.uint8)
        assert torch.equal(got, tensors["weight"].view(torch.uint8)), prefix
        # Per row: the file's scale of each row; per tensor: the part's one scale on its rows.
        want = tensors["weight_scale"].to(torch.float32).reshape(-1).expand(got.shape[0])
        assert torch.equal(stored.scales[rows], want), prefix
        fp8_modules.add(id(module))
    # 2 layers x (qkv, o, gate_up[, down]): the modules the GPU step counted.
    assert count == len(fp8_modules) == (6 if strategy == "channel" else 8)
    if strategy == "tensor":  # q, k and v have scales of their own: the join kept each
        qkv = model.get_submodule("layers.0.self_attn.qkv_proj")
        assert isinstance(qkv.gpu_quantized, Fp8Weight)
        assert len(set(qkv.gpu_quantized.scales.tolist())) == 3
        file = load_file(str(folders[strategy] / "model.safetensors"))
        head = model.get_submodule("lm_head")
        assert isinstance(head, PackableLinear) and head.gpu_quantized is None
        want = _dequantized(
            {k.removeprefix("lm_head."): t for k, t in file.items() if "lm_head" in k}
        )
        assert head.weight is not None and torch.equal(head.weight, want.to(torch.bfloat16))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_an_fp8_layer_computes_its_fp8_operands_float32_product(
    folders: dict[str, Path], strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _on_a_gpu(monkeypatch, HOPPER)
    model, _ = _loaded(folders[strategy])
    layers = _layers(folders[strategy])
    parts = [f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    weight = torch.cat([_dequantized(layers[p]) for p in parts])  # [96, 64] float32
    module = model.get_submodule("layers.1.self_attn.qkv_proj")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = module(x).float()
    xq, x_scales = quantize_activations(x, "token")
    want = (xq.to(torch.float32) * x_scales) @ weight.t()
    # One bf16 rounding of the float32 sums (summed in another order): within one unit in the
    # last place of bf16 (8 significant bits).
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=1e-30))) - 7)
    assert ((got - want).abs() <= ulp).all()
    # The activations were rounded to FP8: the bf16 activations' product is further off.
    plain = x.float() @ weight.t()
    assert not ((got - plain).abs() <= ulp).all()


def test_weight_only_fp8_keeps_16_bit_activations_on_hopper(
    folders: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A checkpoint that declares no activation quantization means FP8 weights with 16-bit
    activations: _scaled_mm would round the activations to FP8 too, so its weights are
    de-quantized instead, exactly."""
    folder = tmp_path / "weight-only"
    shutil.copytree(folders["channel"], folder)
    config = json.loads((folder / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        assert group.pop("input_activations") is not None  # FP8_DYNAMIC declared them
    (folder / "config.json").write_text(json.dumps(config))
    _on_a_gpu(monkeypatch, HOPPER)
    with caplog.at_level(logging.INFO):
        model, count = _loaded(folder)
    assert "0 linear weights read as integers, 0 kept as FP8, 12 de-quantized" in caplog.text
    assert count == 0
    for prefix, tensors in _layers(folder).items():
        module, rows = _rows(model, prefix)
        assert module.gpu_quantized is None and module.weight is not None, prefix
        want = _dequantized(tensors) if "weight_scale" in tensors else tensors["weight"]
        assert torch.equal(module.weight[rows], want.to(torch.bfloat16)), prefix


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_below_sm89_the_weights_are_dequantized_and_the_log_says_so(
    folders: dict[str, Path],
    strategy: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _on_a_gpu(monkeypatch, AMPERE)
    with caplog.at_level(logging.INFO):
        model, count = _loaded(folders[strategy])
    assert "its FP8 weights are de-quantized at load (FP8 matmuls need compute capability " in (
        caplog.text
    )
    assert "8.9 or later, not 8.0)" in caplog.text
    assert count == 0
    for prefix, tensors in _layers(folders[strategy]).items():
        module, rows = _rows(model, prefix)
        assert module.gpu_quantized is None and module.weight is not None, prefix
        assert module.weight.dtype == torch.bfloat16, prefix
        want = _dequantized(tensors) if "weight_scale" in tensors else tensors["weight"]
        assert torch.equal(module.weight[rows], want.to(torch.bfloat16)), prefix


def test_the_cpu_dequantizes_one_layer_as_the_model_loads_it(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each FP8 layer is de-quantized (into bf16) just when the model's loader takes it: the
    k-th FP8 weight reaches the loader after exactly k de-quantizations, none ahead."""
    made: list[torch.dtype] = []
    dequantized = fp8_layers.Fp8Stored.dequantized

    def counted(self: fp8_layers.Fp8Stored, dtype: torch.dtype) -> torch.Tensor:
        made.append(dtype)
        return dequantized(self, dtype)

    seen: list[tuple[int, torch.dtype]] = []
    load_weights = DecoderModel.load_weights

    def watched(self: DecoderModel, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        assert not isinstance(weights, (list, tuple)), "a list holds every layer at once"

        def through() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.rpartition(".")[0] in fp8_prefixes:
                    seen.append((len(made), tensor.dtype))
                yield name, tensor

        load_weights(self, through())

    fp8_prefixes = {p for p, t in _layers(folders["channel"]).items() if "weight_scale" in t}
    monkeypatch.setattr(fp8_layers.Fp8Stored, "dequantized", counted)
    monkeypatch.setattr(DecoderModel, "load_weights", watched)
    config = EngineConfig.model_validate(
        {"model": {"model": str(folders["channel"]), "dtype": "bfloat16", "device": "cpu"}}
    )
    load_model(model_spec.resolve_model_spec(config), Shard(0, 1), torch.device("cpu"))
    assert len(fp8_prefixes) == 12  # 2 layers x (q, k, v, o, gate, up)
    assert seen == [(k + 1, torch.bfloat16) for k in range(12)]


@pytest.mark.parametrize("capability", [HOPPER, None], ids=["hopper", "cpu"])
def test_a_misshapen_scale_is_refused_naming_the_file_and_tensor(
    folders: dict[str, Path],
    capability: tuple[int, int] | None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    folder = Path(shutil.copytree(folders["channel"], tmp_path / "copy"))
    key = "model.layers.1.mlp.up_proj.weight_scale"
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if capability is not None:
        _on_a_gpu(monkeypatch, capability)
    with pytest.raises(ModelLoadError, match=rf"copy: tensor {key} is \(127, 1\)"):
        _loaded(folder)


def test_join_refuses_parts_of_different_widths() -> None:
    def part(n: int, k: int) -> fp8_layers.Fp8Stored:
        return fp8_layers.Fp8Stored(torch.zeros(n, k).to(torch.float8_e4m3fn), torch.ones(n))

    joined = fp8_layers.join_fp8([part(32, 64), part(16, 64)], "qkv")
    assert tuple(joined.q.shape) == (48, 64) and joined.activations == "token"
    with pytest.raises(ModelLoadError, match=r"qkv: its parts have \[32, 64\] input features"):
        fp8_layers.join_fp8([part(32, 64), part(16, 32)], "qkv")


def test_a_module_fp8_cannot_run_whole_is_dequantized_on_hopper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """q/k FP8_DYNAMIC with v weight-only: the fused qkv runs one way, so it is de-quantized;
    an MLP 72 wide: down_proj's 72 inputs are no multiple of 16 for _scaled_mm. The rest (o,
    gate/up: 144 rows) stays FP8; the checkpoint loads as it did when all was de-quantized."""
    src = build_random_model(
        tmp_path / "src", "llama", "llama", vocab_size=512, intermediate_size=72
    )
    folder = compress(src, tmp_path / "mixed", "FP8_DYNAMIC", "float-quantized")
    config = json.loads((folder / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    weight_only = {**groups["group_0"], "input_activations": None, "targets": ["re:.*v_proj$"]}
    groups["group_0"]["targets"] = ["re:.*(q|k|o|gate|up|down)_proj$"]
    groups["group_1"] = weight_only
    (folder / "config.json").write_text(json.dumps(config))
    _on_a_gpu(monkeypatch, HOPPER)
    with caplog.at_level(logging.INFO):
        model, count = _loaded(folder)
    # 2 layers x (o, gate, up) kept; x (q, k, v, down) de-quantized.
    assert "0 linear weights read as integers, 6 kept as FP8, 8 de-quantized" in caplog.text
    assert "qkv_proj de-quantized at load (not all of its parts are FP8" in caplog.text
    assert "down_proj de-quantized at load (FP8 matmuls take multiples of 16, not [64, 72])" in (
        caplog.text
    )
    assert count == 4  # o_proj and gate_up_proj of each layer
    for prefix, tensors in _layers(folder).items():
        module, rows = _rows(model, prefix)
        if prefix.rpartition(".")[2] in ("o_proj", "gate_proj", "up_proj"):
            assert isinstance(module.gpu_quantized, Fp8Weight), prefix
            assert torch.equal(
                module.gpu_quantized.q[rows].view(torch.uint8), tensors["weight"].view(torch.uint8)
            )
            continue
        assert module.gpu_quantized is None and module.weight is not None, prefix
        assert torch.equal(module.weight[rows], _dequantized(tensors).to(torch.bfloat16)), prefix


@pytest.mark.parametrize(
    ("capability", "dtype", "triton_missing"),
    [((7, 5), "float16", False), ((9, 0), "bfloat16", True)],
    ids=["sm75", "hopper-without-triton"],
)
def test_an_fp8_only_checkpoint_needs_no_triton(
    folders: dict[str, Path],
    capability: tuple[int, int],
    dtype: str,
    triton_missing: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its layers run on _scaled_mm or are de-quantized: the Triton kernel's limits (8.0+,
    triton installed) are not its."""
    monkeypatch.setattr(model_spec, "resolve_device", lambda name: "cuda")

    def importable(name: str) -> str | None:
        return f"No module named {name!r}" if triton_missing else import_error(name)

    def detect(device: str, dtype: torch.dtype, head_dim: int) -> Platform:
        return Platform(device, dtype, head_dim, capability, importable)

    monkeypatch.setattr(model_spec.Platform, "detect", staticmethod(detect))
    config = {"model": {"model": str(folders["channel"]), "dtype": dtype}}
    spec = model_spec.resolve_model_spec(EngineConfig.model_validate(config))
    assert isinstance(spec.linear_format, CompressedTensorsFormat)
    assert spec.linear_format.fp8_kernel == (capability >= (8, 9))
