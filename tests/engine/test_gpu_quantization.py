"""Quantized weights on the GPU path, without a GPU.

- Start-up on a (mocked) Hopper: `resolve_model_spec` accepts fp8, int8 and gguf there and
  refuses what is not built. The mock stands only where CUDA is required: the device that
  `--device auto` finds and the compute capability torch reports (Platform.detect); everything
  else (config, checkpoint, dtype, attention choice) runs for real.
- The load step a CUDA runner takes (engine/worker/gpu_quantize.py) on a real random Llama's
  modules: every linear but the head gets its GPU form and drops its float copy, and
  `PackableLinear` then runs on it: fp8 through torch._scaled_mm (which runs on the CPU too),
  int8 through the Triton kernel (interpreted here), each equal to its kernel on the same
  weight; GGUF blocks as the GGUF loader leaves them reach the Triton layout unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from torch import nn

from config import ConfigError, EngineConfig
from engine.distributed.shard import Shard
from engine.loading import model_spec
from engine.loading.model_loader import load_model
from engine.models.base import DecoderModel
from engine.models.layers.linear import PackableLinear, ParallelLMHead
from engine.worker.gpu_quantize import quantize_for_gpu
from kernels.attention.platform import Platform, import_error
from kernels.cpu.quant_layout import QuantizedWeight, quantize
from kernels.cpu.quant_layout import pack as cpu_pack
from kernels.gpu_quant.fp8 import Fp8Weight, fp8_linear
from kernels.gpu_quant.fp8 import quantize_weight as quantize_fp8
from kernels.triton.quant_layout import PackedQuantWeight, pack

HOPPER, ADA, AMPERE = (9, 0), (8, 9), (8, 0)


def _on_a_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(model_spec, "resolve_device", lambda name: "cuda")

    def detect(device: str, dtype: torch.dtype, head_dim: int) -> Platform:
        return Platform(device, dtype, head_dim, capability, import_error)

    monkeypatch.setattr(model_spec.Platform, "detect", staticmethod(detect))


def _spec(folder: Path, **model: object) -> model_spec.ModelSpec:
    config = EngineConfig.model_validate({"model": {"model": str(folder), **model}})
    return model_spec.resolve_model_spec(config)


@pytest.mark.parametrize(
    ("quantization", "capability", "dtype"),
    [("fp8", HOPPER, "bfloat16"), ("fp8", ADA, "float16"), ("int8", AMPERE, "bfloat16")],
)
def test_a_gpu_accepts_what_its_kernels_run(
    llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str,
    capability: tuple[int, int],
    dtype: str,
) -> None:
    _on_a_gpu(monkeypatch, capability)
    spec = _spec(llama_dir, quantization=quantization, dtype=dtype)
    assert (spec.device, spec.quantization) == ("cuda", quantization)


@pytest.mark.parametrize(
    ("quantization", "capability", "dtype", "words"),
    [
        ("fp8", AMPERE, "bfloat16", "FP8 matmuls need compute capability 8.9 or later, not 8.0"),
        ("int8", HOPPER, "float32", "its GPU kernels take bfloat16 or float16, not float32"),
        ("int8", (7, 5), "float16", "Triton kernel needs compute capability 8.0 or later"),
        ("fp8", None, "bfloat16", "it runs on a GPU (compute capability 8.9 or later)"),
    ],
)
def test_what_is_not_built_is_refused_naming_the_flag(
    llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str,
    capability: tuple[int, int] | None,
    dtype: str,
    words: str,
) -> None:
    if capability is not None:
        _on_a_gpu(monkeypatch, capability)
    with pytest.raises(ConfigError, match=f"--quantization {quantization}: ") as info:
        _spec(llama_dir, quantization=quantization, dtype=dtype, device="cpu")
    assert words in str(info.value)


@pytest.fixture(scope="module")
def llama_modules(llama_dir: Path) -> tuple[model_spec.ModelSpec, dict[str, torch.Tensor]]:
    """The Llama's spec (bf16, CPU) and its linear weights as loaded."""
    spec = _spec(llama_dir, dtype="bfloat16", device="cpu")
    model = cast(nn.Module, load_model(spec, Shard(0, 1), torch.device("cpu")))
    weights = {
        name: m.weight.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, PackableLinear) and m.weight is not None
    }
    return spec, weights


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_the_load_step_gives_every_linear_its_gpu_form(
    llama_modules: tuple[model_spec.ModelSpec, dict[str, torch.Tensor]], quantization: str
) -> None:
    spec, weights = llama_modules
    model = load_model(spec, Shard(0, 1), torch.device("cpu"))
    count = quantize_for_gpu(model, quantization, torch.device("cpu"))
    assert isinstance(model, nn.Module)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, PackableLinear)}
    body = {n: m for n, m in linears.items() if not isinstance(m, ParallelLMHead)}
    assert count == len(body) == 2 * 4  # 2 layers x (qkv, o, gate_up, down)
    assert linears["lm_head"].weight is not None and linears["lm_head"].gpu_quantized is None
    kind = Fp8Weight if quantization == "fp8" else PackedQuantWeight
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for name, module in body.items():
        assert isinstance(module.gpu_quantized, kind) and module.weight is None, name
    # One layer end to end through PackableLinear: the same numbers as its kernel called on
    # the weight quantized here (the interpreter runs one layer's Triton kernel in ~0.1 s).
    name = "layers.0.self_attn.qkv_proj"
    got = body[name](x)
    if quantization == "fp8":
        want = fp8_linear(x, quantize_fp8(weights[name]), None)
    else:
        from kernels.triton.quant_linear import quant_linear

        want = quant_linear(x, pack(quantize(weights[name])), None)
    assert torch.equal(got, want)
    # And near the layer's float product: a scale applied twice or not at all is far off.
    dense = x.float() @ weights[name].float().t()
    assert (got.float() - dense).abs().max() <= 0.1 * dense.abs().max()


