"""Typed outputs as agent frameworks ask for them, against a running server: LangChain's
`with_structured_output` (by json_schema and by function calling) and the OpenAI Agents SDK's
`output_type` (over chat completions and over Responses), each with a small pydantic model and a
token limit, as a new user would write them. Prints, per case, how many runs gave a valid object.

    python bench/quality/agent_typed_outputs.py --base-url http://127.0.0.1:8000 [--runs 4] [--max-tokens 120]

Compare two servers side by side, e.g. `serve --json-whitespace 0` (compact JSON only) against
the default.

    python bench/quality/agent_typed_outputs.py --raw 128 [--schema-hint]

sends instead `--raw` plain chat requests with the same schema as a `json_schema` response format
(8 at a time, seeds 0..N-1, the clients' default temperature), and prints how many ran to the
token limit, with their texts: what the model writes when it does not end. `--schema-hint`
adds a system message that shows the schema, as a client may.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"


class Person(BaseModel):
    name: str
    age: int
    city: str


ASKS = [
    "Extract the person: John Smith is 42 and lives in Boston.",
    "Describe a fictional person.",
    "Make up a person who lives in Rome.",
    "Who is Marie, 31, from Lyon? Answer as a person.",
]


def langchain_case(base_url: str, max_tokens: int, method: str) -> Callable[[str], Any]:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL,
        base_url=base_url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_tokens=max_tokens,  # type: ignore[call-arg]
        max_retries=0,
        timeout=300,
    )
    structured = chat.with_structured_output(Person, method=method)  # type: ignore[arg-type]
    return structured.invoke


def agents_case(base_url: str, max_tokens: int, api: str) -> Callable[[str], Any]:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    def run(ask: str) -> Any:
        async def once() -> Any:
            client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
            kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
            agent = Agent(
                name="people",
                instructions="Answer with the person asked for.",
                model=kind(model=MODEL, openai_client=client),
                model_settings=ModelSettings(max_tokens=max_tokens),
                output_type=Person,
            )
            try:
                return (await Runner.run(agent, ask, max_turns=1)).final_output
            finally:
                await client.close()

        return asyncio.run(once())

    return run


def raw_runs(base_url: str, runs: int, max_tokens: int, hint: bool) -> None:
    import json

    import httpx

    schema = Person.model_json_schema()
    system = [{"role": "system", "content": "Respond with JSON matching: " + json.dumps(schema)}]

    async def one(client: httpx.AsyncClient, i: int, slots: asyncio.Semaphore) -> dict:
        body = {
            "model": MODEL,
            "messages": (system if hint else []) + [{"role": "user", "content": ASKS[i % 4]}],
            "max_tokens": max_tokens,
            "seed": i,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "Person", "schema": schema},
            },
        }
        async with slots:
            response = await client.post("/v1/chat/completions", json=body)
        return response.json()["choices"][0]

    async def all_runs() -> list[dict]:
        slots = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            return await asyncio.gather(*(one(client, i, slots) for i in range(runs)))

    cut = [c["message"]["content"] for c in asyncio.run(all_runs()) if c["finish_reason"] != "stop"]
    print(f"ran to the token limit: {len(cut)}/{runs}")
    for text in cut:
        print("  " + repr(text)[:160])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--runs", type=int, default=4, help="asks per case (cycling the prompts)")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--raw", type=int, default=0, help="plain json_schema chat requests")
    parser.add_argument("--schema-hint", action="store_true")
    args = parser.parse_args()
    if args.raw:
        raw_runs(args.base_url, args.raw, args.max_tokens, args.schema_hint)
        return
    cases = {
        "langchain json_schema": langchain_case(args.base_url, args.max_tokens, "json_schema"),
        "langchain function_calling": langchain_case(
            args.base_url, args.max_tokens, "function_calling"
        ),
        "agents chat completions": agents_case(args.base_url, args.max_tokens, "chat"),
        "agents responses": agents_case(args.base_url, args.max_tokens, "responses"),
    }
    total = 0
    for name, case in cases.items():
        passed, started = 0, time.perf_counter()
        failures = []
        for i in range(args.runs):
            try:
                result = case(ASKS[i % len(ASKS)])
                if isinstance(result, Person):
                    passed += 1
                else:
                    failures.append(f"got {type(result).__name__}")
            except Exception as exc:  # noqa: BLE001 - a failed run is what is counted
                failures.append(f"{type(exc).__name__}: {str(exc)[:80]}")
        total += passed
        seconds = time.perf_counter() - started
        print(f"{name:28s} {passed}/{args.runs}  {seconds:6.1f} s  {'; '.join(failures[:2])}")
    print(f"total {total}/{args.runs * len(cases)}")


if __name__ == "__main__":
    main()
