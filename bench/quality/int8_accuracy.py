"""How far int8 activations (--quantize-activations int8) move the default model from the same
weights' exact path, scored teacher-forced: every position of fixed sequences, not only the
greedy tokens before the first difference (tests/engine/test_int8_activations.py), so that one
early parting does not hide or decide the result.

    python bench/quality/int8_accuracy.py [--formats int8,gguf] [--tokens 48]

Per format (int8: --quantization int8, one scale per row; gguf: the model's own Q4_1 file with
its Q8_0 head), in bfloat16: the exact path generates --tokens greedy tokens after each of 8
prompts (the test's four and four of random ids); both paths then score those whole sequences
(prompt_logprobs). Reported over all positions: the mean, 95th percentile and largest
difference of the sequence token's logprob, and how often both paths rank the same token first.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams
from engine.outputs import PositionLogprobs
from tests.engine.test_int8_activations import PROMPTS


def _engine(quantization: str, activations: str | None) -> LLM:
    return LLM(
        None,
        dtype="bfloat16",
        quantization=quantization,
        quantize_activations=activations,
        num_kv_blocks=128,
        max_model_len=256,
    )


def _scores(llm: LLM, seqs: list[list[int]]) -> list[list[PositionLogprobs]]:
    """Each sequence's logprobs from its second token on (the token's own and the top one)."""
    outs = llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=1))
    return [[lp for lp in o.prompt_logprobs or [] if lp is not None] for o in outs]


def measure(quantization: str, tokens: int) -> dict[str, float]:
    rng = random.Random(0)
    prompts = PROMPTS + [[rng.randrange(200, 40000) for _ in range(24)] for _ in range(4)]
    with _engine(quantization, None) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate(prompts, greedy)
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        exact = _scores(llm, seqs)
    with _engine(quantization, "int8") as llm:
        int8 = _scores(llm, seqs)
    diffs, same_top = [], 0
    for seq, want, got in zip(seqs, exact, int8):
        assert len(want) == len(got) == len(seq) - 1
        for token, a, b in zip(seq[1:], want, got):
            diffs.append(abs(a[token] - b[token]))
            same_top += max(a, key=a.__getitem__) == max(b, key=b.__getitem__)
    diffs.sort()
    return {
        "positions": len(diffs),
        "mean": statistics.mean(diffs),
        "p95": diffs[int(0.95 * len(diffs))],
        "max": diffs[-1],
        "same_top": same_top / len(diffs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--formats", default="int8,gguf")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    print("format  positions  mean |dlogprob|  p95  max  same top token")
    for fmt in args.formats.split(","):
        r = measure(fmt, args.tokens)
        print(
            f"{fmt:6}  {r['positions']:9.0f}  {r['mean']:15.4f}  {r['p95']:.3f}  "
            f"{r['max']:.3f}  {r['same_top']:.2%}"
        )


if __name__ == "__main__":
    main()
