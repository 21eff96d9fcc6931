"""The events the KV cache records during a step, in the engine's own terms (raw chained
block hashes); engine/kv_events/wire.py turns them into vLLM's messages."""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's `medium` names: "GPU" is the engine's own KV pool, wherever it lives (also in a CPU's
# memory: llm-d reads it as the default tier); "CPU" is the host-memory offload tier.
POOL = "GPU"
HOST_TIER = "CPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of consecutive full blocks of one sequence entered the prefix cache."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the chain's previous block; None at a prompt's start
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    # The LoRA adapter the blocks were computed under (its K/V is its own), as vLLM reports it.
    lora_id: int | None = None
    lora_name: str | None = None
    # Per block, the hashes of the images its tokens stand for (None: none), as vLLM's
    # `extra_keys` carries them; None when no block has any.
    extra_keys: list[list[str] | None] | None = None
    medium: str = POOL  # where the blocks are now


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted from `medium`: their hashes no longer find anything there."""

    block_hashes: list[bytes]
    medium: str = POOL


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Forget every block of this engine (a fresh start, or a resync after lost batches)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventRecorder:
    """Collects a step's events on the engine thread: appends only, nothing encoded here."""

    events: list[KVEvent] = field(default_factory=list)

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
