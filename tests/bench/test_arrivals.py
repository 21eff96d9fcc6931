"""`pagedserve bench serve --request-rate R --burstiness B`: the gaps between arrivals have mean
1 / R and the spread a gamma of shape B gives (coefficient of variation 1 / sqrt(B)); B = 1 is
the Poisson process the runs before the flag drew, gap for gap; (what the flag refuses: test_bench_cli.py)."""

from __future__ import annotations

import random
import statistics

import pytest

from server.bench.workload import arrival_delays
from server.cli import build_parser


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_gaps_have_the_rates_mean_and_the_shapes_spread(shape: float) -> None:
    gaps = arrival_delays(20_000, 4.0, seed=3, burstiness=shape)
    mean = statistics.fmean(gaps)
    assert abs(mean - 0.25) < 0.25 * 0.05
    variation = statistics.pstdev(gaps) / mean
    assert abs(variation - shape**-0.5) < shape**-0.5 * 0.06


def test_a_burstiness_of_1_is_the_poisson_process_as_before() -> None:
    rng = random.Random(7 + 1_000_003)
    assert arrival_delays(50, 2.0, seed=7) == [rng.expovariate(2.0) for _ in range(50)]
    assert arrival_delays(50, 2.0, seed=7, burstiness=1.0) == arrival_delays(50, 2.0, seed=7)
    assert arrival_delays(3, float("inf"), seed=7, burstiness=0.5) == [0.0, 0.0, 0.0]


def test_the_flag_reaches_the_load() -> None:
    args = build_parser().parse_args(
        ["bench", "serve", "--request-rate", "8", "--burstiness", "0.5"]
    )
    assert (args.request_rate, args.burstiness) == (8.0, 0.5)
    assert build_parser().parse_args(["bench", "serve"]).burstiness == 1.0
