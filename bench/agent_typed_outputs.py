"""Typed outputs as agent frameworks ask for them, against a running server: LangChain's
`with_structured_output` (by json_schema and by function calling) and the OpenAI Agents SDK's
`output_type` (over chat completions and over Responses), each with a small pydantic model and a
token limit, as a new user would write them. Prints, per case, how many runs gave a valid object.

    python bench/agent_typed_outputs.py --base-url http://127.0.0.1:8000 [--runs 4] [--max-tokens 120]

Compare two servers side by side, e.g. `serve --json-whitespace 0` (compact JSON only) against
the default.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--runs", type=int, default=4, help="asks per case (cycling the prompts)")
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
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
