"""The OpenAI-compatible routes over real HTTP, seen by the official openai client and by raw
httpx: streamed and non-streamed answers agree token for token, usage counts are exact, the SSE
framing is byte-exact, finish reasons, stop strings, n samples and their seeds, batched
prompts, logprobs, echo, seeds, and the model, tokenizer, health and version routes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_harness import RunningServer

JSON = dict[str, Any]

MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smol"
MAX_MODEL_LEN = 8192
DONE = "data: [DONE]\n\n"

STORY = "Once upon a time"  # greedy: ", the city of Nova Haven was a thriving metropolis, ..."
FRANCE = "The capital of France is"
LONG_CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
# A question the model answers with one word and then its end-of-turn token.
YES_NO_CHAT = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def post(http: httpx.Client, path: str, body: JSON) -> JSON:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def tokenize(http: httpx.Client, **body: Any) -> list[int]:
    out = post(http, "/tokenize", body)
    assert out["count"] == len(out["tokens"])
    return out["tokens"]


def sse_chunks(http: httpx.Client, path: str, body: JSON) -> list[JSON]:
    """The chunks of a streamed response, after checking the framing byte for byte: nothing but
    `data: <one-line json>\\n\\n` events, the last one `data: [DONE]\\n\\n`, and every chunk of
    the response under the same id, created time, model and object."""
    response = http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.text
    assert text.endswith(DONE) and text.count("[DONE]") == 1
    events = text[: -len(DONE)].split("\n\n")
    assert events[-1] == ""  # the body before [DONE] ends with a complete event
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, repr(event)
        chunks.append(json.loads(event[len("data: ") :]))
    assert chunks
    first = chunks[0]
    expected_object = "chat.completion.chunk" if "chat" in path else "text_completion"
    for chunk in chunks:
        assert (chunk["id"], chunk["created"], chunk["model"], chunk["object"]) == (
            first["id"],
            first["created"],
            first["model"],
            expected_object,
        )
    return chunks


def content_chunks(chunks: list[JSON], include_usage: bool) -> list[JSON]:
    """The chunks that carry choices. With include_usage every one of them says `usage: null`
    and exactly one last chunk has no choices and the usage; without it no chunk has the key."""
    if not include_usage:
        assert all("usage" not in c for c in chunks)
        return chunks
    *body, last = chunks
    assert last["choices"] == [] and last["usage"] is not None
    for c in body:
        assert "usage" in c and c["usage"] is None
        assert c["choices"], "only the usage chunk may have no choices"
    return body


def joined_texts(chunks: list[JSON], chat: bool) -> dict[int, str]:
    """Each choice's streamed text, after checking that it has exactly one finish_reason, in its
    last chunk, and (chat) that its first delta is the role alone."""
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in chunks:
        assert len(chunk["choices"]) == 1  # one choice per chunk, tagged with its index
        choice = chunk["choices"][0]
        index = choice["index"]
        assert index not in finished, "a chunk after the choice's finish_reason"
        if chat:
            delta = choice["delta"]
            if index not in texts:
                assert delta == {"role": "assistant", "content": ""}
                assert choice["finish_reason"] is None
            else:
                assert set(delta) <= {"content"}
            texts[index] = texts.get(index, "") + delta.get("content", "")
        else:
            texts[index] = texts.get(index, "") + choice["text"]
        if choice["finish_reason"] is not None:
            finished[index] = choice["finish_reason"]
    assert set(finished) == set(texts)
    return texts


def finish_reasons(chunks: list[JSON]) -> dict[int, tuple[str, object]]:
    return {
        c["choices"][0]["index"]: (c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"])
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"] is not None
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JSON:
    """The usage object, exactly. Prompts shorter than a KV block plus one token can never be
    served from the prefix cache: for them `cached_tokens` is 0 whatever ran before."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def counts(usage: JSON) -> JSON:
    """The usage without its cached tokens, for a chat whose first blocks (the default system
    prompt) other tests may or may not have left in the prefix cache."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def cached_after_a_first_run(prompt_tokens: int, block_size: int) -> int:
    """The cache serves the whole blocks of a prompt that ran before, except the block of its
    last token (recomputed, to sample from its logits)."""
    return (prompt_tokens - 1) // block_size * block_size


# --------------------------------------------------------------------------- references


@pytest.fixture(scope="module")
def story(http: httpx.Client) -> JSON:
    """Greedy 16 tokens after STORY, with each token's text (logprobs=0: the chosen token only)."""
    out = post(
        http,
        "/v1/completions",
        {"prompt": STORY, "max_tokens": 16, "temperature": 0, "logprobs": 0},
    )
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    return choice


