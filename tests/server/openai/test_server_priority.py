"""Priority scheduling over HTTP on the default model: with the server saturated by
priority-10 streams, a priority-0 stream sent last gets its first token before every
priority-10 stream still waiting for theirs, and the preempted streams finish with exactly the
tokens they produce alone; /v1/responses takes the field too."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from config import ServerConfig
from tests.support.server_harness import RunningServer, start_engine, wait_until_idle

MODEL = "smol"
BUSY, URGENT = 10, 0


@pytest.fixture(scope="module")
def server(default_model_dir: Path) -> Iterator[RunningServer]:
    engine = start_engine(
        model=str(default_model_dir),
        num_kv_blocks=64,
        max_model_len=1024,
        max_num_seqs=2,
        scheduling_policy="priority",
    )
    running = RunningServer(engine, ServerConfig(served_model_name=[MODEL]))
    try:
        yield running
    finally:
        running.stop()
        engine.shutdown()


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


def prompt(i: int) -> str:
    return f"Story number {i}: once upon a time"


def stream(
    client: openai.OpenAI, i: int, priority: int, firsts: dict[int, float], texts: dict[int, str]
) -> None:
    chunks = client.completions.create(
        model=MODEL,
        prompt=prompt(i),
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"priority": priority, "ignore_eos": True},
    )
    text = ""
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].text and i not in firsts:
            firsts[i] = time.monotonic()
        text += chunk.choices[0].text if chunk.choices else ""
    texts[i] = text


def test_an_urgent_stream_overtakes_the_queued_ones(
    server: RunningServer, client: openai.OpenAI
) -> None:
    busy = range(4)
    alone = {
        i: client.completions.create(
            model=MODEL,
            prompt=prompt(i),
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for i in [*busy, 99]
    }
    firsts: dict[int, float] = {}
    texts: dict[int, str] = {}
    threads = [threading.Thread(target=stream, args=(client, i, BUSY, firsts, texts)) for i in busy]
    for t in threads:
        t.start()
    # Both seats taken, the rest queued: then the urgent one comes.
    deadline = time.monotonic() + 60
    while len(firsts) < 2:
        assert time.monotonic() < deadline, "the busy streams never started"
        time.sleep(0.005)
    sent = time.monotonic()
    waiting = [i for i in busy if i not in firsts]
    urgent = threading.Thread(target=stream, args=(client, 99, URGENT, firsts, texts))
    urgent.start()
    for t in [*threads, urgent]:
        t.join(120)
    assert waiting, "every busy stream had started: the server was not saturated"
    assert all(firsts[99] < firsts[i] for i in waiting if firsts[i] > sent), (firsts, sent)
    assert texts == alone  # preempted or not, every stream's tokens are its own
    state = wait_until_idle(server.engine)
    assert state.free_blocks == state.num_blocks


def test_responses_take_a_priority(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, extra_body={"priority": -2}
    )
    assert response.status in ("completed", "incomplete")
