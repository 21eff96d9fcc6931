"""A server started with `--speculative-config` (n-gram lookup, 3 tokens) answers a greedy
request whose prompt repeats a passage, and its /metrics then hold speculative decoding's
identities: at least one draft, no more accepted tokens than drafted, per-position counts that
never grow with the position and sum to the accepted tokens; the same numbers under our names
and vLLM's. A real Prometheus scraping it answers the dashboard's speculative-decoding panels
with exactly what those counters imply."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from config.sources import serve_config
from engine.async_engine import AsyncEngine
from engine.stats import EngineStats
from server import cli
from server.app import attach_metrics
from tests.server.metrics.test_prometheus_scrape import (
    answer,
    dashboard_queries,
    scraping,
    wait_for_answer,
)
from tests.support.server_harness import RunningServer, scrape, wait_until_idle

MODEL = "spec-smol"
NUM_SPECULATIVE_TOKENS = 3
SPECULATIVE = f'{{"method": "ngram", "num_speculative_tokens": {NUM_SPECULATIVE_TOKENS}}}'
# Greedy decoding of a passage said over and over goes on saying it: its n-grams are in the
# prompt, so the lookup proposes, and the model accepts, whole runs of tokens.
PASSAGE = "The river runs past the mill, under the old stone bridge, and on to the sea. "
SCHEMES = {"pagedserve": ("pagedserve:", {}), "vllm": ("vllm:", {"engine": "0"})}


@dataclass(frozen=True)
class SpecCounts:
    drafts: float
    draft_tokens: float
    accepted: float
    per_position: dict[str, float]


def spec_counts(url: str, scheme: str) -> SpecCounts:
    """The spec-decode counters at `url`/metrics, published under `scheme`'s names and labels."""
    prefix, fixed = SCHEMES[scheme]
    labels = {"model_name": MODEL, **fixed}
    found: dict[str, float] = {}
    per_position: dict[str, float] = {}
    for (name, sample_labels), value in scrape(url).items():
        if "spec_decode_" not in name or name.endswith("_created"):
            continue
        assert name.startswith(prefix), name  # never under both names
        extra = dict(sample_labels)
        if "position" in extra:
            per_position[extra.pop("position")] = value
        assert extra == labels, (name, sample_labels)
        found[name.removeprefix(prefix)] = value
    return SpecCounts(
        found["spec_decode_num_drafts_total"],
        found["spec_decode_num_draft_tokens_total"],
        found["spec_decode_num_accepted_tokens_total"],
        per_position,
    )


@pytest.fixture(scope="module")
def servers(default_model_dir: Path) -> Iterator[dict[str, RunningServer]]:
    """One speculating engine on the default model behind two apps, one per naming scheme, both
    fed the same stats: each built from the command line the way `server.launch` builds it."""
    configs = {}
    for scheme in SCHEMES:
        flags = [str(default_model_dir), "--max-model-len", "1024", "--num-kv-blocks", "128"]
        flags += ["--served-model-name", MODEL]
        flags += ["--speculative-config", SPECULATIVE, "--metrics-names", scheme]
        args = vars(cli.build_parser().parse_args(["serve", *flags]))
        settings = {k: v for k, v in args.items() if k not in ("command", "config")}
        configs[scheme] = serve_config(settings, os.environ)
    engine = AsyncEngine.from_config(configs["pagedserve"].engine)
    metrics = [attach_metrics(engine, config.server) for config in configs.values()]

    def record_both(stats: EngineStats) -> None:
        for each in metrics:
            each.record(stats)

    engine.on_stats = record_both
    engine.start()
    try:
        running = {
            scheme: RunningServer(engine, configs[scheme].server, each)
            for scheme, each in zip(SCHEMES, metrics, strict=True)
        }
        yield running
        for server in running.values():
            server.stop()
    finally:
        engine.shutdown()