# --------------------------------------------------------------------------- completions


def test_completion_stream_equals_non_stream_with_exact_usage(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    body: JSON = {"model": MODEL, "prompt": FRANCE, "max_tokens": 12, "temperature": 0}
    prompt_tokens = len(tokenize(http, prompt=FRANCE))

    full = client.completions.create(**body)
    assert full.object == "text_completion" and full.model == MODEL and full.id.startswith("cmpl-")
    assert [c.index for c in full.choices] == [0]
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.model_dump(exclude_none=True) == usage(
        prompt_tokens, 12
    )
    text = full.choices[0].text
    # The 12 generated tokens spell exactly this text (their own text, one by one).
    with_tokens = post(http, "/v1/completions", {**body, "logprobs": 0})["choices"][0]
    assert with_tokens["text"] == text and len(with_tokens["logprobs"]["tokens"]) == 12

    with_usage = content_chunks(
        sse_chunks(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}}),
        True,
    )
    assert joined_texts(with_usage, chat=False) == {0: text}
    assert finish_reasons(with_usage) == {0: ("length", None)}
    raw = sse_chunks(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert raw[-1]["usage"] == usage(prompt_tokens, 12)
    assert raw[-1]["id"].startswith("cmpl-") and raw[-1]["id"] != full.id

    without = content_chunks(sse_chunks(http, "/v1/completions", body), False)
    assert joined_texts(without, chat=False) == {0: text}

    # The SDK's own stream parsing agrees, and shows no usage unless asked for.
    sdk_chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in sdk_chunks if c.choices) == text
    assert all(c.usage is None for c in sdk_chunks)


def test_finish_reason_length_and_stop_strings(http: httpx.Client, story: JSON) -> None:
    ref = story["text"]
    token_texts: list[str] = story["logprobs"]["tokens"]
    # A word in the middle of the greedy text, and a stop string spanning several tokens that
    # ends inside that word and begins earlier.
    word = " " + ref.split()[4]
    at = ref.index(word)
    span = ref[at - 4 : at + 3]
    assert at >= 4 and ref.find(span) == at - 4

    def tokens_until(stop_end: int) -> int:
        """How many tokens the engine must generate before the text reaches `stop_end` chars."""
        return next(
            k for k in range(1, len(token_texts) + 1) if len("".join(token_texts[:k])) >= stop_end
        )

    base: JSON = {"prompt": STORY, "max_tokens": 16, "temperature": 0}
    out = post(http, "/v1/completions", {**base, "stop": word})
    choice = out["choices"][0]
    assert choice["text"] == ref[:at]  # cut before the stop string, which is left out
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", word)
    assert out["usage"]["completion_tokens"] == tokens_until(at + len(word)) < 16

    out = post(http, "/v1/completions", {**base, "stop": span, "include_stop_str_in_output": True})
    choice = out["choices"][0]
    assert choice["text"] == ref[: at - 4 + len(span)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", span)
    assert out["usage"]["completion_tokens"] == tokens_until(at + 3)

    # Streamed, the earlier of two stop strings wins, and no held-back character leaks.
    chunks = sse_chunks(http, "/v1/completions", {**base, "stop": [word, span]})
    assert joined_texts(chunks, chat=False) == {0: ref[: at - 4]}
    assert finish_reasons(chunks) == {0: ("stop", span)}

    out = post(http, "/v1/completions", {**base, "max_tokens": 3})
    assert out["choices"][0]["text"] == "".join(token_texts[:3])
    assert (out["choices"][0]["finish_reason"], out["choices"][0]["stop_reason"]) == (
        "length",
        None,
    )


def test_n_samples_use_consecutive_seeds(http: httpx.Client) -> None:
    # Sample i of a request with seed S draws from seed S + i, so it equals a lone request with
    # seed S + i: an exact check of both the n samples and their order.
    body: JSON = {
        "prompt": STORY,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 1234,
        "ignore_eos": True,
    }
    out = post(http, "/v1/completions", {**body, "n": 3})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["finish_reason"] for c in out["choices"]] == ["length"] * 3
    # The prompt is counted once, the completions of all three samples.
    assert out["usage"] == usage(len(tokenize(http, prompt=STORY)), 24)
    texts = [c["text"] for c in out["choices"]]
    assert len(set(texts)) > 1

    for i in range(3):
        single = post(http, "/v1/completions", {**body, "seed": 1234 + i})
        assert single["choices"][0]["text"] == texts[i]

    chunks = sse_chunks(http, "/v1/completions", {**body, "n": 3})
    assert joined_texts(chunks, chat=False) == dict(enumerate(texts))
    assert finish_reasons(chunks) == dict.fromkeys(range(3), ("length", None))


