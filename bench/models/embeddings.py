"""Embeddings per second: pagedserve's `LLM.embed` (pooling mode) against sentence-transformers'
`encode` (or, where it is not installed, transformers' BertModel with the checkpoint's pooling),
on the bundled all-MiniLM-L6-v2, inputs of exactly `--input-len` tokens, batches of 1, 16 and 64,
in one process on the same cores. Each side embeds the same texts (tokenizing included); the
sides alternate call by call and each side's median call gives its rate, after one warm-up call.

    python bench/models/embeddings.py [--input-len 64] [--batches 1,16,64] [--calls 12]
        [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM
from engine.loading.default_model import default_embedding_model_dir


def make_texts(tokenizer, count: int, length: int) -> list[str]:
    """`count` different texts that each tokenize to exactly `length` tokens ([CLS], [SEP] in)."""
    words = [
        "retrieval",
        "augmented",
        "generation",
        "embeds",
        "every",
        "document",
        "once",
        "and",
        "each",
        "query",
        "as",
        "it",
        "comes",
        "then",
        "ranks",
        "the",
        "documents",
        "by",
        "the",
        "cosine",
        "of",
        "their",
        "vectors",
        "before",
        "a",
        "model",
        "reads",
        "the",
        "best",
    ]
    texts = []
    for i in range(count):
        body = [f"doc{i}"] + [words[(i + j) % len(words)] for j in range(length)]
        while True:
            text = " ".join(body)
            n = len(tokenizer(text).input_ids)
            if n == length:
                break
            body.pop() if n > length else body.append("word")
        texts.append(text)
    return texts


def median_rates(
    sides: list[Callable[[list[str]], object]], texts: list[str], calls: int
) -> list[float]:
    """Each side's rate (embeddings/s) from its median call; the sides take turns call by call,
    so that a change in the machine's load falls on both alike."""
    for run in sides:
        run(texts)  # warm-up: first-call allocations, thread pools
    times: list[list[float]] = [[] for _ in sides]
    for _ in range(calls):
        for i, run in enumerate(sides):
            started = time.perf_counter()
            run(texts)
            times[i].append(time.perf_counter() - started)
    return [len(texts) / statistics.median(t) for t in times]


def reference(path: str) -> tuple[str, Callable[[list[str]], object]]:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

        @torch.inference_mode()
        def encode(texts: list[str]) -> torch.Tensor:
            batch = tokenizer(texts, padding=True, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

        return "transformers BertModel + mean pooling", encode
    st = SentenceTransformer(path, device="cpu")
    return "sentence-transformers encode", lambda texts: st.encode(texts, batch_size=len(texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--calls", type=int, default=12, help="timed calls per side and batch")
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="pagedserve's dtypes (the reference: float32)"
    )
    args = parser.parse_args()
    path = str(default_embedding_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = [int(b) for b in args.batches.split(",")]
    texts = make_texts(tokenizer, max(batches), args.input_len)
    engines = {
        dtype: LLM(runner="pooling", dtype=dtype, max_num_seqs=max(batches))
        for dtype in args.dtypes.split(",")
    }
    name, encode = reference(path)
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; all-MiniLM-L6-v2, {args.input_len}-token inputs; "
        f"reference: {name}, float32"
    )
    header = "".join(f"{'pagedserve ' + d:>22}" for d in engines)
    print(f"{'batch':>5}{header}{'reference':>12}  (embeddings/s; ratio to the reference)")
    for batch in batches:
        chunk = texts[:batch]
        rates = median_rates([llm.embed for llm in engines.values()] + [encode], chunk, args.calls)
        ours, theirs = rates[:-1], rates[-1]
        cells = "".join(f"{r:>15.1f} ({r / theirs:.2f})" for r in ours)
        print(f"{batch:>5}{cells}{theirs:>12.1f}")


if __name__ == "__main__":
    main()
