"""Structured outputs: what the grammar mask costs, side by side in one run.

On the default model (`LLM()`: the bundled SmolLM2-135M-Instruct, bf16 on CPU), 16 requests at
once (`max_num_seqs` 16):

1. Compile: the vocabulary read (once per engine) and the first compile of a JSON schema with 8
   properties (strings with maxLength, bounded integers, an enum, a nested object, an array with
   maxItems, a boolean), of `json_object`, of a regex and of a 3-way choice, each on a fresh
   `GrammarCompiler` (repeated `--compile-repeats` times), then a cache hit.
2. Throughput, constrained against unconstrained with exactly the same work: 16 chat prompts that
   ask for JSON. A constrained run (greedy, `max_tokens` large enough that every request ends by
   its grammar) records each request's output length; the unconstrained run that follows asks
   for exactly that many tokens (`max_tokens` = the length, `ignore_eos`), so both produce the
   same tokens per request. Pairs alternate (constrained, unconstrained, constrained, ...),
   `--repeats` pairs after one unmeasured constrained warm-up pass on the same prompts (so every
   measured run finds the prompts in the prefix cache alike).
   - offline, through `LLM.generate`, with the engine's step, its sampler, `apply_grammar_masks`,
     xgrammar's bitmask fill and apply, and `GrammarState.accept` timed by wrapping them;
   - over HTTP, against `pagedserve serve` started on 127.0.0.1, with the `openai` AsyncOpenAI
     client at concurrency 16: `response_format` json_schema against plain chat with
     `max_tokens` and `extra_body={"ignore_eos": True}`. Each run is bounded (`--http-run-timeout`).
3. A markdown table on stdout; everything (per request lengths, per run timings) as JSON in `--out`.

    python bench/quality/structured_outputs.py --out structured.json [--repeats 3] [--skip-http]

A benchmark, not part of CI: it loads the model twice (in-process, then in the server) and
takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# compare_vllm's server helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))

from compare_vllm import ServerFailed, start, stop, wait_healthy

import engine.structured.state as state_module
import engine.worker.sampler as sampler_module
from engine import LLM, SamplingParams
from engine.structured import GrammarCompiler, GrammarState, StructuredOutputsParams

# A realistic response schema: 8 properties, every kind of bound xgrammar has to encode.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "email": {"type": "string", "maxLength": 60},
        "role": {"type": "string", "enum": ["engineer", "teacher", "doctor", "artist", "other"]},
        "years_experience": {"type": "integer", "minimum": 0, "maximum": 60},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "country": {"type": "string", "maxLength": 40},
                "postal_code": {"type": "string", "maxLength": 10},
            },
            "required": ["city", "country", "postal_code"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 30},
            "maxItems": 4,
        },
        "available": {"type": "boolean"},
    },
    "required": [
        "name",
        "age",
        "email",
        "role",
        "years_experience",
        "address",
        "skills",
        "available",
    ],
    "additionalProperties": False,
}
REGEX = r"[a-z][a-z0-9._]{0,19}@[a-z]{2,15}\.(com|org|net)"
CHOICE = ("positive", "negative", "neutral")

JOBS = ["engineer", "teacher", "doctor", "artist"]
CITIES = ["Lisbon", "Osaka", "Toronto", "Nairobi"]


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    """`count` different conversations, each asking for one JSON object with the schema's fields."""
    prompts = []
    for i in range(count):
        job, city = JOBS[i % len(JOBS)], CITIES[(i // len(JOBS)) % len(CITIES)]
        prompts.append(
            [
                {
                    "role": "user",
                    "content": (
                        f"Invent a {job} who lives in {city} and describe them as one JSON object "
                        "with the fields name, age, email, role, years_experience, address (city, "
                        "country, postal_code), skills (a list of up to 4 strings) and available "
                        "(true or false). Answer with the JSON only."
                    ),
                }
            ]
        )
    return prompts


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "xgrammar", "transformers", "openai"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def valid_json_objects(texts: list[str]) -> int:
    """How many texts parse as a JSON object holding every required property."""
    count = 0
    for text in texts:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict) and all(k in value for k in SCHEMA["required"]):
            count += 1
    return count


# ----------------------------------------------------------------------------- 1. compile


def bench_compile(llm: LLM, repeats: int) -> dict[str, Any]:
    """Each constraint on `repeats` fresh compilers: vocabulary read, first compile, cache hit."""
    started = time.perf_counter()
    import xgrammar  # noqa: F401  (timed: the first grammar of a process pays for it)

    import_s = time.perf_counter() - started
    grammars = llm.engine.grammars
    constraints = {
        "json_schema (8 properties)": StructuredOutputsParams.json_schema(SCHEMA),
        "json_object": StructuredOutputsParams(json_object=True),
        "regex (an email address)": StructuredOutputsParams(regex=REGEX),
        "choice (3 strings)": StructuredOutputsParams(choice=CHOICE),
    }
    rows = []
    for name, params in constraints.items():
        vocab, first, hit = [], [], []
        for _ in range(repeats):
            compiler = GrammarCompiler(
                grammars.load_tokenizer, grammars.vocab_size, grammars.eos_token_id
            )
            t0 = time.perf_counter()
            compiler._xgrammar()  # the vocabulary read, once per engine
            t1 = time.perf_counter()
            compiler.compile(params)
            t2 = time.perf_counter()
            compiler.compile(params)
            t3 = time.perf_counter()
            vocab.append(t1 - t0)
            first.append(t2 - t1)
            hit.append(t3 - t2)
        rows.append({"constraint": name, "vocab_read_s": vocab, "compile_s": first, "hit_s": hit})
    return {"xgrammar_import_s": import_s, "repeats": repeats, "rows": rows}


# ----------------------------------------------------------------------------- 2. offline


class Probe:
    """Wraps the step, the sampler, `apply_grammar_masks`, xgrammar's fill and apply and
    `GrammarState.accept`, adding up the time spent in each; `reset` starts a new run."""

    NAMES = ("step", "sampler", "mask", "fill", "apply", "accept")

    def __init__(self, llm: LLM) -> None:
        import xgrammar as xgr

        self.totals = dict.fromkeys(self.NAMES, 0.0)
        self.steps = 0
        self.masked_steps = 0
        engine = llm.engine
        self._undo: list[Callable[[], None]] = []

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.totals[name] += time.perf_counter() - t0

            return wrapper

        step = engine.step

        def counted_step() -> Any:
            self.steps += 1
            return step()

        self._patch(engine, "step", timed("step", counted_step))
        self._patch(engine, "sampler", timed("sampler", engine.sampler))
        masks = sampler_module.apply_grammar_masks

        def counted_masks(logits: Any, states: list[GrammarState | None]) -> None:
            if any(s is not None and s.active for s in states):
                self.masked_steps += 1
            masks(logits, states)

        self._patch(sampler_module, "apply_grammar_masks", timed("mask", counted_masks))
        self._patch(
            xgr.GrammarMatcher,
            "fill_next_token_bitmask",
            timed("fill", xgr.GrammarMatcher.fill_next_token_bitmask),
        )
        self._patch(
            xgr, "apply_token_bitmask_inplace", timed("apply", xgr.apply_token_bitmask_inplace)
        )
        if hasattr(state_module, "_apply_on_cpu"):  # the CPU path's own apply
            self._patch(state_module, "_apply_on_cpu", timed("apply", state_module._apply_on_cpu))
        self._patch(GrammarState, "accept", timed("accept", GrammarState.accept))

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name`; `restore` puts back what was there (an instance attribute, or the
        class's method that the instance attribute shadows)."""
        missing = object()
        old = owner.__dict__.get(name, missing)
        setattr(owner, name, value)
        self._undo.append(
            lambda: delattr(owner, name) if old is missing else setattr(owner, name, old)
        )

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def reset(self) -> None:
        self.totals = dict.fromkeys(self.NAMES, 0.0)
        self.steps = 0
        self.masked_steps = 0

    def snapshot(self) -> dict[str, Any]:
        per_step = {
            f"{k}_ms_per_step": 1000 * v / max(self.steps, 1) for k, v in self.totals.items()
        }
        return {
            "steps": self.steps,
            "masked_steps": self.masked_steps,
            "totals_s": dict(self.totals),
        } | per_step


def offline_run(
    llm: LLM,
    probe: Probe,
    prompts: list[list[int]],
    params: list[SamplingParams],
) -> dict[str, Any]:
    probe.reset()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return {
        "duration_s": seconds,
        "output_tokens": sum(lengths),
        "output_throughput": sum(lengths) / seconds,
        "lengths": lengths,
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
    } | probe.snapshot()


def constrained_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams.json_schema(SCHEMA),
    )


def bench_offline(
    llm: LLM, conversations: list[list[dict[str, str]]], args: argparse.Namespace
) -> dict[str, Any]:
    prompts = [llm.render_chat(c) for c in conversations]  # type: ignore[arg-type]
    probe = Probe(llm)
    llm.engine.grammars.compile(StructuredOutputsParams.json_schema(SCHEMA))  # not timed here
    warm = offline_run(llm, probe, prompts, [constrained_params(args.max_tokens)] * len(prompts))
    print(
        f"offline warm-up (constrained, unmeasured): {warm['output_tokens']} tokens, {warm['duration_s']:.1f} s",
        flush=True,
    )
    pairs = []
    for i in range(args.repeats):
        c = offline_run(llm, probe, prompts, [constrained_params(args.max_tokens)] * len(prompts))
        plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in c["lengths"]]
        u = offline_run(llm, probe, prompts, plain)
        c["valid_json"] = valid_json_objects(c["texts"])
        c["hit_max_tokens"] = sum(r == "length" for r in c["finish_reasons"])
        u["length_mismatches"] = sum(a != b for a, b in zip(u["lengths"], c["lengths"]))
        print(
            f"offline pair {i + 1}: constrained {c['output_throughput']:.1f} tok/s "
            f"({c['output_tokens']} tokens, mask {c['mask_ms_per_step']:.2f} ms/step), "
            f"unconstrained {u['output_throughput']:.1f} tok/s",
            flush=True,
        )
        pairs.append({"constrained": c, "unconstrained": u})
    probe.restore()
    return {"prompt_tokens": [len(p) for p in prompts], "warmup": warm, "pairs": pairs}


# ----------------------------------------------------------------------------- 2. HTTP


async def http_run(
    base_url: str,
    model: str,
    conversations: list[list[dict[str, str]]],
    lengths: list[int] | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Constrained when `lengths` is None, else plain with max_tokens = lengths[i] and ignore_eos."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        timeout=args.request_timeout,
        max_retries=0,
    )
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> dict[str, Any]:
        kwargs: dict[str, Any]
        if lengths is None:
            kwargs = {
                "max_tokens": args.max_tokens,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": SCHEMA},
                },
            }
        else:
            kwargs = {"max_tokens": lengths[i], "extra_body": {"ignore_eos": True}}
        async with gate:
            try:
                response = await client.chat.completions.create(
                    model=model,
                    messages=conversations[i],  # type: ignore[arg-type]
                    temperature=0,
                    **kwargs,
                )
            except Exception as exc:  # noqa: BLE001  (a failed request is reported, not raised)
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        choice = response.choices[0]
        tokens = response.usage.completion_tokens if response.usage is not None else 0
        return {
            "ok": True,
            "tokens": tokens,
            "finish_reason": choice.finish_reason,
            "text": choice.message.content or "",
        }

    started = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(len(conversations))]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), args.http_run_timeout)
    except asyncio.TimeoutError:
        pass
    seconds = time.perf_counter() - started
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    results = [
        t.result()
        if not t.cancelled() and t.exception() is None
        else {"ok": False, "error": f"unfinished at the {args.http_run_timeout:g} s bound"}
        for t in tasks
    ]
    good = [r for r in results if r["ok"]]
    produced = sum(r["tokens"] for r in good)
    run = {
        "duration_s": seconds,
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": sorted({r["error"] for r in results if not r["ok"]}),
        "output_tokens": produced,
        "output_throughput": produced / seconds,
        "lengths": [r.get("tokens", 0) for r in results],
        "finish_reasons": [r.get("finish_reason") for r in results],
    }
    if lengths is None:
        run["valid_json"] = valid_json_objects([r["text"] for r in good])
        run["hit_max_tokens"] = sum(r["finish_reason"] == "length" for r in good)
    else:
        run["length_mismatches"] = sum(a != b for a, b in zip(run["lengths"], lengths))
    return run


def bench_http(
    conversations: list[list[dict[str, str]]], args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    script = Path(sys.executable).with_name("pagedserve")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "server.cli"]
    cmd = [
        *launcher,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--max-num-seqs",
        str(args.concurrency),
        "--uvicorn-log-level",
        "warning",
        *shlex.split(args.pagedserve_args),
    ]
    base_url = f"http://127.0.0.1:{args.port}"
    log = log_dir / "pagedserve.log"
    proc = start(cmd, dict(os.environ), log)
    try:
        ready_s = asyncio.run(wait_healthy(base_url, proc, log, args.startup_timeout))
        print(f"pagedserve: healthy after {ready_s:.1f} s", flush=True)
        import httpx

        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        warm = asyncio.run(http_run(base_url, model, conversations, None, args))
        print(
            f"HTTP warm-up (constrained, unmeasured): {warm['output_tokens']} tokens, {warm['duration_s']:.1f} s, failed {warm['failed']}",
            flush=True,
        )
        pairs = []
        for i in range(args.repeats):
            c = asyncio.run(http_run(base_url, model, conversations, None, args))
            if c["failed"]:
                print(
                    f"HTTP pair {i + 1}: {c['failed']} constrained requests failed: {c['errors']}",
                    flush=True,
                )
                pairs.append({"constrained": c, "unconstrained": None})
                continue
            u = asyncio.run(http_run(base_url, model, conversations, c["lengths"], args))
            print(
                f"HTTP pair {i + 1}: constrained {c['output_throughput']:.1f} tok/s "
                f"({c['output_tokens']} tokens), unconstrained {u['output_throughput']:.1f} tok/s "
                f"(failed {u['failed']})",
                flush=True,
            )
            pairs.append({"constrained": c, "unconstrained": u})
        return {"command": cmd, "log": str(log), "ready_s": ready_s, "warmup": warm, "pairs": pairs}
    except ServerFailed as exc:
        print(f"pagedserve: {exc}", flush=True)
        return {"command": cmd, "log": str(log), "error": str(exc), "pairs": []}
    finally:
        stop(proc)


# ----------------------------------------------------------------------------- 3. report


def ms_range(values: list[float]) -> str:
    ms = [1000 * v for v in values]
    med = statistics.median(ms)
    digits = 3 if med < 1 else 1 if med < 100 else 0
    if len(ms) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(ms):.{digits}f}-{max(ms):.{digits}f})"


def compile_table(result: dict[str, Any]) -> str:
    lines = [
        f"xgrammar import: {1000 * result['xgrammar_import_s']:.0f} ms (once per process). "
        f"Each constraint on {result['repeats']} fresh compilers: median (min-max).",
        "",
        "| constraint | vocabulary read ms | first compile ms | cache hit ms |",
        "|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['constraint']} | {ms_range(row['vocab_read_s'])} | "
            f"{ms_range(row['compile_s'])} | {ms_range(row['hit_s'])} |"
        )
    return "\n".join(lines)


def throughput_table(offline: dict[str, Any] | None, http: dict[str, Any] | None) -> str:
    lines = [
        "| path | pair | output tokens | valid JSON (C) | constrained tok/s | unconstrained tok/s | ratio C/U "
        "| step ms C / U | sampler ms C / U | mask ms (fill / apply) | accept ms | mask + accept, share of C run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in (("offline", offline), ("HTTP", http)):
        if not result:
            continue
        for i, pair in enumerate(result["pairs"], 1):
            c, u = pair["constrained"], pair["unconstrained"]
            if u is None:
                lines.append(
                    f"| {name} | {i} | {c['output_tokens']} | {c.get('valid_json', 0)}/{len(c['lengths'])} | {c['output_throughput']:.1f} | failed | | | | | | |"
                )
                continue
            ratio = (
                c["output_throughput"] / u["output_throughput"]
                if u["output_throughput"]
                else float("nan")
            )
            row = f"| {name} | {i} | {c['output_tokens']} | {c['valid_json']}/{len(c['lengths'])} | {c['output_throughput']:.1f} | {u['output_throughput']:.1f} | {ratio:.3f} "
            if "step_ms_per_step" in c:
                share = (c["totals_s"]["mask"] + c["totals_s"]["accept"]) / c["duration_s"]
                row += (
                    f"| {c['step_ms_per_step']:.1f} / {u['step_ms_per_step']:.1f} "
                    f"| {c['sampler_ms_per_step']:.2f} / {u['sampler_ms_per_step']:.2f} "
                    f"| {c['mask_ms_per_step']:.2f} ({c['fill_ms_per_step']:.2f} / {c['apply_ms_per_step']:.2f}) "
                    f"| {c['accept_ms_per_step']:.2f} | {100 * share:.1f}% |"
                )
            else:
                row += "| n/a | n/a | n/a | n/a | n/a |"
            lines.append(row)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="write everything as JSON here")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="requests at once = max_num_seqs"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="constrained/unconstrained pairs per path"
    )
    parser.add_argument(
        "--compile-repeats", type=int, default=3, help="fresh compilers per constraint"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=400, help="constrained requests' max_tokens"
    )
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    parser.add_argument(
        "--http-run-timeout", type=float, default=110.0, help="bound on one HTTP run, s"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=100.0, help="bound on one request, s"
    )
    parser.add_argument("--pagedserve-args", default="", help="extra flags for pagedserve serve")
    args = parser.parse_args()

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load_before = load_average()
    conversations = chat_prompts(args.concurrency)
    llm = LLM(max_num_seqs=args.concurrency)
    compile_result = bench_compile(llm, args.compile_repeats)
    print(compile_table(compile_result), flush=True)
    offline = bench_offline(llm, conversations, args)
    llm.close()
    del llm
    http = None
    if not args.skip_http:
        http = bench_http(conversations, args, Path(tempfile.mkdtemp(prefix="structured-bench-")))

    header = (
        f"# {started} | {os.cpu_count()} CPUs ({cpu_model()}) | "
        + " ".join(f"{k} {v}" for k, v in versions().items())
        + f" | load before {load_before}, after {load_average()}"
    )
    print()
    print(header)
    print()
    print(compile_table(compile_result))
    print()
    print(throughput_table(offline, http))
    with open(args.out, "w") as fh:
        json.dump(
            {
                "started": started,
                "argv": sys.argv,
                "args": vars(args),
                "cpu_count": os.cpu_count(),
                "cpu": cpu_model(),
                "versions": versions(),
                "load_before": load_before,
                "load_after": load_average(),
                "schema": SCHEMA,
                "regex": REGEX,
                "choice": CHOICE,
                "conversations": conversations,
                "compile": compile_result,
                "offline": offline,
                "http": http,
            },
            fh,
            indent=1,
        )
    failed = http is not None and (
        "error" in http
        or any(
            p["unconstrained"] is None or p["constrained"]["failed"] or p["unconstrained"]["failed"]
            for p in http["pairs"]
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
