"""An adapter's files are user input: only regular files are read, each within its cap, so that
a named pipe, a device or an outsized file is refused (naming the file) instead of hanging or
exhausting the reader; the weights' cap is what the largest adapter the slots could serve may
hold, and such an adapter (float64, every target, the slots' rank) still loads. Weights that
are NaN or infinite, as read or once made float32, are refused naming their module."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.lora import LoRALoadError, LoRARequest
from engine.lora.slots import LoRASlots
from engine.models.llama import LlamaForCausalLM
from tests.support.lora import ALL_TARGETS, make_adapter

RANK = 8
# How long a read that should be refused at once may take before the test gives up on it:
# a guard against the hang being tested for, not a measure of speed.
HANG_GUARD_SECONDS = 60


@pytest.fixture(scope="module")
def adapter(llama_dir: Path, tmp_path_factory) -> Path:
    return make_adapter(
        llama_dir, tmp_path_factory.mktemp("files") / "a", 4, 8, ["q_proj", "down_proj"], seed=5
    )


@pytest.fixture(scope="module")
def slots(llama_dir: Path) -> LoRASlots:
    from transformers import AutoConfig

    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(llama_dir))
    return LoRASlots(model.to_empty(device="cpu").float(), 1, RANK, max_cpu_loras=1)


@pytest.fixture
def fifos() -> Iterator[list[Path]]:
    """Named pipes a test makes; after it, each is opened for writing once, which releases a
    reader that blocked on it (so a failing test cannot leave a thread hung)."""
    made: list[Path] = []
    yield made
    for fifo in made:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting: nothing to release
            pass


def _copy(adapter: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapter, tmp_path / "copy"))


def _read(slots: LoRASlots, folder: Path) -> None:
    """Read the adapter as a load does, on a thread of its own so that a hang fails the test
    instead of stopping the suite."""
    slots.forget(LoRARequest("x", 1, str(folder)))
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(slots.read, LoRARequest("x", 1, str(folder))).result(HANG_GUARD_SECONDS)
    finally:
        pool.shutdown(wait=False)  # (a hung read is released by `fifos` after the test)


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_named_pipe_is_refused(slots, adapter, tmp_path, fifos, name):
    folder = _copy(adapter, tmp_path)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    fifos.append(folder / name)
    with pytest.raises(LoRALoadError, match=rf"{name} is a named pipe \(FIFO\), not a regular"):
        _read(slots, folder)


def test_a_device_is_refused_unopened(slots, adapter, tmp_path):
    """/dev/zero never ends: read whole, it would fill the memory."""
    folder = _copy(adapter, tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(
        LoRALoadError, match=r"adapter_model\.safetensors is a character device, not a regular"
    ):
        _read(slots, folder)


def test_a_config_past_its_cap_is_refused(slots, adapter, tmp_path):
    folder = _copy(adapter, tmp_path)
    config = folder / "adapter_config.json"
    config.write_bytes(config.read_bytes() + b" " * (1 << 20))  # still valid JSON
    with pytest.raises(LoRALoadError, match=r"adapter_config\.json holds \d+ bytes, more than"):
        _read(slots, folder)


def test_the_weights_cap_is_the_largest_servable_adapter(slots, llama_dir, tmp_path):
    """Float64 tensors of the slots' rank on every target fit under the cap; a file one byte
    past it is refused before it is read (sparse: no byte of it is ever written)."""
    widest = make_adapter(llama_dir, tmp_path / "widest", RANK, 16, ALL_TARGETS, seed=6)
    weights = widest / "adapter_model.safetensors"
    save_file({k: v.double() for k, v in load_file(weights).items()}, weights)
    _read(slots, widest)
    assert os.path.getsize(weights) <= slots.max_weights_bytes

    with open(weights, "r+b") as f:
        f.truncate(slots.max_weights_bytes + 1)
    with pytest.raises(
        LoRALoadError,
        match=rf"holds {slots.max_weights_bytes + 1} bytes, more than the "
        rf"{slots.max_weights_bytes} allowed \(the most an adapter of rank {RANK} for this model",
    ):
        _read(slots, widest)


@pytest.mark.parametrize(
    "which, value",
    [("lora_A", float("nan")), ("lora_B", float("inf")), ("lora_B", float("-inf"))],
)
def test_non_finite_weights_are_refused(slots, adapter, tmp_path, which, value):
    folder = _copy(adapter, tmp_path)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if f"layers.1.mlp.down_proj.{which}" in k)
    tensors[name][0, 0] = value
    save_file(tensors, weights)
    with pytest.raises(
        LoRALoadError, match=rf"model\.layers\.1\.mlp\.down_proj: {which} holds NaN or infinite"
    ):
        _read(slots, folder)


def test_a_float64_weight_beyond_float32_is_refused(slots, adapter, tmp_path):
    """1e300 is finite as read, and infinite once made float32, the dtype it is served in."""
    folder = _copy(adapter, tmp_path)
    weights = folder / "adapter_model.safetensors"
    tensors = {k: v.double() for k, v in load_file(weights).items()}
    name = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    tensors[name][1, 2] = 1e300
    save_file(tensors, weights)
    with pytest.raises(
        LoRALoadError, match=r"model\.layers\.0\.self_attn\.q_proj: lora_A holds NaN or infinite"
    ):
        _read(slots, folder)
