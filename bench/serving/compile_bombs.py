"""Grammar compile bombs against a `pagedserve serve` it starts: the server's RSS before and
after, each answer's status and time, and how long SIGTERM takes afterwards.

    python bench/serving/compile_bombs.py [--rounds 3] [--settle 30] [--out bench/out/compile_bombs.json]

Two kinds of bomb, each sent `--rounds` times with fresh names (so no round hits the compiled-
grammar cache): past the size limits (arrays nested 900 deep, an EBNF grammar of 20,001 rules,
5,000 optional properties: each a 400 before any compile), and as large as the limits allow
(1,000 optional properties, 2,000 EBNF rules, arrays nested 64 deep: compiled, or abandoned
at --grammar-compile-timeout, and then kept in the cache, which --grammar-cache-mib bounds).
RSS is read from /proc after a structured warm-up request, after each round, and after
`--settle` idle seconds (an abandoned compile finishes in the background).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import MODEL, rss_mb, start_server


def nested_arrays(depth: int) -> dict[str, Any]:
    """`depth` levels, the innermost an integer."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def optional_properties(count: int, tag: str) -> dict[str, Any]:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(count)}}


def ebnf_rules(count: int, tag: str) -> str:
    """`count` rules, root included: a chain, each rule a word or the next rule."""
    rules = [f'{tag}{i} ::= "{tag}{i}" | {tag}{i + 1}' for i in range(count - 2)]
    return "\n".join([f"root ::= {tag}0", *rules, f'{tag}{count - 2} ::= "end"'])


def bombs(tag: str) -> dict[str, dict[str, Any]]:
    def schema(s: dict[str, Any]) -> dict[str, Any]:
        return {
            "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": s}}
        }

    def grammar(g: str) -> dict[str, Any]:
        return {"structured_outputs": {"grammar": g}}

    return {
        "past: arrays 900 deep": schema(nested_arrays(900)),
        "past: 20,001 EBNF rules": grammar(ebnf_rules(20_001, tag)),
        "past: 5,000 properties": schema(optional_properties(5_000, tag)),
        "at: 1,000 properties": schema(optional_properties(1_000, tag)),
        "at: 2,000 EBNF rules": grammar(ebnf_rules(2_000, tag)),
        "at: arrays 64 deep": schema(nested_arrays(64)),
    }


def ask(base_url: str, extra: dict[str, Any]) -> tuple[int, float, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    started = time.perf_counter()
    r = httpx.post(base_url + "/v1/chat/completions", json={**body, **extra}, timeout=120)
    message = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
    return r.status_code, round(time.perf_counter() - started, 2), message[:120]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=8319)
    parser.add_argument("--out", type=Path, default=Path("bench/out/compile_bombs.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bombs-") as cache:
        server, base_url = start_server(args.port, cache)
        report: dict[str, Any] = {"rounds": []}
        try:
            warm = {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "w",
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                    },
                }
            }
            assert ask(base_url, warm)[0] == 200
            report["rss_before_mb"] = rss_mb(server.pid)
            for r in range(args.rounds):
                sent = bombs(f"r{r}x")
                with ThreadPoolExecutor(len(sent)) as pool:
                    answers = dict(
                        zip(sent, pool.map(lambda extra: ask(base_url, extra), sent.values()))
                    )
                report["rounds"].append({"answers": answers, "rss_mb": rss_mb(server.pid)})
                print(f"round {r}: RSS {report['rounds'][-1]['rss_mb']:.0f} MB", flush=True)
            time.sleep(args.settle)
            report["rss_settled_mb"] = rss_mb(server.pid)
            report["plain_after"] = ask(base_url, {})[0]
        finally:
            started = time.perf_counter()
            server.send_signal(signal.SIGTERM)
            report["exit_status"] = server.wait(120)
            report["sigterm_to_exit_s"] = round(time.perf_counter() - started, 2)
    report["rss_growth_mb"] = round(report["rss_settled_mb"] - report["rss_before_mb"], 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
