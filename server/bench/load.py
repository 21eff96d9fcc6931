"""Serving load: streamed requests against any OpenAI-compatible server, timed on the client.

Each request is streamed, so that the time to the first token and the gaps between tokens can
be measured on the client side:

- TTFT: request sent -> first chunk with non-empty text
- ITL:  gaps between successive chunks with non-empty text (all requests pooled)
- TPOT: (e2e - TTFT) / (output tokens - 1), one value per request
- E2E:  request sent -> `data: [DONE]`

Conversations arrive all at once (`request_rate` inf) or as a Poisson process, and their
requests go out through a gate of `max_concurrency` in flight. A conversation sends its next
turn when the last one is answered, behind the requests already waiting at the gate: with
more conversations than the gate lets through, turns take their turn round the conversations.
Requests go over keep-alive connections through `SSEClient`, which spends about half the CPU
per token that httpx did: CPU a client on the server's machine takes from the server.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from server.bench.datasets import Conversation, chat_messages, completion_prompt, from_workload
from server.bench.sse_stream import SSEClient
from server.bench.stats import STANDARD_PERCENTILES, percentile_key, summarize
from server.bench.workload import arrival_delays, make_workload, warmup_workload

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
EARLIER_TURN_FAILED = "an earlier turn of its conversation failed"


@dataclass
class LoadSettings:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS  # one ending in /chat/completions sends messages
    model: str | None = None  # None: the first model GET /v1/models lists
    max_concurrency: int | None = None  # None: no bound
    request_rate: float = math.inf
    burstiness: float = 1.0  # the arrival gaps' gamma shape: 1 Poisson, below 1 burstier
    seed: int = 0
    timeout: float | None = 600.0  # on the whole run; None: none
    request_timeout: float | None = None  # on one request; None: the run's
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    progress: bool = False

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass
class RequestResult:
    index: int
    input_len: int  # the server's prompt_tokens when it reports usage, else the ids sent
    requested_output_len: int
    conversation: int = 0
    turn: int = 0
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    text: str = ""  # the answer, which a conversation's next turn sends back

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def first_model(base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The first entry of GET /v1/models (its `id`, and `root`: what it was loaded from)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), headers=headers) as http:
        response = await http.get(f"{base_url}/v1/models")
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return dict(data[0])


def request_body(
    settings: LoadSettings, model: str, conversation: Conversation, answers: list[str]
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": conversation.turns[len(answers)].output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and llama.cpp's name for it
    if settings.chat:
        body["messages"] = chat_messages(conversation, answers)
    else:
        body["prompt"] = completion_prompt(conversation, answers)
    return body


async def send_one(
    client: SSEClient, body: dict[str, Any], result: RequestResult, request_timeout: float | None
) -> None:
    """Send one request and fill `result`; `ok` is set only for a stream that ended cleanly."""
    start = time.perf_counter()
    try:
        # One deadline for the whole request, not for each read.
        # (wait_for rather than asyncio.timeout: the project still supports Python 3.10.)
        await asyncio.wait_for(
            _stream(client, json.dumps(body).encode(), result, start), request_timeout
        )
    except asyncio.TimeoutError:
        result.ok, result.error = False, f"timed out after {request_timeout:g} s"
    except (OSError, ValueError) as exc:  # unreachable, dropped, malformed (JSON included)
        result.ok, result.error = False, f"{type(exc).__name__}: {exc}"


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:  # chat
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def _stream(client: SSEClient, body: bytes, result: RequestResult, start: float) -> None:
    chunks = 0
    usage: dict[str, Any] = {}
    last = start
    pieces: list[str] = []

    def on_data(payload: bytes) -> None:
        nonlocal chunks, usage, last
        if payload == b"[DONE]":
            result.e2e = time.perf_counter() - start
            return
        event = json.loads(payload)
        if "error" in event:
            result.error = result.error or f"stream error: {json.dumps(event['error'])[:300]}"
            return
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or []:
            text = _chunk_text(choice)
            if not text:
                continue  # role-only, held-back or final chunks carry no text
            now = time.perf_counter()
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            chunks += 1
            pieces.append(text)

    end = await client.post(body, on_data)
    if end.status != 200:
        result.error = f"HTTP {end.status}: {end.body.decode(errors='replace')[:300]}"
        return
    if result.error:
        return
    if not end.done:
        result.error = "stream ended without data: [DONE]"
        return
    result.text = "".join(pieces)
    # A chunk can hold several tokens (or a token can decode to no text): trust usage first.
    result.output_tokens = usage.get("completion_tokens", chunks)
    result.input_len = usage.get("prompt_tokens", result.input_len)
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "no text was streamed"


def _planned(conversations: list[Conversation]) -> list[list[RequestResult]]:
    """A result for every request, numbered in conversation order, filled as they finish."""
    results, index = [], 0
    for c, conversation in enumerate(conversations):
        row = []
        for t, turn in enumerate(conversation.turns):
            ids = 0 if isinstance(turn.prompt, str) or t else len(turn.prompt)
            row.append(RequestResult(index, ids, turn.output_len, conversation=c, turn=t))
            index += 1
        results.append(row)
    return results


async def run_conversations(
    conversations: list[Conversation],
    settings: LoadSettings,
    warmup: list[Conversation] | None = None,
    config: dict[str, Any] | None = None,
    keep_requests: bool = True,
    percentiles: tuple[float, ...] = STANDARD_PERCENTILES,
) -> dict[str, Any]:
    """Send every conversation's turns and return the report (see `build_report`). `warmup`
    conversations' first turns go first, one at a time, unmeasured: first-call allocation and
    kernel selection are not load."""
    base_url = settings.base_url.rstrip("/")
    timeout = settings.timeout
    request_timeout = settings.request_timeout or timeout
    if timeout is not None and request_timeout is not None:
        request_timeout = min(request_timeout, timeout)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    model = settings.model or str((await first_model(base_url, headers))["id"])
    results = _planned(conversations)
    total = sum(len(row) for row in results)
    delays = arrival_delays(
        len(conversations), settings.request_rate, settings.seed, settings.burstiness
    )
    gate = asyncio.Semaphore(settings.max_concurrency or max(total, 1))
    client = SSEClient(f"{base_url}/{settings.endpoint.lstrip('/')}", headers)
    progress = _progress(total, settings.progress)

    async def converse(c: int, conversation: Conversation) -> None:
        answers: list[str] = []
        for t in range(len(conversation.turns)):
            result = results[c][t]
            async with gate:
                body = request_body(settings, model, conversation, answers)
                await send_one(client, body, result, request_timeout)
            progress.update(1)
            if not result.ok:
                for later in results[c][t + 1 :]:
                    later.error = EARLIER_TURN_FAILED
                return
            answers.append(result.text)

    tasks: list[asyncio.Task[None]] = []
    try:
        for probe in warmup or []:
            body = request_body(settings, model, Conversation(probe.turns[:1]), [])
            await send_one(client, body, RequestResult(-1, 0, 0), request_timeout)

        async def dispatch_and_wait() -> None:
            for c, (conversation, delay) in enumerate(zip(conversations, delays)):
                if delay:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(converse(c, conversation)))
            await asyncio.gather(*tasks, return_exceptions=True)

        start = time.perf_counter()
        try:
            await asyncio.wait_for(dispatch_and_wait(), timeout)
        except asyncio.TimeoutError:
            pass  # everything unfinished is counted as failed below
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
        if timeout is not None:
            duration = min(duration, timeout)
    finally:
        client.close()
        progress.close()

    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]  # a fault here, not the server's
    flat = [r for row in results for r in row]
    bound = "unfinished" if timeout is None else f"unfinished at the {timeout:g} s bound"
    for r in flat:
        if not r.ok and not r.error:
            r.error = bound
    report_config: dict[str, Any] = {
        "base_url": base_url,
        "endpoint": settings.endpoint,
        "model": model,
        "max_concurrency": settings.max_concurrency,
        "request_rate": settings.request_rate,
        "burstiness": settings.burstiness,
        "seed": settings.seed,
        "timeout": timeout,
        "request_timeout": request_timeout,
        "ignore_eos": settings.ignore_eos,
        "warmup": len(warmup or []),
    }
    return build_report(flat, duration, report_config | (config or {}), keep_requests, percentiles)


def _progress(total: int, shown: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=not shown, unit="req", dynamic_ncols=True)


async def run_load(
    base_url: str = "http://127.0.0.1:8000",
    model: str | None = None,
    num_requests: int = 64,
    concurrency: int | None = None,
    request_rate: float = math.inf,
    input_len: int = 128,
    output_len: int = 64,
    range_ratio: float = 0.0,
    vocab_size: int = 49152,
    seed: int = 0,
    timeout: float = 600.0,
    request_timeout: float | None = None,
    warmup: int = 1,
    keep_requests: bool = True,
) -> dict[str, Any]:
    """Random prompts of ids in [LOW_TOKEN_ID, vocab_size) to /v1/completions, greedy, EOS
    ignored (seeded, so two servers get the same prompts); returns the report."""
    workload = make_workload(num_requests, input_len, output_len, range_ratio, vocab_size, seed)
    settings = LoadSettings(
        base_url=base_url,
        model=model,
        max_concurrency=concurrency,
        request_rate=request_rate,
        seed=seed,
        timeout=timeout,
        request_timeout=request_timeout,
    )
    dataset = {"dataset_name": "random", "num_requests": num_requests, "input_len": input_len}
    dataset |= {"output_len": output_len, "range_ratio": range_ratio, "vocab_size": vocab_size}
    return await run_conversations(
        from_workload(workload),
        settings,
        from_workload(warmup_workload(warmup, input_len, vocab_size, seed)),
        dataset,
        keep_requests,
    )


def build_report(
    results: list[RequestResult],
    duration: float,
    config: dict[str, Any],
    keep_requests: bool,
    percentiles: tuple[float, ...] = STANDARD_PERCENTILES,
) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    input_tokens = sum(r.input_len for r in good)
    output_tokens = sum(r.output_tokens for r in good)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1

    def per_second(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    report: dict[str, Any] = {
        "config": config,
        "duration_s": duration,
        "num_requests": len(results),
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": errors,
        # Tokens a server returned beyond or short of max_tokens with ignore_eos: a correctness flag.
        "length_mismatches": sum(1 for r in good if r.output_tokens != r.requested_output_len),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_second(len(good)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "ttft": summarize([r.ttft for r in good if r.ttft is not None], percentiles),
        "tpot": summarize([t for r in good if (t := r.tpot) is not None], percentiles),
        "itl": summarize([gap for r in good for gap in r.itl], percentiles),
        "e2e": summarize([r.e2e for r in good if r.e2e is not None], percentiles),
    }
    if keep_requests:
        report["requests"] = [
            {k: v for k, v in asdict(r).items() if k not in ("itl", "text")} | {"tpot": r.tpot}
            for r in results
        ]
    return report


METRIC_TITLES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token (after the first)",
    "itl": "Inter-token latency",
    "e2e": "End-to-end latency",
}


def format_report(
    report: dict[str, Any],
    title: str = "",
    metrics: tuple[str, ...] = tuple(METRIC_TITLES),
    percentiles: tuple[float, ...] = (99.0,),
) -> str:
    """The report as a table: counts and throughputs, then the mean, median and `percentiles`
    of each of `metrics`."""
    c = report["config"]
    width = 52

    def row(name: str, value: object) -> str:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{name}{shown:>{max(width - len(name), len(shown) + 1)}}"

    def rule(text: str, fill: str) -> str:
        return f" {text} ".center(width, fill) if text else fill * width

    rate = c.get("request_rate", math.inf)
    lines = [
        rule(title or "Serving benchmark", "="),
        row("Server:", c.get("base_url", "")),
        row("Model:", c.get("model", "")),
        row("Endpoint:", c.get("endpoint", COMPLETIONS)),
        row("Request rate (req/s):", "inf" if math.isinf(rate) else f"{rate:g}"),
        row("Maximum request concurrency:", c.get("max_concurrency") or "none"),
        row("Successful requests:", report["completed"]),
        row("Failed requests:", report["failed"]),
        row("Benchmark duration (s):", report["duration_s"]),
        row("Total input tokens:", report["input_tokens"]),
        row("Total generated tokens:", report["output_tokens"]),
        row("Request throughput (req/s):", report["request_throughput"]),
        row("Output token throughput (tok/s):", report["output_throughput"]),
        row("Total token throughput (tok/s):", report["total_token_throughput"]),
    ]
    if c.get("ignore_eos", True):
        lines.append(row("Output length mismatches:", report["length_mismatches"]))
    for name in metrics:
        s = report[name]
        lines += [
            rule(METRIC_TITLES[name], "-"),
            row(f"Mean {name.upper()} (ms):", s["mean_ms"]),
            row(f"Median {name.upper()} (ms):", s["p50_ms"]),
        ]
        lines += [row(f"P{q:g} {name.upper()} (ms):", s[percentile_key(q)]) for q in percentiles]
    lines.append(rule("", "="))
    for error, count in report["errors"].items():
        lines.append(f"  {count} x {error}")
    return "\n".join(lines)