def test_counters_hold_the_identities_under_both_names(
    servers: dict[str, RunningServer], tmp_path: Path
) -> None:
    ours = servers["pagedserve"]
    before = spec_counts(ours.url, "pagedserve")
    # Every position is published before any draft, at 0.
    assert before == SpecCounts(0, 0, 0, {"0": 0, "1": 0, "2": 0})
    with scraping(ours.port, tmp_path) as prometheus:
        wait_for_answer(prometheus, 'up{job="pagedserve"}', 1.0)  # a scrape from before
        with openai.OpenAI(
            base_url=ours.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            completion = client.completions.create(
                model=MODEL, prompt=PASSAGE * 6, max_tokens=40, temperature=0
            )
        assert completion.usage is not None and completion.usage.completion_tokens > 0
        wait_until_idle(ours.engine)

        counts = spec_counts(ours.url, "pagedserve")
        assert counts.drafts >= 1
        assert 0 < counts.accepted <= counts.draft_tokens
        assert counts.draft_tokens <= NUM_SPECULATIVE_TOKENS * counts.drafts
        positions = [counts.per_position[str(i)] for i in range(NUM_SPECULATIVE_TOKENS)]
        assert sorted(counts.per_position) == ["0", "1", "2"]
        assert positions == sorted(positions, reverse=True)
        assert sum(positions) == counts.accepted
        assert spec_counts(servers["vllm"].url, "vllm") == counts

        # The dashboard's panels, answered by Prometheus over the window that holds the
        # request: both counters start at 0 in it, so a ratio of rates is the ratio of counts.
        selector = f'{{model_name="{MODEL}"}}'
        wait_for_answer(
            prometheus, "pagedserve:spec_decode_num_drafts_total" + selector, counts.drafts
        )
        rate, length, by_position = dashboard_queries(speculative=True)
        [[_, got]] = [r["value"] for r in answer(prometheus, rate, MODEL)]
        assert float(got) == pytest.approx(counts.accepted / counts.draft_tokens)
        [[_, got]] = [r["value"] for r in answer(prometheus, length, MODEL)]
        assert float(got) == pytest.approx(1 + counts.accepted / counts.drafts)
        shares = {
            r["metric"]["position"]: float(r["value"][1])
            for r in answer(prometheus, by_position, MODEL)
        }
        assert shares == pytest.approx(
            {p: n / counts.drafts for p, n in counts.per_position.items()}
        )


REQUESTS = [
    ("completions", {"prompt": PASSAGE * 4, "max_tokens": 48, "logprobs": 2}),
    ("completions", {"prompt": PASSAGE * 4, "max_tokens": 48, "stop": [" bridge"]}),
    (
        "completions",
        {"prompt": PASSAGE * 3, "max_tokens": 30, "temperature": 0.8, "seed": 5, "n": 2},
    ),
    ("completions", {"prompt": PASSAGE * 3, "max_tokens": 30, "frequency_penalty": 0.6}),
    (
        "chat",
        {
            "messages": [{"role": "user", "content": f"Repeat exactly: {PASSAGE * 2}"}],
            "max_tokens": 60,
            "logprobs": True,
            "top_logprobs": 1,
        },
    ),
    (
        "chat",
        {
            "messages": [{"role": "user", "content": f"Describe as JSON: {PASSAGE}"}],
            "max_tokens": 50,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "place",
                    "schema": {
                        "type": "object",
                        "properties": {"river": {"type": "string"}, "bridge": {"type": "string"}},
                        "required": ["river", "bridge"],
                    },
                },
            },
        },
    ),
]


def streamed(client: openai.OpenAI, api: str, model: str, body: dict[str, Any]) -> list[Any]:
    """Each choice's text, finish reason and token logprobs, from a streamed answer."""
    body = {"temperature": 0, **body, "model": model, "stream": True}
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    tokens: dict[int, list[tuple[str, float]]] = {}
    if api == "chat":
        for chunk in client.chat.completions.create(**body):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                finish[c.index] = c.finish_reason or finish.get(c.index)
                for lp in (c.logprobs.content or []) if c.logprobs else []:
                    tokens.setdefault(c.index, []).append((lp.token, lp.logprob))
    else:
        for chunk in client.completions.create(**body):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                finish[c.index] = c.finish_reason or finish.get(c.index)
                if c.logprobs and c.logprobs.tokens:
                    pairs = zip(c.logprobs.tokens, c.logprobs.token_logprobs or [])
                    tokens.setdefault(c.index, []).extend(pairs)
    return [(texts[i], finish[i], tokens.get(i, [])) for i in sorted(texts)]


def test_clients_get_what_the_server_without_speculation_gives(
    servers: dict[str, RunningServer], server: RunningServer
) -> None:
    """Greedy and seeded requests, streamed through the official client, with logprobs, a stop
    string, a penalty, n > 1 and a JSON schema: the same answers as the default server (the same
    model, float32, no speculation), while the speculating one accepted drafts."""
    before = spec_counts(servers["pagedserve"].url, "pagedserve")
    clients = {
        name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for name, url in (("spec", servers["pagedserve"].url), ("plain", server.url))
    }
    # All at once, to both servers: greedy and seeded answers do not depend on the batch (the
    # storm tests check that), and batched steps take a fraction of the time of one by one.
    with ThreadPoolExecutor(2 * len(REQUESTS)) as pool:
        answers = [
            (
                pool.submit(streamed, clients["spec"], api, MODEL, body),
                pool.submit(streamed, clients["plain"], api, "smol", body),
            )
            for api, body in REQUESTS
        ]
    for (api, body), (spec_answer, plain_answer) in zip(REQUESTS, answers, strict=True):
        spec, plain = spec_answer.result(), plain_answer.result()
        assert [(text, reason) for text, reason, _ in spec] == [
            (text, reason) for text, reason, _ in plain
        ], (api, body)
        for (*_, got), (*_, want) in zip(spec, plain, strict=True):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-4)
    for client in clients.values():
        client.close()
    wait_until_idle(servers["pagedserve"].engine)
    after = spec_counts(servers["pagedserve"].url, "pagedserve")
    assert after.accepted - before.accepted > 20
