"""The `pagedserve` command line: `serve` (the OpenAI-compatible HTTP server), `generate`
(offline, from prompts on the command line) and `bench serve` / `bench throughput`. Settings come from flags, `PAGEDSERVE_*`
environment variables and a YAML `--config` file, merged in `config.sources`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from config import ConfigError
from config.engine_config import ENGINE_SECTIONS
from config.sources import SERVE_SECTIONS, add_flags, merge, serve_config
from engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from server.bench.commands import add_bench_parser, run_bench
from server.bench.datasets import DatasetError

MODEL_HELP = (
    "local Hugging Face model folder, or a Hub repo id org/name (default: the bundled "
    "SmolLM2-135M-Instruct)"
)
CONFIG_HELP = (
    "YAML file of settings keyed by flag name; flags and PAGEDSERVE_* variables override it"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    precedence = "Settings: flag > PAGEDSERVE_* environment variable > --config file > default."
    for name, what, sections in (
        ("serve", "run the OpenAI-compatible HTTP server", SERVE_SECTIONS),
        ("generate", "generate offline from prompts given on the command line", ENGINE_SECTIONS),
    ):
        command = sub.add_parser(
            name, help=what, description=f"{what[0].upper()}{what[1:]}. {precedence}"
        )
        command.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=MODEL_HELP)
        command.add_argument("--config", type=Path, default=None, help=CONFIG_HELP)
        add_flags(command, sections, skip=("model",))
    gen = sub.choices["generate"]
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument(
        "--chat",
        action="append",
        default=[],
        help="a user message, rendered with the chat template (repeatable)",
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    add_bench_parser(sub)
    return parser


def _generate(args: dict[str, Any], parser: argparse.ArgumentParser) -> None:
    prompts_given: list[str] = args.pop("prompt")
    chats: list[str] = args.pop("chat")
    params = SamplingParams(max_tokens=args.pop("max_tokens"), temperature=args.pop("temperature"))
    if not prompts_given and not chats:
        parser.error("give at least one --prompt or --chat")
    config_file = args.pop("config")
    with LLM(**merge(args, os.environ, config_file, ENGINE_SECTIONS)) as llm:
        prompts: list[str | list[int]] = list(prompts_given)
        prompts += [llm.render_chat([{"role": "user", "content": c}]) for c in chats]
        for output in llm.generate(prompts, params):
            shown = (
                output.prompt
                if output.prompt is not None
                else llm.tokenizer.decode(output.prompt_token_ids)
            )
            print(
                f"--- prompt: {shown!r}\n{output.outputs[0].text}\n[finish_reason={output.outputs[0].finish_reason}]"
            )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    args = vars(namespace)
    command = args.pop("command")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if command == "bench":
            return run_bench(namespace)
        if command == "serve":
            from server.launch import serve  # the HTTP stack is only imported when it is used

            config_file = args.pop("config")
            return serve(serve_config(args, os.environ, config_file))
        else:
            _generate(args, parser)
    except (ConfigError, ModelLoadError, InvalidRequestError, DatasetError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