def test_batched_prompts_are_prompt_major(client: openai.OpenAI, http: httpx.Client) -> None:
    prompts = [STORY, FRANCE]
    body: JSON = {"max_tokens": 6, "temperature": 0}
    singles = [
        post(http, "/v1/completions", {**body, "prompt": p})["choices"][0]["text"] for p in prompts
    ]
    assert singles[0] != singles[1]
    ids = [tokenize(http, prompt=p) for p in prompts]
    # choice index = prompt index * n + sample index; every greedy sample equals the lone answer.
    expected = [(0, singles[0]), (1, singles[0]), (2, singles[1]), (3, singles[1])]
    for prompt in (prompts, ids):
        out = client.completions.create(model=MODEL, prompt=prompt, n=2, **body)
        assert [(c.index, c.text) for c in out.choices] == expected
        assert [c.finish_reason for c in out.choices] == ["length"] * 4
        # Each prompt counted once (not once per sample), each sample's tokens counted.
        assert out.usage is not None and out.usage.model_dump(exclude_none=True) == usage(
            len(ids[0]) + len(ids[1]), 24
        )

    chunks = sse_chunks(
        http,
        "/v1/completions",
        {**body, "prompt": prompts, "n": 2, "stream_options": {"include_usage": True}},
    )
    assert chunks[-1]["usage"] == usage(len(ids[0]) + len(ids[1]), 24)
    assert joined_texts(content_chunks(chunks, True), chat=False) == dict(expected)


def test_completion_logprobs(http: httpx.Client) -> None:
    body: JSON = {"prompt": FRANCE, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    out = post(http, "/v1/completions", body)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    n = out["usage"]["completion_tokens"]
    assert n == 8 and choice["finish_reason"] == "length"
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == n
    )
    assert "".join(lp["tokens"]) == choice["text"]
    offset = 0
    for token, logprob, top, start in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]
    ):
        assert start == offset
        offset += len(token)
        # The chosen token and the top 3 (which, greedy, include it): 3 entries, 4 only if not.
        assert len(top) in (3, 4) and top[token] == logprob
        assert logprob == max(top.values()) and logprob <= 0

    chunks = sse_chunks(http, "/v1/completions", body)
    streamed: JSON = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in streamed:
            streamed[key] += chunk["choices"][0]["logprobs"][key]
    assert streamed["tokens"] == lp["tokens"]
    assert streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert [list(t) for t in streamed["top_logprobs"]] == [list(t) for t in lp["top_logprobs"]]


