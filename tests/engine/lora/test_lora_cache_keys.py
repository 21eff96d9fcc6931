"""The prefix cache's keys under LoRA, without a model: the same tokens under two adapters and
the base model hash to three different chains (so no lookup crosses them), and the KV events
of stored blocks name the adapter, as vLLM's do."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.kv_events.events import BlockStored
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")
TOKENS = list(range(17))  # 4 full blocks of 4, and a last token never taken from the cache


def _seq(seq_id: str, lora: LoRARequest | None) -> Sequence:
    return Sequence(seq_id, seq_id, 0, list(TOKENS), SamplingParams(), 0.0, lora=lora)


def test_adapters_key_their_own_blocks() -> None:
    kv = KVCacheManager(32, 4, enable_caching=True, record_events=True)
    first = _seq("a1", A)
    kv.allocate_slots(first, len(TOKENS))
    kv.free(first)
    assert len(kv.get_computed_blocks(_seq("a2", A))) == 4  # the same adapter: every block
    assert kv.get_computed_blocks(_seq("b1", B)) == []
    assert kv.get_computed_blocks(_seq("base", None)) == []
    # The same name from another folder is another adapter.
    moved = LoRARequest("a", 1, "/adapters/a-v2")
    assert kv.get_computed_blocks(_seq("a3", moved)) == []
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert (stored.lora_id, stored.lora_name) == (1, "a")
    assert stored.parent_block_hash is None and len(stored.block_hashes) == 4
