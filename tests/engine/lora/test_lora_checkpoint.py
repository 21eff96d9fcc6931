"""PEFT checkpoints read, checked and placed: scaling (plain and rsLoRA), every bad adapter
refused with a typed error that names the problem (missing folder, rank above the slots',
unsupported or foreign target modules, another base model's shapes, a corrupt safetensors
file), fused q/k/v and gate/up placed by part, and each tensor-parallel rank's slice."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from engine.distributed.shard import WHOLE, Shard
from engine.lora import LoRACheckpoint, LoRALoadError, LoRARequest, read_checkpoint
from engine.lora.slots import LoRASlots
from engine.models.llama import LlamaForCausalLM
from tests.support.lora import ALL_TARGETS, make_adapter
from tests.support.models import build_random_model


@pytest.fixture(scope="module")
def adapter(llama_dir: Path, tmp_path_factory) -> Path:
    return make_adapter(
        llama_dir, tmp_path_factory.mktemp("ckpt") / "a", 8, 16, ALL_TARGETS, seed=3
    )


# Far above any adapter made here: the weights' cap has tests of its own (test_lora_files.py).
ANY_SIZE = 1 << 30


def _read(folder: Path, max_rank: int) -> LoRACheckpoint:
    return read_checkpoint(folder, max_rank, max_weights_bytes=ANY_SIZE)


def _copy(adapter: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapter, tmp_path / "copy"))


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_reads_rank_scaling_and_modules(adapter):
    ckpt = _read(adapter, max_rank=8)
    assert ckpt.rank == 8 and ckpt.scaling == 2.0
    assert len(ckpt.modules) == 2 * 7  # two layers, seven projections each
    a, b = ckpt.modules["model.layers.1.mlp.down_proj"]
    assert a.shape == (8, 128) and b.shape == (64, 8)


def test_rslora_scaling(adapter, tmp_path):
    folder = _copy(adapter, tmp_path)
    _edit_config(folder, use_rslora=True)
    assert _read(folder, max_rank=8).scaling == pytest.approx(16 / math.sqrt(8))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"r": 8}, None),
        ({"use_dora": True}, "use_dora not supported"),
        ({"target_modules": ["q_proj", "lm_head"]}, r"target modules \['lm_head'\]"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern not supported"),
        ({"peft_type": "IA3"}, "is not LORA"),
        ({"target_modules": 5}, "target_modules must be a string or a list of strings, got 5"),
        ({"target_modules": [1]}, r"target_modules must be .* got \[1\]"),
        ({"r": True}, "rank r must be a positive integer, got True"),
        ({"r": "8"}, "rank r must be a positive integer, got '8'"),
        ({"lora_alpha": [16]}, r"lora_alpha must be a number, got \[16\]"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false, got 'yes'"),
        ({"peft_type": ["LORA"]}, "is not LORA"),
        # Python's json writes and reads these literals (NaN, Infinity, -Infinity).
        ({"lora_alpha": float("nan")}, "lora_alpha must be a finite positive number, got nan"),
        ({"lora_alpha": float("inf")}, "lora_alpha must be a finite positive number, got inf"),
        ({"lora_alpha": float("-inf")}, "lora_alpha must be a finite positive number, got -inf"),
        ({"lora_alpha": 0}, "lora_alpha must be a finite positive number, got 0"),
        ({"lora_alpha": -16}, "lora_alpha must be a finite positive number, got -16"),
        ({"lora_alpha": 10**400}, "lora_alpha must be a finite positive number, got 1000"),
        ({"lora_alpha": 1e300}, "lora_alpha must be a finite positive number, got 1e"),
    ],
)
def test_config_checks(adapter, tmp_path, change, message):
    folder = _copy(adapter, tmp_path)
    _edit_config(folder, **change)
    if message is None:
        _read(folder, max_rank=8)
        return
    with pytest.raises(LoRALoadError, match=message):
        _read(folder, max_rank=8)


def test_missing_folder_rank_and_corrupt_file(adapter, tmp_path):
    with pytest.raises(LoRALoadError, match="no such folder") as missing:
        _read(tmp_path / "nowhere", max_rank=8)
    assert missing.value.param == "lora_path"
    with pytest.raises(LoRALoadError, match="rank 8 is above --max-lora-rank 4"):
        _read(adapter, max_rank=4)
    folder = _copy(adapter, tmp_path)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(LoRALoadError, match="not a readable safetensors file"):
        _read(folder, max_rank=8)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoRALoadError, match=r"no adapter_config\.json"):
        _read(folder, max_rank=8)


def _model(model_dir: Path, shard: Shard = WHOLE) -> LlamaForCausalLM:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, shard)
    return model.to_empty(device="cpu").float()


def test_another_base_model_is_refused(adapter, tmp_path):
    """An adapter of a wider model (hidden 96), and one naming a layer the model lacks."""
    wide = build_random_model(tmp_path / "wide", "llama", "llama", vocab_size=512, hidden_size=96)
    slots = LoRASlots(_model(wide), num_slots=1, rank=8, max_cpu_loras=1)
    with pytest.raises(LoRALoadError, match="does not fit this base model"):
        slots.load(0, LoRARequest("a", 1, str(adapter)))
    deep = build_random_model(
        tmp_path / "deep", "llama", "llama", vocab_size=512, num_hidden_layers=3
    )
    deep_adapter = make_adapter(deep, tmp_path / "deep_a", 4, 4, ["o_proj"], seed=0)
    small = build_random_model(tmp_path / "small", "llama", "llama", vocab_size=512)
    slots = LoRASlots(_model(small), num_slots=1, rank=8, max_cpu_loras=1)
    with pytest.raises(
        LoRALoadError, match=re.escape("no adaptable layer 'model.layers.2.self_attn.o_proj'")
    ):
        slots.load(0, LoRARequest("deep", 1, str(deep_adapter)))


def test_fused_parts_and_tensor_parallel_slices(llama_dir, adapter):
    """q/k/v and gate/up land in their part of the fused layer; rank r of 2 keeps B's rows of
    its heads and columns (column-parallel) and A's columns of its inputs (row-parallel)."""
    ckpt = _read(adapter, max_rank=8)
    request = LoRARequest("a", 1, str(adapter))
    for rank in (0, 1):
        model = _model(llama_dir, Shard(rank, 2))
        slots = LoRASlots(model, num_slots=2, rank=8, max_cpu_loras=1)
        slots.load(1, request)
        attn = model.layers[0].self_attn
        lora = attn.qkv_proj.lora
        width = 2 * 8  # two slots of rank 8
        q_a, q_b = ckpt.modules["model.layers.0.self_attn.q_proj"]
        v_a, v_b = ckpt.modules["model.layers.0.self_attn.v_proj"]
        q_rows = attn.q_size
        assert torch.equal(lora.a[8:16], q_a)  # part 0 (q), slot 1
        assert torch.equal(lora.a[2 * width + 8 : 2 * width + 16], v_a)  # part 2 (v), slot 1
        assert torch.equal(lora.b[0][:, 8:16], q_b[rank * q_rows : (rank + 1) * q_rows])
        assert not lora.a[:8].any()  # slot 0 stays empty
        # One KV head for two ranks: both hold all of it.
        assert torch.equal(lora.b[2][:, 8:16], v_b)
        down = model.layers[1].mlp.down_proj
        d_a, d_b = ckpt.modules["model.layers.1.mlp.down_proj"]
        half = d_a.shape[1] // 2
        assert torch.equal(down.lora.a[8:16], d_a[:, rank * half : (rank + 1) * half])
        assert torch.equal(down.lora.b[0][:, 8:16], d_b)
        assert slots.scales.tolist() == [0.0, 2.0]
        slots.clear(1)
        assert not lora.a.any() and not down.lora.b[0].any()


