"""Every numeric field of every generating route, swept over the values a hostile or careless
client sends: NaN, Infinity and -Infinity (as the raw literals Python's JSON parser accepts),
huge values (1e308, 2**64), a huge negative one, -1, 0 and a typical valid value, each in a
request where the field matters (length_penalty under beam search, top_logprobs with logprobs
on, top_p and seed while sampling, ...).

Each field declares the range its API documents (OpenAI's, vLLM's, Anthropic's). A value inside
it must be served: a 200 whose body is well formed (finish reasons from the allowed set, finite
numbers, usage that adds up). A value outside it, and every non-finite value, must be a 400 in
the route's own error shape naming the field: OpenAI's error object with the field as `param`,
Anthropic's with the message led by the field. Never a 5xx, a hang or a dead engine: after the
whole sweep /health answers, a greedy completion answers exactly what it did before, and the
engine holds no request and no KV block.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from config import ServerConfig
from server.openai.protocol import INT64_MAX, INT64_MIN
from tests.support.server_harness import (
    MAX_MODEL_LEN,
    NUM_KV_BLOCKS,
    RunningServer,
    assert_openai_error,
    chat_tokenizer_dir,
    start_engine,
    wait_until_idle,
)

TIMEOUT = 60.0  # seconds; an answer that takes longer is a hang
MAX_TOKENS = 3  # every request's budget: the sweep stays a few seconds of generation
MODEL = "tiny"
PROMPT_IDS = [5, 6, 7, 8]

# (label, value): json.dumps writes the non-finite floats as the bare NaN / Infinity literals.
NON_FINITE: list[tuple[str, float]] = [
    ("NaN", math.nan),
    ("Infinity", math.inf),
    ("-Infinity", -math.inf),
]
EXTREMES: list[tuple[str, float | int]] = [
    ("1e308", 1e308),
    ("2**64", 2**64),
    ("-1e308", -1e308),
    ("-1", -1),
    ("0", 0),
]


# --------------------------------------------------------------------------- ranges


def closed(lo: float, hi: float) -> Callable[[float], bool]:
    return lambda v: lo <= v <= hi


def left_open(lo: float, hi: float) -> Callable[[float], bool]:
    return lambda v: lo < v <= hi


def only(*allowed: float) -> Callable[[float], bool]:
    return lambda v: v in allowed


INT64 = closed(INT64_MIN, INT64_MAX)
# The tiny Llama's vocabulary (the Llama-3.2 tokenizer's); the fixture checks it.
VOCAB = 128257
TOKEN_ID = closed(0, VOCAB - 1)


@dataclass(frozen=True)
class Field:
    """A numeric field: its name, a value the API takes, the values it takes (finite ones; NaN
    and the infinities never), the settings under which it matters, where in the body it goes
    (by default: at the top level under its name), and the names its errors may give (by
    default: its own)."""

    name: str
    valid: float
    accepts: Callable[[float], bool]
    base: dict[str, Any] = field(default_factory=dict)
    place: Callable[[Any], dict[str, Any]] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def body(self, route_base: dict[str, Any], value: Any) -> dict[str, Any]:
        placed = self.place(value) if self.place is not None else {self.name: value}
        return {**route_base, **self.base, **placed}


SAMPLING = {"temperature": 1.0, "seed": 7}  # fields that only matter when sampling
BEAMS = {"use_beam_search": True, "temperature": 0, "n": 2}

# OpenAI's ranges, vLLM's for its own fields; length_penalty's is this server's (its scores stay
# finite float32 at any length).
SHARED = [
    Field("n", 2, closed(1, 128)),
    Field("best_of", 2, only(2), {"n": 2}),  # every sample is returned: best_of must equal n
    Field("seed", 1234, INT64, {"temperature": 1.0}),
    Field("temperature", 0.7, closed(0, 2)),
    Field("top_p", 0.9, left_open(0, 1), SAMPLING),
    Field("top_k", 5, closed(-1, INT64_MAX), SAMPLING),  # -1 and 0: no top-k
    Field("min_p", 0.1, closed(0, 1), SAMPLING),
    Field("presence_penalty", 0.5, closed(-2, 2)),
    Field("frequency_penalty", 0.5, closed(-2, 2)),
    Field("repetition_penalty", 1.2, left_open(0, 2)),
    Field("logit_bias", 5, closed(-100, 100), place=lambda v: {"logit_bias": {"7": v}}),
    Field("length_penalty", 0.8, closed(-5, 5), BEAMS),
    Field("priority", 3, INT64),
    Field("min_tokens", 1, closed(0, MAX_TOKENS)),
    Field("stop_token_ids", 5, TOKEN_ID, place=lambda v: {"stop_token_ids": [v]}),
]
# At most what fits beside the prompt: of the values swept, only the valid one.
BUDGET = closed(1, MAX_MODEL_LEN - len(PROMPT_IDS))
COMPLETION_FIELDS = [
    *SHARED,
    Field("max_tokens", 2, BUDGET),
    Field("logprobs", 2, closed(0, 5)),
    Field("prompt", 9, TOKEN_ID, place=lambda v: {"prompt": [*PROMPT_IDS, v]}),
]
CHAT_FIELDS = [
    *SHARED,
    Field("max_tokens", 2, BUDGET),
    # The completion budget is max_tokens to the server's limits, whichever field set it.
    Field("max_completion_tokens", 2, BUDGET, {"max_tokens": None}, aliases=("max_tokens",)),
    Field("top_logprobs", 2, closed(0, 20), {"logprobs": True}),
]
RESPONSES_FIELDS = [
    Field("max_output_tokens", 2, BUDGET),
    Field("temperature", 0.7, closed(0, 2)),
    Field("top_p", 0.9, left_open(0, 1), {"temperature": 1.0}),
    Field("priority", 3, INT64),
    Field("top_logprobs", 0, only(0)),  # logprobs are not served on /v1/responses
]
MESSAGES_FIELDS = [  # Anthropic's ranges
    Field("max_tokens", 2, BUDGET),
    Field("temperature", 0.5, closed(0, 1)),
    Field("top_p", 0.9, left_open(0, 1), {"temperature": 1.0}),
    Field("top_k", 5, closed(0, INT64_MAX), {"temperature": 1.0}),
]


# --------------------------------------------------------------------------- well-formed answers


def _no_constant(name: str) -> float:
    raise ValueError(f"the body holds {name}")


def strict_json(text: str) -> Any:
    """JSON as a strict parser reads it: NaN and Infinity are no numbers."""
    return json.loads(text, parse_constant=_no_constant)


def _requested(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    return default if value is None else int(value)


def _usage(problems: list[str], prompt: int, completion: int, total: int) -> None:
    if prompt < 1 or completion < 0 or prompt + completion != total:
        problems.append(f"usage does not add up: {prompt} + {completion} != {total}")


def check_completion(body: dict[str, Any], answer: Any) -> list[str]:
    problems: list[str] = []
    n = _requested(body, "n", 1)
    budget = _requested(body, "max_tokens", 16)
    choices = answer["choices"]
    if [c["index"] for c in choices] != list(range(n)):
        problems.append(f"choices {[c['index'] for c in choices]} for n={n}")
    for c in choices:
        if not isinstance(c["text"], str) or c["finish_reason"] not in ("stop", "length"):
            problems.append(f"choice {c['index']}: {c['text']!r}, {c['finish_reason']!r}")
    usage = answer["usage"]
    _usage(problems, usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
    if usage["prompt_tokens"] != len(body["prompt"]):
        problems.append(f"prompt_tokens {usage['prompt_tokens']} for {len(body['prompt'])} ids")
    if not n <= usage["completion_tokens"] <= n * budget:
        problems.append(f"completion_tokens {usage['completion_tokens']} for n={n} x {budget}")
    if body.get("logprobs") is not None:
        counted = 0
        for c in choices:
            lp = c["logprobs"]
            lengths = {len(lp[k]) for k in ("tokens", "token_logprobs", "top_logprobs")}
            if len(lengths) != 1:
                problems.append(f"choice {c['index']}: logprobs lists of lengths {lengths}")
            counted += len(lp["tokens"])
        if counted != usage["completion_tokens"]:
            problems.append(f"{counted} tokens with logprobs, usage says {usage}")
    return problems


def check_chat(body: dict[str, Any], answer: Any) -> list[str]:
    problems: list[str] = []
    n = _requested(body, "n", 1)
    budget = _requested(body, "max_completion_tokens", _requested(body, "max_tokens", 16))
    choices = answer["choices"]
    if answer["object"] != "chat.completion" or len(choices) != n:
        problems.append(f"{answer['object']} with {len(choices)} choices for n={n}")
    for c in choices:
        message = c["message"]
        if message["role"] != "assistant" or not isinstance(message["content"], str):
            problems.append(f"choice {c['index']}: message {message}")
        if c["finish_reason"] not in ("stop", "length"):
            problems.append(f"choice {c['index']}: finish_reason {c['finish_reason']!r}")
    usage = answer["usage"]
    _usage(problems, usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
    if not n <= usage["completion_tokens"] <= n * budget:
        problems.append(f"completion_tokens {usage['completion_tokens']} for n={n} x {budget}")
    if body.get("logprobs"):
        top = _requested(body, "top_logprobs", 0)
        tokens = [t for c in choices for t in c["logprobs"]["content"]]
        if len(tokens) != usage["completion_tokens"]:
            problems.append(f"{len(tokens)} tokens with logprobs, usage says {usage}")
        if any(len(t["top_logprobs"]) != top for t in tokens):
            problems.append(f"top_logprobs lists not of length {top}")
    return problems


def check_response(body: dict[str, Any], answer: Any) -> list[str]:
    problems: list[str] = []
    budget = _requested(body, "max_output_tokens", 16)
    if answer["object"] != "response" or answer["status"] not in ("completed", "incomplete"):
        problems.append(f"{answer['object']} with status {answer['status']!r}")
    if answer["status"] == "incomplete" and answer["incomplete_details"] != {
        "reason": "max_output_tokens"
    }:
        problems.append(f"incomplete for {answer['incomplete_details']}")
    texts = [p for item in answer["output"] for p in item.get("content", [])]
    if not texts or any(p["type"] != "output_text" for p in texts):
        problems.append(f"output {answer['output']}")
    usage = answer["usage"]
    _usage(problems, usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])
    if not 1 <= usage["output_tokens"] <= budget:
        problems.append(f"output_tokens {usage['output_tokens']} for max_output_tokens {budget}")
    return problems


def check_message(body: dict[str, Any], answer: Any) -> list[str]:
    problems: list[str] = []
    stop = answer["stop_reason"]
    if answer["type"] != "message" or stop not in ("end_turn", "max_tokens", "stop_sequence"):
        problems.append(f"{answer['type']} with stop_reason {stop!r}")
    if any(block["type"] != "text" for block in answer["content"]):
        problems.append(f"content {answer['content']}")
    usage = answer["usage"]
    if usage["input_tokens"] < 1 or not 1 <= usage["output_tokens"] <= body["max_tokens"]:
        problems.append(f"usage {usage} for max_tokens {body['max_tokens']}")
    if stop == "max_tokens" and usage["output_tokens"] != body["max_tokens"]:
        problems.append(f"stopped at max_tokens after {usage['output_tokens']} tokens")
    return problems


def check_rendered(body: dict[str, Any], rendered: dict[str, Any]) -> list[str]:
    """A request as the route would have queued it: its tokens and its sampling parameters,
    every number finite, each field the client set carried over as sent."""
    problems: list[str] = []
    ids = rendered["token_ids"]
    if not ids or not all(isinstance(t, int) and 0 <= t < VOCAB for t in ids):
        problems.append(f"token_ids {ids}")
    params = rendered["sampling_params"]
    budget = _requested(body, "max_completion_tokens", _requested(body, "max_tokens", 16))
    if not 1 <= params["max_tokens"] <= budget:
        problems.append(f"max_tokens {params['max_tokens']} for {budget} asked")
    # (The budget is resolved, chat's logprobs flag becomes a count, top_k -1 is 0: no top-k.)
    carried = {k: v for k, v in body.items() if k not in ("max_tokens", "logprobs")}
    if carried.get("top_k") == -1:
        carried["top_k"] = 0
    for name, value in carried.items():
        if name in params and params[name] != value:
            problems.append(f"sampling_params.{name} is {params[name]!r}, sent {value!r}")
    return problems


def check_rendered_completion(body: dict[str, Any], answer: Any) -> list[str]:
    if len(answer) != 1 or answer[0]["token_ids"] != body["prompt"]:
        return [f"{len(answer)} rendered prompts for one: {answer}"]
    return check_rendered(body, answer[0])


# --------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Route:
    path: str
    base: dict[str, Any]
    fields: list[Field]
    check: Callable[[dict[str, Any], Any], list[str]]
    shape: Literal["openai", "anthropic"] = "openai"


HI = [{"role": "user", "content": "Hi"}]
COMPLETION_BASE = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0}
CHAT_BASE = {"messages": HI, "max_tokens": MAX_TOKENS, "temperature": 0}
ROUTES = [
    Route("/v1/completions", COMPLETION_BASE, COMPLETION_FIELDS, check_completion),
    Route("/v1/chat/completions", CHAT_BASE, CHAT_FIELDS, check_chat),
    Route("/v1/completions/render", COMPLETION_BASE, COMPLETION_FIELDS, check_rendered_completion),
    Route("/v1/chat/completions/render", CHAT_BASE, CHAT_FIELDS, check_rendered),
    Route(
        "/v1/responses",
        {"input": "Hi", "max_output_tokens": MAX_TOKENS, "temperature": 0, "store": False},
        RESPONSES_FIELDS,
        check_response,
    ),
    Route(
        "/v1/messages",
        {"model": MODEL, "messages": HI, "max_tokens": MAX_TOKENS, "temperature": 0},
        MESSAGES_FIELDS,
        check_message,
        "anthropic",
    ),
]
CASES = [(route, f) for route in ROUTES for f in route.fields]


# --------------------------------------------------------------------------- the server


@dataclass
class Served:
    server: RunningServer
    client: httpx.Client
    before: tuple[str, list[str], str]  # the greedy completion before the sweep


GREEDY = {"prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "logprobs": 0}


def greedy_answer(client: httpx.Client) -> tuple[str, list[str], str]:
    """A greedy completion's text, tokens and finish reason."""
    response = client.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # Priority scheduling, so that a request's priority is taken, not refused as meaningless.
    engine = start_engine(
        model=str(llama_dir),
        tokenizer=str(chat_tokenizer_dir(llama_dir, tmp_path_factory.mktemp("chat-tokenizer"))),
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        scheduling_policy="priority",
    )
    try:
        assert engine.info.vocab_size == VOCAB
        server = RunningServer(engine, ServerConfig(served_model_name=[MODEL]))
        try:
            with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
                yield Served(server, client, greedy_answer(client))
        finally:
            server.stop()
    finally:
        engine.shutdown()


