"""Structured outputs over real HTTP with the official openai client, on the default model:
response_format (JSON mode and JSON schema, streamed, n > 1, sampled), the SDK's parse helper,
vLLM's guided_* fields and structured_outputs object on both routes, and OpenAI-shaped 400s for
bad constraints that leave the server serving."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from config import ServerConfig
from engine.structured import StructuredOutputsParams
from tests.support.readme import run_example, section_examples
from tests.support.server_harness import RunningServer, start_engine, wait_until

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}]
SCHEMA_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_json_schema_non_streamed_streamed_and_sampled(client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=SCHEMA_FORMAT, temperature=0, max_tokens=60
    )
    text = greedy.choices[0].message.content
    assert greedy.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text or ""), PERSON)

    pieces: list[str] = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=SCHEMA_FORMAT,
        temperature=0,
        max_tokens=60,
        stream=True,
    ):
        pieces += [c.delta.content or "" for c in chunk.choices]
    assert "".join(pieces) == text

    sampled = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=SCHEMA_FORMAT,
        temperature=1.0,
        top_p=0.95,
        n=4,
        seed=11,
        max_tokens=60,
    )
    assert len(sampled.choices) == 4
    for choice in sampled.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_mode_gives_an_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=80,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


class Person(BaseModel):
    name: str
    age: int
    city: str


def test_sdk_parse_helper(client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, temperature=0, max_tokens=60
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)
    assert person.model_dump() == json.loads(parsed.choices[0].message.content or "")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_guided_fields_on_both_routes(client: openai.OpenAI, route: str) -> None:
    def ask(extra: dict[str, Any], n: int = 1) -> list[str]:
        common: dict[str, Any] = {"model": MODEL, "max_tokens": 60, "n": n, "extra_body": extra}
        if n > 1:
            common.update(temperature=1.0, seed=5)
        else:
            common.update(temperature=0)
        if route == "completions":
            done = client.completions.create(prompt="The capital of France is", **common)
            return [c.text for c in done.choices]
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": "What is the capital of France?"}], **common
        )
        return [c.message.content or "" for c in chat.choices]

    choice = ["Paris", "Lyon", "Nice"]
    assert set(ask({"guided_choice": choice}, n=3)) <= set(choice)
    # (In chat the model opens with "The capital...": the allowed token it likes best is "L".)
    assert ask({"guided_choice": choice}) == (["Paris"] if route == "completions" else ["Lyon"])
    for text in ask({"guided_regex": r"[A-Z][a-z]{1,8} \d{4}"}, n=2):
        assert re.fullmatch(r"[A-Z][a-z]{1,8} \d{4}", text), text
    for text in ask({"guided_json": PERSON}, n=2):
        jsonschema.validate(json.loads(text), PERSON)
    grammar = 'root ::= "It is " city "."\ncity ::= "Paris" | "Rome"'
    assert ask({"guided_grammar": grammar})[0] in ("It is Paris.", "It is Rome.")
    assert ask({"structured_outputs": {"choice": choice}}) == ask({"guided_choice": choice})
    for text in ask({"structured_outputs": {"json": PERSON}}, n=2):
        jsonschema.validate(json.loads(text), PERSON)


BAD = [
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "number", "multipleOf": 0.5}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        "completions",
        {"guided_json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        "guided_json",
    ),
    ("completions", {"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs.json"),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
    ),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("completions", {"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ("completions", {"guided_json": "{not json"}, "guided_json"),
    ("chat", {"guided_choice": []}, "guided_choice"),
    ("chat", {"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ("completions", {"structured_outputs": {}}, "structured_outputs"),
]


@pytest.mark.parametrize(("route", "fields", "param"), BAD)
def test_bad_constraints_are_openai_400s(
    server: RunningServer, route: str, fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 5, **fields}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "hi"
        path = "/v1/completions"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, error
        assert "/project/" not in error["message"]
        # Still serving.
        assert http.post(path, json={**body, **dict.fromkeys(fields)}).status_code == 200


def test_a_keyword_the_grammar_would_not_enforce_is_a_400_naming_it(client: openai.OpenAI) -> None:
    """Before, `not` compiled, was ignored, and 13 could come back as the age."""
    age = {"type": "integer", "minimum": 0, "maximum": 120, "not": {"const": 13}}
    schema = {**PERSON, "properties": {**PERSON["properties"], "age": age}}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=5)
    assert info.value.status_code == 400
    error: Any = info.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "response_format.json_schema.schema"
    assert error["message"] == (
        "the JSON schema uses not, which is not enforced here (at #/properties/age/not)"
    )
    del age["not"]  # the rest of the schema is served
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, max_tokens=60, temperature=0
    )
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)


def test_docs_structured_examples_run(server: RunningServer) -> None:
    """The curl and SDK examples of docs/structured-outputs.md, as written."""
    curl, snippet = section_examples(
        "Structured outputs, tools and reasoning", page="structured-outputs.md"
    )
    reply = json.loads(run_example(server.url, "bash", curl))
    person = json.loads(reply["choices"][0]["message"]["content"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)

    printed = run_example(server.url, "python", snippet)
    city, call = printed.strip().splitlines()
    assert city.startswith("name=") and "country=" in city
    name, arguments = call.split(" ", 1)
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str)


def test_compile_bombs_are_400s_within_the_deadline_while_health_stays_fast(
    default_model_dir: Path,
) -> None:
    """A schema past the size limits is refused before compiling; one within them that compiles
    for longer than --grammar-compile-timeout is abandoned at the deadline. Either way a 400
    naming the field, /health answering at once meanwhile, and the server still serving."""
    engine = start_engine(
        model=str(default_model_dir),
        num_kv_blocks=64,
        max_model_len=256,
        grammar_compile_timeout=0.5,
    )
    running = RunningServer(engine, ServerConfig())
    engine.engine.grammars._xgrammar()  # the vocabulary read, which the deadline would count
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(999)}}
    slower = {"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(999)}}
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(900):
        deep = {"type": "array", "items": deep}

    def ask(schema: dict[str, Any]) -> httpx.Response:
        fmt = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}
        return httpx.post(
            running.url + "/v1/chat/completions",
            json={"messages": ASK, "max_tokens": 5, "response_format": fmt},
            timeout=60,
        )

    try:
        with ThreadPoolExecutor(3) as pool:
            started = time.perf_counter()
            answers = [pool.submit(ask, slow), pool.submit(ask, slower)]
            time.sleep(0.1)  # both compile threads taken: the bomb is refused without one
            answers.append(pool.submit(ask, deep))
            time.sleep(0.1)
            health_started = time.perf_counter()
            assert httpx.get(running.url + "/health", timeout=10).status_code == 200
            assert time.perf_counter() - health_started < 0.5
            slow_answer, slower_answer, deep_answer = (a.result() for a in answers)
        assert time.perf_counter() - started < 5  # the deadline, not the compile (seconds more)
        for answer, words in (
            (slow_answer, "did not compile within 0.5 s"),
            (slower_answer, "did not compile within 0.5 s"),
            (deep_answer, "nests"),
        ):
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "response_format" and words in error["message"], error
        # The abandoned compiles end in the cache: wait for them, so that no thread is still in
        # native code when the test process exits; then the threads serve again.
        cache = engine.engine.grammars._cache
        for schema in (slow, slower):
            key = StructuredOutputsParams.json_schema(schema).key
            wait_until(lambda k=key: k in cache, 120, what="the compile")
        assert ask(PERSON).status_code == 200
    finally:
        running.stop()
        engine.shutdown()