@pytest.mark.parametrize("rows", [lambda full: full * 3 // 4, lambda full: full * 2])
def test_rank_zero_refuses_a_b_that_fits_only_its_own_slice(llama_dir, adapter, tmp_path, rows):
    """Under tensor parallelism 2, a q_proj B with 3/4 of q's rows covers rank 0's half (and
    not rank 1's), and one with twice the rows gives every rank some slice: rank 0 checks for
    all ranks, so both are refused on rank 0, before any worker reads them."""
    from safetensors.torch import load_file, save_file

    folder = _copy(adapter, tmp_path)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_B" in k)
    full = tensors[name].shape[0]
    tensors[name] = torch.randn(rows(full), tensors[name].shape[1])
    save_file(tensors, weights)
    slots = LoRASlots(_model(llama_dir, Shard(0, 2)), num_slots=1, rank=8, max_cpu_loras=1)
    with pytest.raises(
        LoRALoadError, match=rf"qkv_proj: B \({rows(full)}, 8\) for {full} output features of q$"
    ):
        slots.load(0, LoRARequest("a", 1, str(folder)))


def test_an_unexpected_error_while_reading_is_a_load_error(adapter, monkeypatch):
    """Whatever a checkpoint makes the reader raise is the adapter's 400, never a 500."""
    from engine.lora import checkpoint

    def broken(path, tensors, rank):
        raise KeyError("weird")

    monkeypatch.setattr(checkpoint, "_pair_tensors", broken)
    with pytest.raises(LoRALoadError, match="cannot be read: KeyError: 'weird'") as caught:
        _read(adapter, max_rank=8)
    assert caught.value.param == "lora_path"
