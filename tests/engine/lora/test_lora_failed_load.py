"""A step whose adapter fails to load does not run: the blocks its schedule registered by hash
were never written, so they leave the prefix cache (no later request may hit them) and no KV
event announces them; the adapter's requests end and the others run from the next step."""

from __future__ import annotations

import shutil
from pathlib import Path

from config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams
from tests.support.lora import make_adapter
from tests.support.models import finish_all

TOKENS = list(range(13))  # three full blocks of 4


def test_a_step_taken_back_leaves_no_cached_block_and_no_event() -> None:
    kv = KVCacheManager(16, 4, enable_caching=True, record_events=True)
    kept = Sequence("k", "k", 0, list(TOKENS), SamplingParams(), 0.0)
    kv.allocate_slots(kept, len(TOKENS))  # an earlier step's blocks: they stay
    kv.take_events()
    kv.begin_step()
    seq = Sequence("s", "s", 0, [7, *TOKENS], SamplingParams(), 0.0)
    kv.allocate_slots(seq, len(TOKENS) + 1)
    kv.unregister_step()
    assert kv.take_events() == []
    kv.free(seq)
    assert kv.get_computed_blocks(Sequence("t", "t", 0, [7, *TOKENS], SamplingParams(), 0.0)) == []
    assert len(kv.get_computed_blocks(Sequence("u", "u", 0, TOKENS, SamplingParams(), 0.0))) == 3
    assert kv.pool.num_free == 16 - 4  # `kept` still holds its four blocks
    # Computed again by a step that runs, the sequence registers its blocks then.
    kv.begin_step()
    kv.allocate_slots(seq, len(TOKENS) + 1)
    assert len(kv.take_events()) == 1


def test_a_failed_load_leaves_nothing_cached(llama_dir: Path, tmp_path: Path) -> None:
    a = make_adapter(llama_dir, tmp_path / "a", 4, 8, ["q_proj"], seed=41)
    b = make_adapter(llama_dir, tmp_path / "b", 4, 8, ["v_proj"], seed=42)
    shutil.copytree(a, tmp_path / "a-copy")
    lora_a, lora_b = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(llama_dir),
            enable_lora=True,
            max_loras=1,
            max_cpu_loras=1,
            max_lora_rank=4,
            block_size=4,
            num_kv_blocks=32,
            max_model_len=64,
        )
    )
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = list(range(5, 18))  # three full blocks
    engine.add_request("", params, request_id="a1", prompt_token_ids=prompt, lora_request=lora_a)
    # b's host copy pushes a's out; a's folder then goes: the slot load of a's step fails.
    engine.add_request("", params, request_id="b1", prompt_token_ids=prompt, lora_request=lora_b)
    shutil.rmtree(a)
    (aborted,) = engine.step()
    assert aborted.request_id == "a1" and aborted.finished
    assert finish_all(engine).keys() == {"b1"}
    shutil.copytree(tmp_path / "a-copy", a)
    engine.add_request("", params, request_id="a2", prompt_token_ids=prompt, lora_request=lora_a)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = first or out
    assert first is not None and first.num_cached_tokens == 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
