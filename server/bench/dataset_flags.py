"""The dataset flags that `bench serve` and `bench throughput` share (vLLM's names), their
checks, and the conversations they describe."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from server.bench.datasets import (
    DATASETS,
    Conversation,
    custom_dataset,
    multi_turn_dataset,
    random_dataset,
)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def range_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value:g}")
    return value


def burstiness(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def request_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected requests per second or inf, got {text!r}"
        ) from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (inf: all at once), got {text}")
    return value


def add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random: random token ids of --random-input-len; custom: a JSONL file of "
        '{"prompt": ...} lines (--dataset-path); multi-turn: conversations that re-send their '
        "history every turn (the --multi-turn-* flags) [default: random]",
    )
    group.add_argument("--dataset-path", type=Path, default=None, help="the file of `custom`")
    group.add_argument(
        "--num-prompts",
        type=positive_int,
        default=1000,
        help="requests to send (not multi-turn) [default: 1000]",
    )
    group.add_argument(
        "--random-input-len",
        type=positive_int,
        default=1024,
        help="prompt tokens of a random request, a multi-turn question's [default: 1024]",
    )
    group.add_argument(
        "--random-output-len",
        type=positive_int,
        default=128,
        help="max_tokens of a random or multi-turn request [default: 128]",
    )
    group.add_argument(
        "--random-range-ratio",
        type=range_ratio,
        default=0.0,
        help="lengths drawn uniformly from len * [1 - r, 1 + r], 0 <= r < 1 [default: 0]",
    )
    group.add_argument(
        "--custom-output-len",
        type=positive_int,
        default=256,
        help="max_tokens of each `custom` request [default: 256]",
    )
    group.add_argument(
        "--multi-turn-num-conversations",
        type=positive_int,
        default=8,
        help="conversations, each sent one turn at a time [default: 8]",
    )
    group.add_argument(
        "--multi-turn-num-turns",
        type=positive_int,
        default=4,
        help="questions in each conversation [default: 4]",
    )
    group.add_argument(
        "--multi-turn-document-len",
        type=non_negative_int,
        default=0,
        help="tokens of the document before a conversation's first question, re-sent with "
        "every turn [default: 0]",
    )
    group.add_argument(
        "--multi-turn-same-document",
        action="store_true",
        help="every conversation opens with the same document (a prefix they all share)",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seeds the prompts and the arrivals [default: 0]"
    )


def check_dataset_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.dataset_name == "custom" and args.dataset_path is None:
        parser.error("--dataset-name custom needs --dataset-path FILE.jsonl")
    if args.dataset_name != "custom" and args.dataset_path is not None:
        parser.error(
            f"--dataset-path is read only with --dataset-name custom, not {args.dataset_name}"
        )


def build_dataset(args: argparse.Namespace, tokenizer: Any, as_text: bool) -> list[Conversation]:
    """`tokenizer`: the model's (random and multi-turn prompts are its token ids); `as_text`:
    random prompts decoded, for an endpoint that takes text only."""
    if args.dataset_name == "custom":
        return custom_dataset(args.dataset_path, args.num_prompts, args.custom_output_len)
    if args.dataset_name == "multi-turn":
        return multi_turn_dataset(
            tokenizer,
            args.multi_turn_num_conversations,
            args.multi_turn_num_turns,
            args.multi_turn_document_len,
            args.multi_turn_same_document,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    return random_dataset(
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.seed,
        as_text,
    )


def dataset_config(args: argparse.Namespace) -> dict[str, Any]:
    """The dataset flags as the result file records them."""
    names = ["dataset_name", "seed"]
    if args.dataset_name == "custom":
        names += ["dataset_path", "num_prompts", "custom_output_len"]
    else:
        names += ["random_input_len", "random_output_len", "random_range_ratio"]
        if args.dataset_name == "random":
            names.append("num_prompts")
        else:
            names += [n for n in vars(args) if n.startswith("multi_turn_")]
    return {n: str(v) if isinstance(v, Path) else v for n, v in vars(args).items() if n in names}
