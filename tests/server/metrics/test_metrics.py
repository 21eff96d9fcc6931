"""/metrics over real HTTP, parsed as Prometheus parses it: exact token and request counts from
known workloads, histogram counts per request and per token, gauges that go back to 0 once
the engine is idle (also after aborts), preemptions, prefix-cache hits, vLLM's names."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from config import ServerConfig
from server.app import attach_metrics
from tests.support.server_harness import (
    MODEL,
    RunningServer,
    Samples,
    scrape,
    start_engine,
    value,
    wait_until,
    wait_until_idle,
)

LABEL = (("model_name", MODEL),)


def delta(before: Samples, after: Samples) -> Callable[..., float]:
    return lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)


def prompts(count: int, seed: int, length: Callable[[int], int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length(i))] for i in range(count)]


def test_exact_counts_after_known_requests(server: RunningServer) -> None:
    n, max_tokens = 4, 6
    batch = prompts(n, seed=11, length=lambda i: 20 + 9 * i)
    wait_until_idle(server.engine)
    before = scrape(server.url)
    for prompt in batch:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    wait_until_idle(server.engine)
    after = scrape(server.url)
    d = delta(before, after)

    prompt_total = sum(len(p) for p in batch)
    assert d("prompt_tokens_total") == prompt_total
    assert d("generation_tokens_total") == n * max_tokens
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert d(name + "_count") == n, name
    assert d("inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert d("request_prompt_tokens_sum") == prompt_total
    assert d("request_generation_tokens_sum") == n * max_tokens
    assert d("request_success_total", finished_reason="length") == n
    assert d("request_success_total", finished_reason="stop") == 0
    assert d("request_success_total", finished_reason="abort") == 0
    # Every step's scheduled tokens: the prompts (less what the prefix cache served) and one
    # decode token per sample for each token after the first.
    assert d("prefix_cache_queries_total") == prompt_total
    computed = prompt_total - d("prefix_cache_hits_total") + n * (max_tokens - 1)
    assert d("iteration_tokens_total_sum") == computed
    # Idle now: the gauges say so.
    assert value(after, "num_requests_running") == 0
    assert value(after, "num_requests_waiting") == 0
    assert value(after, "kv_cache_usage_perc") == 0


def test_vllm_names_types_and_cache_info(server: RunningServer) -> None:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    expected = {
        "kv_cache_usage_perc": "gauge",
        "num_requests_running": "gauge",
        "num_requests_waiting": "gauge",
        "time_to_first_token_seconds": "histogram",
        "inter_token_latency_seconds": "histogram",
        "e2e_request_latency_seconds": "histogram",
        "request_queue_time_seconds": "histogram",
        "request_prefill_time_seconds": "histogram",
        "request_decode_time_seconds": "histogram",
        "request_prompt_tokens": "histogram",
        "request_generation_tokens": "histogram",
        "prompt_tokens": "counter",
        "generation_tokens": "counter",
        "num_preemptions": "counter",
        "prefix_cache_queries": "counter",
        "prefix_cache_hits": "counter",
        "request_success": "counter",
        "iteration_tokens_total": "histogram",
        "cache_config_info": "gauge",
    }
    for name, kind in expected.items():
        assert types.get("pagedserve:" + name) == kind, name
    samples = scrape(server.url)
    info = {k: v for k, v in samples.items() if k[0] == "pagedserve:cache_config_info"}
    assert list(info.values()) == [1.0]
    labels = dict(next(iter(info))[1])
    assert labels == {"block_size": "16", "num_gpu_blocks": "1024"}
    # vLLM's TTFT buckets, and token buckets 1-2-5 up to max_model_len (8192).
    ttft_bounds = [
        dict(k[1])["le"] for k in samples if k[0] == "pagedserve:time_to_first_token_seconds_bucket"
    ]
    assert ttft_bounds[:3] == ["0.001", "0.005", "0.01"] and ttft_bounds[-2:] == ["2560.0", "+Inf"]
    prompt_bounds = [
        dict(k[1])["le"] for k in samples if k[0] == "pagedserve:request_prompt_tokens_bucket"
    ]
    assert prompt_bounds[-3:] == ["2000.0", "5000.0", "+Inf"]


def test_default_names_are_ours_alone(server: RunningServer) -> None:
    """vLLM's names and its `engine` label appear only with `--metrics-names vllm`."""
    families = list(
        text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text)
    )
    assert families and all(f.name.startswith("pagedserve:") for f in families)
    labels = {name for f in families for s in f.samples for name in s.labels}
    assert labels == {
        "model_name",
        "finished_reason",
        "reason",
        "le",
        "block_size",
        "num_gpu_blocks",
    }


