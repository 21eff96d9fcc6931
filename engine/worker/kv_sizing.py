"""How many KV blocks the pool gets.

The first that is set wins: `--num-kv-blocks`, `--kv-cache-memory-gib`, then on a GPU the share
`--gpu-memory-utilization` of its memory, less what is in use once the weights are loaded and
the activations of the largest step (one forward at the step's token budget, measured at
start-up). On a CPU the budget defaults to 1 GiB, or less where `--max-num-seqs` sequences of
`--max-model-len` tokens fill fewer blocks: a small model's 1 GiB pool holds millions of tokens
that no batch can use, and touching its pages at start-up (kernels/cpu/huge_pages.py) costs
about a second.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from config import ConfigError, EngineConfig
from engine.worker.model_input import HostBatch

log = logging.getLogger(__name__)

CPU_DEFAULT_GIB = 1.0
GIB = 2**30


@dataclass(frozen=True)
class MemoryReading:
    total: int  # bytes of device memory
    used: int  # bytes in use on the device now, by anyone: weights, allocator cache, CUDA context, other processes
    step_peak: (
        int  # bytes this process allocated at the profiled step's peak beyond what it holds now
    )


class MemoryProbe(Protocol):
    def start(self) -> None:
        """Forget earlier peaks: what follows is the step to measure."""

    def read(self) -> MemoryReading: ...


class CudaMemoryProbe:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryReading:
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()  # the step's activations are free: give the cached blocks back
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryReading(total, total - free, peak - torch.cuda.memory_allocated(self.device))


def kv_budget_bytes(reading: MemoryReading, utilization: float) -> int:
    return int(reading.total * utilization) - reading.used - reading.step_peak


def profile_batch(num_tokens: int, num_seqs: int, max_model_len: int, block_size: int) -> HostBatch:
    """The heaviest step the scheduler can make: `num_tokens` prompt tokens spread over up to
    `num_seqs` requests, each wanting its logits. Every slot is -1 and every table entry block 0,
    so it runs on a one-block scratch cache and stores nothing."""
    reqs = min(num_seqs, num_tokens)
    per_req = min(-(-num_tokens // reqs), max_model_len)
    query_lens: list[int] = []
    left = num_tokens
    while left > 0 and len(query_lens) < reqs:
        query_lens.append(min(per_req, left))
        left -= query_lens[-1]
    positions = [p for n in query_lens for p in range(n)]
    ends = [end - 1 for end in itertools.accumulate(query_lens)]
    width = -(-per_req // block_size)
    return HostBatch(
        input_ids=[0] * len(positions),
        positions=positions,
        slots=[-1] * len(positions),
        query_lens=query_lens,
        context_lens=list(query_lens),
        block_tables=torch.zeros((len(query_lens), width), dtype=torch.int32),
        logits_indices=ends,
        block_copies=[],
    )


def bookkeeping_blocks(config: EngineConfig, max_model_len: int, block_size: int) -> int:
    """An encoder's pool: blocks that are counted but never allocated (it keeps no KV), enough
    for a full step of sequences that each end in a partial block."""
    scheduler = config.scheduler
    step = -(-scheduler.max_num_batched_tokens // block_size) + scheduler.max_num_seqs
    return max(step, -(-max_model_len // block_size))


def fixed_pool_blocks(
    config: EngineConfig, bytes_per_block: int, on_gpu: bool, full_batch_blocks: int
) -> int | None:
    """The pool's size in blocks when a setting fixes it (or on a CPU); None: profile the GPU.
    `full_batch_blocks`: what `--max-num-seqs` sequences of `--max-model-len` tokens hold, the
    cap of the CPU's default budget."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_gib is not None:
        return max(1, int(cache.kv_cache_memory_gib * GIB) // bytes_per_block)
    if on_gpu:
        return None
    return max(1, min(int(CPU_DEFAULT_GIB * GIB) // bytes_per_block, full_batch_blocks))


def profiled_pool_blocks(
    config: EngineConfig,
    bytes_per_block: int,
    max_model_len: int,
    block_size: int,
    run_step: Callable[[HostBatch], object],
    probe: MemoryProbe,
) -> int:
    """The pool's size in blocks from --gpu-memory-utilization, after running the heaviest step."""
    sched, utilization = config.scheduler, config.cache.gpu_memory_utilization
    probe.start()
    run_step(
        profile_batch(sched.max_num_batched_tokens, sched.max_num_seqs, max_model_len, block_size)
    )
    reading = probe.read()
    budget = kv_budget_bytes(reading, utilization)
    log.info(
        "KV pool from --gpu-memory-utilization %.2f: %.2f GiB of %.2f GiB, less %.2f GiB in use after loading and "
        "%.2f GiB for a %d-token step, leaves %.2f GiB",
        utilization,
        reading.total * utilization / GIB,
        reading.total / GIB,
        reading.used / GIB,
        reading.step_peak / GIB,
        sched.max_num_batched_tokens,
        budget / GIB,
    )
    if budget < bytes_per_block:
        raise ConfigError(
            f"no GPU memory is left for the KV cache: {reading.used / GIB:.2f} GiB is in use after loading and a "
            f"{sched.max_num_batched_tokens}-token step needs {reading.step_peak / GIB:.2f} GiB more, of the "
            f"{reading.total * utilization / GIB:.2f} GiB that --gpu-memory-utilization {utilization} allows: raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, or set --num-kv-blocks"
        )
    return budget // bytes_per_block
