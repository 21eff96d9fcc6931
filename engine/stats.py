"""What the engine measured since the last look: the raw material of the Prometheus metrics.

Times are wall-clock timestamps: arrival when the request is handed to the engine (so the time it
waits for the engine thread to finish a step counts as queueing), the rest (first scheduled, first
token, each token, finish) taken on the engine thread, so that HTTP parsing and the frontend's
admission queue do not blur them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequest:
    """One user request (all its samples) that ended, with the latencies it reached: an aborted
    request that never got a token has no prefill or decode time."""

    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    prefill_time: float | None
    decode_time: float | None
    kv_wait_time: float = 0.0  # waiting because the KV pool had no room (part of queue time)
    lora_name: str | None = None  # the LoRA adapter it ran under


@dataclass
class SpecDecodeStats:
    """Speculative decoding since the previous snapshot, as vLLM counts it: a draft is one
    sequence's guessed tokens in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token at position i was accepted (so non-increasing in i).
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_accepted - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, grow))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass
class KVOffloadStats:
    """The KV offload tiers (--kv-offloading-size, --kv-offloading-disk-dir), by tier name
    ("host", "disk"): bytes copied into each and back out of it since the previous snapshot,
    blocks it dropped since then, and each one's use now."""

    bytes_stored: dict[str, int] = field(default_factory=dict)
    bytes_loaded: dict[str, int] = field(default_factory=dict)
    used_bytes: dict[str, int] = field(default_factory=dict)
    capacity_bytes: dict[str, int] = field(default_factory=dict)
    # Blocks a tier did not take because its write queue was full (the disk tier, when the disk
    # writes more slowly than steps fill blocks): those blocks are not on disk.
    blocks_dropped: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineStats:
    # The state now.
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    # Counts since the previous snapshot.
    num_preemptions: int = 0
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    # The KV offload tiers, asked after the pool (vLLM's connector counters): the prompt
    # tokens of the requests that asked, and the tokens found there.
    external_prefix_cache_queries: int = 0  # tokens
    external_prefix_cache_hits: int = 0  # tokens
    kv_events_dropped: int = 0  # KV event batches dropped on the publisher's full queue
    prompt_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    iteration_tokens: list[int] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    # The LoRA adapters of the running and the waiting requests now, by name (LoRA on only).
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)
    # Adapters unloaded since the previous snapshot, once no request ran under them any more.
    unloaded_loras: list[str] = field(default_factory=list)
    # Images (vision-language models only): encoder-cache lookups and hits, images encoded,
    # and each prompt's image preprocessing time (seconds).
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    mm_images_encoded: int = 0
    mm_preprocessing_seconds: list[float] = field(default_factory=list)
    # Speculative decoding (--speculative-config) only.
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # The KV offload tiers (on only with one).
    kv_offload: KVOffloadStats | None = None