def _fields(packed: PackedQuantWeight) -> torch.Tensor:
    """The 4-bit integers of a packed weight, read back without the kernel: [n, k]."""
    words = packed.words.to(torch.int64) & 0xFFFFFFFF  # [k / 8, n]
    fields = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1)
    return fields.reshape(packed.k, packed.n).t()


def test_gguf_blocks_reach_the_gpu_form_unchanged(
    llama_modules: tuple[model_spec.ModelSpec, dict[str, torch.Tensor]],
) -> None:
    """What the GGUF loader leaves (engine/loading/gguf_loader.py: each linear's Q4_1 blocks in
    the CPU kernel's layout, no float weight, a tied head's blocks apart), converted as a CUDA
    runner converts it: the integers, scales and mins reach the Triton layout unchanged, and
    the tied head's blocks are dropped for the embedding's de-quantized copy (the same weight)."""
    spec, weights = llama_modules
    model = load_model(spec, Shard(0, 1), torch.device("cpu"))
    assert isinstance(model, DecoderModel)
    gen = torch.Generator().manual_seed(3)
    blocks = {}
    for name, weight in weights.items():
        if name == "lm_head":
            continue
        n, k = weight.shape
        q = torch.randint(0, 16, (n, k), generator=gen).to(torch.int8)
        scales, mins = torch.rand(n, k // 32, generator=gen), torch.randn(n, k // 32, generator=gen)
        blocks[name] = QuantizedWeight(q, scales, mins, 4)
        module = model.get_submodule(name)
        assert isinstance(module, PackableLinear)
        module.quantized = cpu_pack(blocks[name])
        module.register_parameter("weight", None)
    model.lm_head_quantized = cpu_pack(blocks["layers.0.mlp.down_proj"])
    assert quantize_for_gpu(model, "gguf", torch.device("cpu")) == len(blocks)
    assert model.lm_head_quantized is None
    for name, want in blocks.items():
        module = model.get_submodule(name)
        assert isinstance(module, PackableLinear)
        form = module.gpu_quantized
        assert module.quantized is None and isinstance(form, PackedQuantWeight), name
        assert torch.equal(_fields(form), want.q.to(torch.int64)), name
        assert form.mins is not None and torch.equal(form.mins, want.mins.t()), name
        assert torch.equal(form.scales, want.scales.t()), name