def test_echo(http: httpx.Client) -> None:
    plain = post(
        http,
        "/v1/completions",
        {"prompt": FRANCE, "max_tokens": 4, "temperature": 0, "logprobs": 1},
    )
    completion = plain["choices"][0]["text"]
    prompt_ids = tokenize(http, prompt=FRANCE)
    body: JSON = {"prompt": FRANCE, "max_tokens": 4, "temperature": 0, "echo": True}

    out = post(http, "/v1/completions", body)
    assert out["choices"][0]["text"] == FRANCE + completion
    assert out["usage"] == usage(len(prompt_ids), 4)

    out = post(http, "/v1/completions", {**body, "logprobs": 1})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == FRANCE + completion
    total = len(prompt_ids) + 4
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == total
    )
    assert "".join(lp["tokens"]) == choice["text"]
    assert "".join(lp["tokens"][: len(prompt_ids)]) == FRANCE
    # Nothing precedes the first prompt token, so it has no logprob; every later token has one.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for token, logprob, top in zip(
        lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]
    ):
        assert top[token] == logprob and len(top) in (1, 2)
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(total)]
    assert lp["text_offset"] == offsets
    # The completion's part is what the request without echo reported.
    assert lp["tokens"][len(prompt_ids) :] == plain["choices"][0]["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(prompt_ids) :] == pytest.approx(
        plain["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
    )

    # A token-id prompt echoes as its decoded text.
    ids_out = post(http, "/v1/completions", {**body, "prompt": prompt_ids})
    decoded = post(http, "/detokenize", {"tokens": prompt_ids})["prompt"]
    assert decoded == FRANCE
    assert ids_out["choices"][0]["text"] == decoded + completion

    # Streamed, the prompt comes first, in the first chunk.
    chunks = sse_chunks(http, "/v1/completions", body)
    assert chunks[0]["choices"][0]["text"].startswith(FRANCE)
    assert joined_texts(chunks, chat=False) == {0: FRANCE + completion}


def test_seed_reproducibility(http: httpx.Client) -> None:
    body: JSON = {"prompt": STORY, "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    first = post(http, "/v1/completions", {**body, "seed": 42})["choices"][0]["text"]
    again = post(http, "/v1/completions", {**body, "seed": 42})["choices"][0]["text"]
    other = post(http, "/v1/completions", {**body, "seed": 43})["choices"][0]["text"]
    assert first == again
    assert first != other


# --------------------------------------------------------------------------- chat


def test_chat_stream_equals_non_stream_with_exact_usage(
    client: openai.OpenAI, http: httpx.Client, server: RunningServer
) -> None:
    body: JSON = {"model": ALIAS, "messages": LONG_CHAT, "max_tokens": 12, "temperature": 0}
    # The prompt is the conversation under the chat template, generation prompt included.
    prompt_tokens = len(tokenize(http, messages=LONG_CHAT))
    assert prompt_tokens > len(tokenize(http, prompt=LONG_CHAT[0]["content"]))

    full = client.chat.completions.create(**body)
    assert (
        full.object == "chat.completion" and full.model == ALIAS and full.id.startswith("chatcmpl-")
    )
    (choice,) = full.choices
    assert (
        choice.index == 0
        and choice.message.role == "assistant"
        and choice.finish_reason == "length"
    )
    assert full.usage is not None
    assert counts(full.usage.model_dump(exclude_none=True)) == counts(usage(prompt_tokens, 12))
    text = choice.message.content
    assert text

    chunks = sse_chunks(
        http, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    # The same prompt just ran: its whole blocks come from the cache.
    cached = cached_after_a_first_run(prompt_tokens, server.engine.info.block_size)
    assert cached > 0
    assert chunks[-1]["usage"] == usage(prompt_tokens, 12, cached)
    body_chunks = content_chunks(chunks, True)
    assert joined_texts(body_chunks, chat=True) == {0: text}
    assert finish_reasons(body_chunks) == {0: ("length", None)}

    without = content_chunks(sse_chunks(http, "/v1/chat/completions", body), False)
    assert joined_texts(without, chat=True) == {0: text}

    sdk_chunks = list(client.chat.completions.create(**body, stream=True))
    assert sdk_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in sdk_chunks) == text
    assert all(c.usage is None for c in sdk_chunks)


def test_chat_ends_at_eos_with_stop(http: httpx.Client) -> None:
    body: JSON = {"messages": YES_NO_CHAT, "max_tokens": 16, "temperature": 0}
    out = post(http, "/v1/chat/completions", body)
    choice = out["choices"][0]
    text = choice["message"]["content"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert text and "<|im_end|>" not in text
    # The answer's own tokens and the end-of-turn token that stopped it, which shows no text.
    answer_tokens = len(tokenize(http, prompt=text, add_special_tokens=False))
    assert counts(out["usage"]) == counts(
        usage(len(tokenize(http, messages=YES_NO_CHAT)), answer_tokens + 1)
    )

    chunks = sse_chunks(http, "/v1/chat/completions", body)
    assert joined_texts(chunks, chat=True) == {0: text}
    assert finish_reasons(chunks) == {0: ("stop", None)}


def test_min_tokens_keeps_the_chat_going_past_its_end_of_turn(http: httpx.Client) -> None:
    """The yes/no answer ends after a few tokens; with min_tokens the end-of-turn token cannot
    come before that many tokens, on both the plain and the streamed path."""
    body: JSON = {"messages": YES_NO_CHAT, "max_tokens": 16, "temperature": 0}
    short = post(http, "/v1/chat/completions", body)["usage"]["completion_tokens"]
    assert short < 6
    longer = {**body, "min_tokens": 6}
    out = post(http, "/v1/chat/completions", longer)
    assert out["usage"]["completion_tokens"] >= 6
    chunks = sse_chunks(http, "/v1/chat/completions", longer)
    assert joined_texts(chunks, chat=True) == {0: out["choices"][0]["message"]["content"]}

    refused = http.post("/v1/chat/completions", json={**body, "min_tokens": 17})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "min_tokens"


def test_min_tokens_through_the_openai_sdk(client: openai.OpenAI) -> None:
    """As SDK users send it: a vLLM field in extra_body, plain and streamed."""
    kwargs: dict[str, Any] = {
        "model": client.models.list().data[0].id,
        "messages": YES_NO_CHAT,
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"min_tokens": 6},
    }
    out = client.chat.completions.create(**kwargs)
    assert out.usage is not None and out.usage.completion_tokens >= 6
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{**kwargs, "extra_body": {"min_tokens": 17}})
    assert info.value.body["param"] == "min_tokens"  # type: ignore[index]


def test_chat_n_samples_stream(http: httpx.Client) -> None:
    body: JSON = {
        "messages": LONG_CHAT,
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
    }
    out = post(http, "/v1/chat/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    texts = {c["index"]: c["message"]["content"] for c in out["choices"]}
    assert out["usage"]["completion_tokens"] == 12

    chunks = sse_chunks(http, "/v1/chat/completions", body)
    # Each choice opens with its role delta before any content.
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:2]] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
    ]
    assert joined_texts(chunks, chat=True) == texts
    assert finish_reasons(chunks) == {0: ("length", None), 1: ("length", None)}


