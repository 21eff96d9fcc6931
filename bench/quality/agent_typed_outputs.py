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

    python bench/quality/agent_typed_outputs.py --table [--seeds 128] [--grammars 0 -1 4]
        [--concurrency 8] [--out bench/results/typed-outputs.json]

starts `pagedserve serve --json-whitespace N` for each grammar in turn (0: compact, -1: any
whitespace as vLLM's default, 4: runs of at most 4) and sends each seed's ask by three client
paths with the official openai client at its default temperature: chat completions with a
json_schema response format, chat completions with a forced tool, and Responses with a
json_schema text format. Prints per grammar and path the valid objects (parses, validates
against the schema, ended within max_tokens), mean output tokens and finish reasons, and writes
them, every outcome and the load average while it ran as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
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


# --------------------------------------------------------------------------- the grammar table

# The --json-whitespace values the table compares: compact JSON, vLLM's default grammar (any
# whitespace), and whitespace in runs of at most 4.
GRAMMARS = {"compact (0)": 0, "any whitespace (-1)": -1, "runs of <= 4 (4)": 4}
CLIENT_PATHS = ("chat json_schema", "chat forced tool", "responses json_schema")


@dataclass
class Outcome:
    """One request of the table: what came back and whether it is a valid Person."""

    grammar: str
    path: str
    seed: int
    finish_reason: str
    output_tokens: int
    valid: bool
    text: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serving(whitespace: int, cache: str) -> Iterator[str]:
    """`pagedserve serve --json-whitespace N` on the default model over 127.0.0.1, its cache
    (Responses store included) in `cache`; yields the base URL once /health answers."""
    import httpx

    # The converted default model is read from the usual cache, not converted again in `cache`.
    usual = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache/pagedserve"))
    model = [str(usual / MODEL)] if (usual / MODEL).exists() else []
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "serve", *model, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--served-model-name", MODEL]
    argv += ["--json-whitespace", str(whitespace)]
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": cache}
    # Its log goes to a file: a pipe nobody reads would block the server once full.
    log = open(Path(cache) / "server.log", "wb")  # noqa: SIM115 - closed with the server
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                tail = (Path(cache) / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"server exited: {tail}")
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server not healthy after 300 s")
            time.sleep(0.5)
        yield base_url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _person(text: str | None) -> bool:
    """The text parses as JSON and validates against Person's schema."""
    from jsonschema import Draft202012Validator

    try:
        value = json.loads(text or "")
    except json.JSONDecodeError:
        return False
    return Draft202012Validator(Person.model_json_schema()).is_valid(value)


async def _ask(client: Any, path: str, seed: int, max_tokens: int) -> tuple[str, int, str]:
    """(finish reason, output tokens, the JSON text) of one ask by one client path, sent as
    LangChain's with_structured_output and the Agents SDK's output_type send it."""
    schema = Person.model_json_schema()
    messages = [{"role": "user", "content": ASKS[seed % len(ASKS)]}]
    if path == "chat json_schema":
        r = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=max_tokens,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "Person", "schema": schema, "strict": True},
            },
        )
        c = r.choices[0]
        return c.finish_reason, r.usage.completion_tokens, c.message.content or ""
    if path == "chat forced tool":
        r = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=max_tokens,
            seed=seed,
            tools=[{"type": "function", "function": {"name": "Person", "parameters": schema}}],
            tool_choice={"type": "function", "function": {"name": "Person"}},
        )
        c = r.choices[0]
        calls = c.message.tool_calls or []
        text = calls[0].function.arguments if calls else (c.message.content or "")
        return c.finish_reason, r.usage.completion_tokens, text
    # OpenAI's Responses API has no seed: these runs are a sample, not reproducible.
    r = await client.responses.create(
        model=MODEL,
        input=messages[0]["content"],
        max_output_tokens=max_tokens,
        store=False,
        text={
            "format": {"type": "json_schema", "name": "Person", "schema": schema, "strict": True}
        },
    )
    finish = "stop" if r.status == "completed" else f"incomplete: {r.incomplete_details.reason}"
    return finish, r.usage.output_tokens, r.output_text


