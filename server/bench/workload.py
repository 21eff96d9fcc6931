"""Random-token workloads: the same prompts for the same arguments, on any server.

Standard library only: the GPU check scripts import this on machines that have little else.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

LOW_TOKEN_ID = 1000  # below this, vocabularies keep special and control tokens


@dataclass
class WorkItem:
    prompt_ids: list[int]
    output_len: int


def make_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 49152,
    seed: int | str = 0,
) -> list[WorkItem]:
    """Prompts of random token ids and their output lengths, the same for the same arguments.

    With `range_ratio` r, each length is drawn uniformly from [len * (1 - r), len * (1 + r)].
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if vocab_size <= LOW_TOKEN_ID + 1:
        raise ValueError(f"vocab_size must be above {LOW_TOKEN_ID + 1}, got {vocab_size}")
    rng = random.Random(seed)

    def length(center: int) -> int:
        low, high = int(center * (1 - range_ratio)), math.ceil(center * (1 + range_ratio))
        return max(1, rng.randint(low, high))

    items = []
    for _ in range(num_requests):
        n_in, n_out = length(input_len), length(output_len)
        items.append(
            WorkItem([rng.randint(LOW_TOKEN_ID, vocab_size - 1) for _ in range(n_in)], n_out)
        )
    return items


def warmup_workload(count: int, input_len: int, vocab_size: int, seed: int) -> list[WorkItem]:
    """Short requests with prompts of their own: reusing a measured prompt would let a server's
    prefix cache skip that request's prefill in the measured run."""
    return make_workload(count, input_len, 4, 0.0, vocab_size, f"warmup-{seed}")


def arrival_delays(
    count: int, request_rate: float, seed: int, burstiness: float = 1.0
) -> list[float]:
    """Seconds to wait before each arrival; all zero for an infinite rate. The gaps are gamma
    distributed with shape `burstiness` and mean 1 / rate (vLLM's --burstiness): 1 is a Poisson
    process, below 1 arrivals bunch up (the gaps' coefficient of variation is 1 / sqrt(shape)),
    above 1 they even out."""
    if math.isinf(request_rate):
        return [0.0] * count
    # Its own generator: changing the rate must not change the prompts.
    rng = random.Random(seed + 1_000_003)
    if burstiness == 1.0:  # the exponential draws, as before the flag existed
        return [rng.expovariate(request_rate) for _ in range(count)]
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(count)]