def error_problem(route: Route, f: Field, response: httpx.Response) -> str | None:
    """What is wrong with a refusal, if anything: it must be a 400 in the route's error shape
    that names the field."""
    if response.status_code != 400:
        return f"status {response.status_code}: {response.text[:300]}"
    try:
        body = strict_json(response.text)
        if route.shape == "anthropic":
            assert isinstance(body, dict) and set(body) == {"type", "error"}, body
            assert body["type"] == "error", body
            assert body["error"]["type"] == "invalid_request_error", body
            message = body["error"]["message"]
            assert message.split(":")[0].split(".")[0] in f.names, message
        else:
            error = assert_openai_error(body)
            assert error["type"] == "invalid_request_error", error
            assert (error["param"] or "").split(".")[0] in f.names, error
    except (AssertionError, ValueError, KeyError, TypeError) as exc:
        return f"not a 400 naming {f.name}: {exc}"
    return None


def success_problem(route: Route, body: dict[str, Any], response: httpx.Response) -> str | None:
    if response.status_code != 200:
        return f"status {response.status_code}: {response.text[:300]}"
    try:
        problems = route.check(body, strict_json(response.text))
    except (ValueError, KeyError, TypeError) as exc:
        return f"malformed 200 ({exc!r}): {response.text[:300]}"
    return "; ".join(problems) or None