async def _grammar_runs(
    base_url: str, grammar: str, seeds: int, max_tokens: int, concurrency: int
) -> list[Outcome]:
    from openai import AsyncOpenAI

    slots = asyncio.Semaphore(concurrency)
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=900)

    async def one(path: str, seed: int) -> Outcome:
        async with slots:
            finish, tokens, text = await _ask(client, path, seed, max_tokens)
        ended = finish in ("stop", "tool_calls")
        return Outcome(grammar, path, seed, finish, tokens, ended and _person(text), text)

    try:
        # Paths interleaved, so that a load change on the shared machine falls on all of them.
        return await asyncio.gather(
            *(one(path, seed) for seed in range(seeds) for path in CLIENT_PATHS)
        )
    finally:
        await client.close()


def summarize(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    rows = []
    for grammar in dict.fromkeys(o.grammar for o in outcomes):
        for path in (*CLIENT_PATHS, "all paths"):
            cell = [o for o in outcomes if o.grammar == grammar and path in (o.path, "all paths")]
            rows.append(
                {
                    "grammar": grammar,
                    "path": path,
                    "runs": len(cell),
                    "valid": sum(o.valid for o in cell),
                    "mean_output_tokens": round(statistics.fmean(o.output_tokens for o in cell), 1),
                    "finish_reasons": dict(Counter(o.finish_reason for o in cell)),
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| grammar (--json-whitespace) | client path | valid | mean output tokens | finish reasons |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        finishes = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))
        share = f"{r['valid']}/{r['runs']} ({100 * r['valid'] / r['runs']:.1f}%)"
        print(
            f"| {r['grammar']} | {r['path']} | {share} | {r['mean_output_tokens']} | {finishes} |"
        )


def grammar_table(args: argparse.Namespace) -> None:
    """Each grammar's server in turn, every client path at seeds 0..N-1; the table printed and
    written to --out as JSON with every outcome and the load average while it ran."""
    chosen = {name: value for name, value in GRAMMARS.items() if value in args.grammars}
    outcomes: list[Outcome] = []
    loads: list[float] = []
    started = time.time()
    for name, whitespace in chosen.items():
        with (
            tempfile.TemporaryDirectory(prefix="typed-") as cache,
            serving(whitespace, cache) as url,
        ):
            began = time.perf_counter()
            run = asyncio.run(
                _sampling_load(
                    loads, _grammar_runs(url, name, args.seeds, args.max_tokens, args.concurrency)
                )
            )
            outcomes += run
            print(f"{name}: {len(run)} requests in {time.perf_counter() - began:.0f} s", flush=True)
            write_report(args, started, loads, outcomes)  # each grammar's, as soon as it is in
    print_table(summarize(outcomes))
    print(f"load average (1 min) {load_summary(loads)}; wrote {args.out}")


def load_summary(loads: list[float]) -> dict[str, float]:
    return {"min": min(loads), "mean": round(statistics.fmean(loads), 2), "max": max(loads)}


def write_report(
    args: argparse.Namespace, started: float, loads: list[float], outcomes: list[Outcome]
) -> None:
    report = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "model": MODEL,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "seeds": args.seeds,
        "load_average_1min": load_summary(loads),
        "table": summarize(outcomes),
        # Texts of the invalid ones only: what went wrong, without a file of valid objects.
        "outcomes": [{**asdict(o), "text": o.text if not o.valid else None} for o in outcomes],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


async def _sampling_load(loads: list[float], work: Awaitable[list[Outcome]]) -> list[Outcome]:
    """`work`'s result, with the 1-minute load average appended to `loads` every 10 s meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        loads.append(os.getloadavg()[0])
        await asyncio.wait([task], timeout=10)
    return task.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--runs", type=int, default=4, help="asks per case (cycling the prompts)")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--raw", type=int, default=0, help="plain json_schema chat requests")
    parser.add_argument("--schema-hint", action="store_true")
    parser.add_argument("--table", action="store_true", help="the grammar table (own servers)")
    parser.add_argument("--seeds", type=int, default=128, help="asks per grammar and path")
    parser.add_argument("--grammars", type=int, nargs="+", default=list(GRAMMARS.values()))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results/typed-outputs.json"))
    args = parser.parse_args()
    if args.table:
        grammar_table(args)
        return
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