def test_kv_usage_while_running_then_zero_and_aborts_counted(server: RunningServer) -> None:
    wait_until_idle(server.engine)
    before = scrape(server.url)
    body = {
        "model": MODEL,
        "prompt": "Count slowly:",
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def main() -> list[Samples]:
        seen: list[Samples] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for _ in range(3):
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    events = 0
                    async for line in response.aiter_lines():
                        events += line.startswith("data: ")
                        if events == 4:
                            seen.append(await asyncio.to_thread(scrape, server.url))
                            break  # the client goes away mid-stream
        return seen

    during = asyncio.run(main())
    assert all(
        value(s, "kv_cache_usage_perc") > 0 and value(s, "num_requests_running") == 1
        for s in during
    )
    state = wait_until_idle(server.engine)
    after = wait_until(
        lambda: scrape(server.url),
        10,
        until=lambda samples: (
            delta(before, samples)("request_success_total", finished_reason="abort") >= 3
        ),
        what="3 aborts counted",
    )
    d = delta(before, after)
    assert state.free_blocks == state.num_blocks
    assert d("request_success_total", finished_reason="abort") == 3
    assert d("time_to_first_token_seconds_count") == 3  # they got tokens before going
    assert d("e2e_request_latency_seconds_count") == 3
    assert d("request_decode_time_seconds_count") == 3
    assert value(after, "num_requests_running") == 0
    assert value(after, "num_requests_waiting") == 0
    assert value(after, "kv_cache_usage_perc") == 0


def test_prefix_cache_hits_in_tokens(server: RunningServer) -> None:
    (shared,) = prompts(1, seed=23, length=lambda i: 100)
    wait_until_idle(server.engine)
    before = scrape(server.url)
    for _ in range(2):
        body = {"model": MODEL, "prompt": shared, "max_tokens": 2, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    wait_until_idle(server.engine)
    d = delta(before, scrape(server.url))
    assert d("prefix_cache_queries_total") == 200
    # The second request finds the first's full blocks, all but the block of the last token,
    # which is always recomputed: (100 - 1) // 16 blocks of 16 tokens.
    assert d("prefix_cache_hits_total") == (99 // 16) * 16


def test_preemptions_counted_in_a_small_pool(llama_dir: Path) -> None:
    engine = start_engine(model=str(llama_dir), num_kv_blocks=12, block_size=16, max_model_len=160)
    config = ServerConfig(served_model_name=[MODEL])
    running = RunningServer(engine, config, attach_metrics(engine, config))
    try:
        batch = prompts(6, seed=5, length=lambda i: 30)

        async def main() -> None:
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                bodies = [
                    {"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
                    for p in batch
                ]
                responses = await asyncio.gather(
                    *(client.post("/v1/completions", json=b) for b in bodies)
                )
                assert all(r.status_code == 200 for r in responses)

        asyncio.run(main())
        wait_until_idle(engine)
        samples = scrape(running.url)
        preemptions = value(samples, "num_preemptions_total")
        assert preemptions > 0
        assert value(samples, "kv_preemptions_total", reason="kv_cache") == preemptions
        assert value(samples, "kv_preemptions_total", reason="priority") == 0
        # At most two 70-token requests fit in 12 blocks of 16: the others waited for room.
        assert value(samples, "request_kv_wait_time_seconds_count") == 6
        assert value(samples, "request_kv_wait_time_seconds_sum") > 0
        assert value(samples, "kv_cache_free_blocks") == 12  # idle: every block free
        assert value(samples, "request_success_total", finished_reason="length") == 6
        assert value(samples, "generation_tokens_total") == 6 * 40
        assert value(samples, "kv_cache_usage_perc") == 0
    finally:
        running.stop()
        engine.shutdown()