@pytest.mark.parametrize(
    ("route", "f"), CASES, ids=[f"{route.path}:{f.name}" for route, f in CASES]
)
def test_numeric_field(served: Served, route: Route, f: Field) -> None:
    failures = []
    for label, value in [*NON_FINITE, *EXTREMES, ("valid", f.valid)]:
        body = {k: v for k, v in f.body(route.base, value).items() if v is not None}
        response = served.client.post(
            route.path, content=json.dumps(body), headers={"content-type": "application/json"}
        )
        expect_ok = math.isfinite(value) and f.accepts(value)
        problem = (
            success_problem(route, body, response)
            if expect_ok
            else error_problem(route, f, response)
        )
        if problem:
            wanted = "a well-formed 200" if expect_ok else f"a 400 naming {f.name}"
            failures.append(f"{f.name}={label}: wanted {wanted}, got {problem}")
    assert not failures, f"{route.path} {json.dumps(f.body(route.base, '<value>'))}:\n" + "\n".join(
        failures
    )


def test_server_whole_after_the_sweep(served: Served) -> None:
    assert served.client.get("/health").status_code == 200
    assert greedy_answer(served.client) == served.before
    state = wait_until_idle(served.server.engine)
    assert (state.running, state.waiting, state.requests) == (0, 0, 0), state
    assert state.free_blocks == state.num_blocks == NUM_KV_BLOCKS, state