def test_chat_logprobs(http: httpx.Client) -> None:
    body: JSON = {
        "messages": LONG_CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    out = post(http, "/v1/chat/completions", body)
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["finish_reason"] == "length"
    assert len(content) == out["usage"]["completion_tokens"] == 8
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert len(top) == 5
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        for alt in top:
            assert set(alt) == {"token", "logprob", "bytes"} and alt["bytes"] == list(
                alt["token"].encode()
            )
        # Greedy: the chosen token is the most likely one.
        assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])

    chunks = sse_chunks(http, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role delta carries no token
    streamed = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert [
        (e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in streamed
    ] == [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in content], abs=1e-4
    )


# --------------------------------------------------------------------------- other routes


def test_models(
    client: openai.OpenAI, http: httpx.Client, server: RunningServer, default_model_dir: Path
) -> None:
    assert [m.id for m in client.models.list()] == [MODEL, ALIAS]
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list"
    for card, name in zip(listing["data"], [MODEL, ALIAS], strict=True):
        assert card["id"] == name and card["object"] == "model" and card["owned_by"] == "pagedserve"
        assert card["root"] == str(default_model_dir) and card["max_model_len"] == MAX_MODEL_LEN
        assert isinstance(card["created"], int) and card["created"] <= time.time()
        assert http.get(f"/v1/models/{name}").json() == card
    assert client.models.retrieve(ALIAS).id == ALIAS

    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "The model 'no-such-model' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=STORY, max_tokens=1)


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    text = "Hello, world! Ünïcödé text ✓ and 12345."
    out = post(http, "/tokenize", {"prompt": text})
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == MAX_MODEL_LEN
    assert post(http, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": text}
    # Under either served name.
    assert post(http, "/tokenize", {"prompt": text, "model": ALIAS})["tokens"] == out["tokens"]


def test_health_and_version(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    response = http.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": version("pagedserve")}
