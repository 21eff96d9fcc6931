"""Unloading an adapter that requests still run under: they finish under it, and the adapter
(its slot and its host copy) is dropped when the last of them ends, not kept for ever; a
request whose adapter cannot be read blames its `model`."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora import LoRALoadError, LoRARequest
from engine.sampling_params import SamplingParams
from tests.support.lora import make_adapter
from tests.support.models import finish_all


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig.from_kwargs(
            model=str(llama_dir),
            enable_lora=True,
            max_loras=1,
            max_lora_rank=4,
            num_kv_blocks=16,
            block_size=8,
            max_model_len=64,
        )
    )


def test_an_adapter_unloaded_in_use_is_dropped_when_its_last_request_ends(
    engine: LLMEngine, llama_dir: Path, tmp_path: Path
) -> None:
    lora = LoRARequest("a", 1, str(make_adapter(llama_dir, tmp_path / "a", 4, 8, ["q_proj"], 51)))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = list(range(5, 11))
    for request_id in ("r1", "r2"):
        engine.add_request("", params, request_id, prompt_token_ids=prompt, lora_request=lora)
    engine.step()
    engine.remove_lora(lora)
    host = engine.executor.runner.lora
    assert lora in host.cache and engine.loras.assignment.slots == [lora]  # still in use
    engine.abort_request("r1")
    assert lora in host.cache  # r2 still runs under it
    assert finish_all(engine).keys() == {"r2"}
    assert lora not in host.cache and engine.loras.assignment.slots == [None]
    assert engine.take_stats().unloaded_loras == ["a"]  # its metrics series go too


def test_a_request_whose_adapter_cannot_be_read_names_its_model(
    engine: LLMEngine, tmp_path: Path
) -> None:
    """A completion names its adapter by `model`, not by a folder: that is the field to blame."""
    gone = LoRARequest("gone", 9, str(tmp_path / "nowhere"))
    with pytest.raises(LoRALoadError, match="no such folder") as refused:
        engine.add_request(
            "", SamplingParams(max_tokens=1), prompt_token_ids=[5], lora_request=gone
        )
    assert refused.value.param == "model"
    assert not engine.has_unfinished_requests()
    with pytest.raises(LoRALoadError) as loading:
        engine.add_lora(gone)  # a load names the folder
    assert loading.value.param == "lora_path"
