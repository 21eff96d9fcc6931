"""The `pagedserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from config import ConfigError
from engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="local Hugging Face model folder (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: from --kv-cache-memory-gib)")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="KV pool budget when --num-kv-blocks is unset")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse KV blocks of shared prefixes")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--model-cache-dir", default=None, help="where converted models live (env PAGEDSERVE_CACHE_DIR)")
    parser.add_argument("--seed", type=int, default=0)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    names = ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
             "kv_cache_memory_gib", "enable_prefix_caching", "dtype", "device", "attention_backend", "seed"]
    kwargs: dict[str, object] = {name: getattr(args, name) for name in names}
    if args.model_cache_dir:
        kwargs["model_cache_dir"] = args.model_cache_dir
    return kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline from prompts given on the command line")
    _engine_flags(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--chat", action="append", default=[], help="a user message, rendered with the chat template (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    if not args.prompt and not args.chat:
        parser.error("give at least one --prompt or --chat")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        llm = LLM(args.model, **_engine_kwargs(args))
        prompts: list[str | list[int]] = list(args.prompt)
        prompts += [llm.render_chat([{"role": "user", "content": c}]) for c in args.chat]
        for output in llm.generate(prompts, params):
            shown = output.prompt if output.prompt is not None else llm.tokenizer.decode(output.prompt_token_ids)
            print(f"--- prompt: {shown!r}\n{output.outputs[0].text}\n[finish_reason={output.outputs[0].finish_reason}]")
    except (ConfigError, ModelLoadError, InvalidRequestError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
