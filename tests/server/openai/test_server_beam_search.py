"""Beam search over HTTP with the official client, on the default model: `use_beam_search`
with `n` as the width gives transformers' n best beams as the choices, best first, on
/v1/completions and /v1/chat/completions; what beam search cannot do is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from config import ServerConfig
from tests.support.models import hf_beams
from tests.support.server_harness import RunningServer, start_engine

MODEL = "smol"
MAX_N = 4
MAX_NEW = 12


@pytest.fixture(scope="module")
def server(default_model_dir: Path) -> Iterator[RunningServer]:
    engine = start_engine(
        model=str(default_model_dir), num_kv_blocks=256, max_model_len=512, max_num_seqs=8
    )
    running = RunningServer(engine, ServerConfig(served_model_name=[MODEL], max_n=MAX_N))
    try:
        yield running
    finally:
        running.stop()
        engine.shutdown()


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as c:
        yield c


@cache
def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def hf_beam_texts(
    folder: Path, prompt_ids: list[int], k: int, length_penalty: float, early_stopping: bool | str
) -> list[str]:
    """transformers' k best beams as text (EOS, a special token, left out)."""
    tok = _tokenizer(str(folder))
    beams = hf_beams(
        folder, prompt_ids, k, MAX_NEW, length_penalty, early_stopping, [tok.eos_token_id]
    )
    return [tok.decode(tokens, skip_special_tokens=True) for tokens, _ in beams]


def test_completions_return_transformers_beams_best_first(
    client: openai.OpenAI, default_model_dir: Path
) -> None:
    prompt = "The capital of France is"
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        n=3,
        max_tokens=MAX_NEW,
        extra_body={"use_beam_search": True, "length_penalty": 0.8, "early_stopping": True},
    )
    tok = _tokenizer(str(default_model_dir))
    expected = hf_beam_texts(default_model_dir, tok(prompt)["input_ids"], 3, 0.8, True)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == expected
    assert len(set(expected)) == 3  # distinct beams: the test compares something
    assert out.usage is not None and out.usage.completion_tokens > 0


def test_chat_returns_transformers_beams(client: openai.OpenAI, default_model_dir: Path) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        n=2,
        max_tokens=MAX_NEW,
        extra_body={"use_beam_search": True, "early_stopping": "never"},
    )
    tok = _tokenizer(str(default_model_dir))
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # transformers 5 may hand back a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    expected = hf_beam_texts(default_model_dir, prompt_ids, 2, 1.0, "never")
    assert [c.message.content for c in out.choices] == expected


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"stream": True}, "stream"),
        ({"temperature": 0.7}, "temperature"),
        ({"n": MAX_N + 1}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 2}, "logprobs"),  # within the limit, but beams report none
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_what_beam_search_cannot_do_is_a_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], field: str
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Hello",
        "n": 2,
        "max_tokens": 4,
        "use_beam_search": True,
    }
    request.update(body)
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/completions", body=request, cast_to=object)
    assert info.value.status_code == 400
    assert info.value.body["param"] == field  # type: ignore[index]


def test_chat_stream_with_beams_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            n=2,
            max_tokens=4,
            stream=True,
            extra_body={"use_beam_search": True},
        )
    assert info.value.body["param"] == "stream"  # type: ignore[index]


@pytest.mark.parametrize("length_penalty", [1000, -1000, 1e300])
def test_an_extreme_length_penalty_is_a_400_and_the_server_lives(
    server: RunningServer, client: openai.OpenAI, length_penalty: float
) -> None:
    """This request once overflowed `length ** length_penalty` in the engine thread and took
    the process down. The API bounds the penalty; the engine's own ranking no longer overflows
    either (tests/engine/test_beam_search.py)."""
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7, 8],
        "use_beam_search": True,
        "temperature": 0,
        "n": 2,
        "max_tokens": 6,
        "length_penalty": length_penalty,
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/completions", body=body, cast_to=object)
    assert info.value.body["param"] == "length_penalty"  # type: ignore[index]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    body["length_penalty"] = 1.0  # the same search, served
    answer: Any = client.post("/completions", body=body, cast_to=object)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
