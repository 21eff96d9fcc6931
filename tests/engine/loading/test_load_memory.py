"""Quantized models load without ever holding their dense linear weights.

The model is built on the meta device; loading a quantized file must allocate on the real
device only the parameters that stay dense (embedding, norms, biases, an untied head), never
the float weight of a linear that is kept quantized. Counted exactly, not through memory
readings: a dispatch mode adds up the bytes of every tensor made from a meta tensor (what
`to_empty` does, whichever way it is reached) while `load_model` runs, and that must equal
the bytes of the parameters and buffers the loaded model holds. Loading every parameter and
dropping the quantized ones afterwards (as the loaders once did) allocates more. And the
integers are packed one module at a time: after each tensor read, at most one module (a fused
q/k/v or gate/up still missing a part) holds unpacked integers."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from config import EngineConfig
from engine.distributed.shard import Shard
from engine.errors import ModelLoadError
from engine.loading.default_model import gguf_path
from engine.loading.model_loader import load_model
from engine.loading.model_spec import resolve_model_spec
from engine.loading.quantized_linears import QuantizedPlacer
from engine.models.base import DecoderModel
from engine.models.layers.linear import PackableLinear
from engine.models.registry import model_class
from kernels.cpu.quant_layout import QuantizedWeight
from tests.support.models import build_random_model
from tests.support.quantized_checkpoints import compress


class Materialized(TorchDispatchMode):
    """The bytes of every real tensor an op makes from a meta one."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        from_meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_leaves(args))
        if from_meta and isinstance(out, torch.Tensor) and not out.is_meta:
            self.bytes += out.nbytes
        return out


def _held_bytes(model: nn.Module) -> int:
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


@dataclass
class Loaded:
    model: nn.Module
    materialized: int  # bytes made from meta tensors
    most_pending: int  # modules holding unpacked integers, at most, after a tensor is read


def _load_counted(monkeypatch: pytest.MonkeyPatch, model: str, **flags: object) -> Loaded:
    config = EngineConfig.model_validate({"model": {"model": model, **flags}})
    spec = resolve_model_spec(config)
    pending = [0]
    add = QuantizedPlacer.add

    def counted_add(placer: QuantizedPlacer, *args: Any) -> None:
        add(placer, *args)
        pending[0] = max(pending[0], len(placer.pending))

    monkeypatch.setattr(QuantizedPlacer, "add", counted_add)
    with Materialized() as counted:
        loaded = load_model(spec, Shard(0, 1), torch.device("cpu"))
    assert isinstance(loaded, nn.Module)
    return Loaded(loaded, counted.bytes, pending[0])


@pytest.fixture(scope="module")
def w4_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """compressed-tensors W4A16 of a random Llama (untied head) and Qwen2 (q/k/v biases)."""
    root = tmp_path_factory.mktemp("load-memory")
    folders = {}
    for arch, tokenizer in (("llama", "llama"), ("qwen2", "qwen")):
        src = build_random_model(root / f"{arch}-src", arch, tokenizer, vocab_size=512)
        folders[arch] = compress(src, root / arch, "W4A16", "pack-quantized", 32)
    return folders


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_quantized_checkpoint_allocates_only_its_dense_parameters(
    w4_folders: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = _load_counted(monkeypatch, str(w4_folders[arch]), dtype="bfloat16")
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    quantized = [m for m in linears if m.quantized is not None]
    # Every linear of the layers is packed (the head stays dense in these checkpoints).
    assert len(quantized) == len(linears) - (1 if hasattr(model, "lm_head") else 0) > 0
    assert all(m.weight is None for m in quantized)
    assert loaded.materialized == _held_bytes(model)
    assert loaded.most_pending == 1
    if arch == "qwen2":  # the q/k/v biases were filled after the allocation, and kept
        biases = [m.quantized_bias for m in quantized if m.bias is not None]
        assert biases and all(b is not None and b.abs().sum() > 0 for b in biases)


def test_the_default_gguf_allocates_only_its_dense_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SmolLM2-135M's Q4_1 file (tied head): its linears' bf16 weights would be 2 bytes x 30
    layers x 3.54M weights = 212 MB; what is allocated is the bf16 embedding (57 MB) and the
    norms."""
    loaded = _load_counted(monkeypatch, str(gguf_path()), dtype="bfloat16")
    model = loaded.model
    assert loaded.materialized == _held_bytes(model)
    assert loaded.most_pending == 1  # the file's order: attn_k, attn_output, attn_q, attn_v
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    assert len(linears) == 30 * 4 and all(m.quantized is not None for m in linears)
    assert all(m.weight is None for m in linears)
    embedding = model.get_submodule("embed_tokens").weight
    assert isinstance(embedding, torch.Tensor)
    assert loaded.materialized < embedding.nbytes * 1.01
    assert getattr(model, "lm_head_quantized", None) is not None


def test_a_fused_module_missing_a_part_is_refused_naming_it(
    w4_folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(w4_folders["llama"], tmp_path / "no-q"))
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    prefix = "model.layers.1.self_attn.q_proj."
    save_file({k: v for k, v in tensors.items() if not k.startswith(prefix)}, str(path))
    config = EngineConfig.model_validate({"model": {"model": str(folder)}})
    with pytest.raises(ModelLoadError) as info:
        load_model(resolve_model_spec(config), Shard(0, 1), torch.device("cpu"))
    assert (
        str(info.value)
        == f"{folder}: layers.1.self_attn.qkv_proj has no quantized tensor for ['q']"
    )


def test_a_module_read_twice_is_refused(w4_folders: dict[str, Path]) -> None:
    spec = resolve_model_spec(
        EngineConfig.model_validate({"model": {"model": str(w4_folders["llama"])}})
    )
    with torch.device("meta"):
        model = model_class(spec.architecture)(spec.hf_config, Shard(0, 1))
    assert isinstance(model, DecoderModel)
    module = model.get_submodule("layers.0.self_attn.o_proj")
    assert isinstance(module, PackableLinear) and module.weight is not None
    n, k = module.weight.shape
    weight = QuantizedWeight(torch.zeros(n, k, dtype=torch.int8), torch.ones(n, k // 32))
    placer = QuantizedPlacer(model, spec.path)
    placer.add("layers.0.self_attn.o_proj", None, weight)
    assert module.weight is None and module.quantized is not None  # packed at once, on meta
    with pytest.raises(
        ModelLoadError, match=r"layers\.0\.self_attn\.o_proj \(None\) is stored twice"
    ):
        placer.add("layers.0.self_attn.o_proj", None, weight)
