"""The client side of test_hub_models.py, run as `python -m tests.support.hub_client STEPS_JSON` in a
process of its own: huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, when it is
imported, so online, offline and no-network each need a fresh process.

Each step is a JSON object; `do` says what to run, the rest are engine settings (flag names).
One line `RESULT {json}` is printed per step: what it returned, or the `ModelLoadError`'s text.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any

from config import ModelConfig
from engine import LLM, ModelLoadError, SamplingParams
from engine.loading.hub import tokenizer_path
from engine.loading.resolve import resolve_model_path

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Text goes through the tokenizer under test; its ids are all below the tiny model's vocab.
PROMPTS: list[str | list[int]] = ["The cat sat on the mat", [11, 12, 13]]
# Small and quick to start: eager mode keeps the CPU weights unpacked.
ENGINE = {
    "num_kv_blocks": 32,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "attention_backend": "torch",
    "enforce_eager": True,
}


def resolve(**settings: Any) -> dict[str, object]:
    return {"path": str(resolve_model_path(ModelConfig(**settings)))}


def tokenizer(**settings: Any) -> dict[str, object]:
    return {"path": str(tokenizer_path(ModelConfig(**settings)))}


def generate(**settings: Any) -> dict[str, object]:
    with LLM(**ENGINE, **settings) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        info = llm.engine.info
        return {
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "texts": [o.outputs[0].text for o in outputs],
            "model": info.model,
            "model_path": info.model_path,
            "vocab": len(llm.tokenizer),
        }


def cli(argv: list[str]) -> dict[str, object]:
    from server import cli as command

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = command.main(argv)
    return {"status": status, "out": out.getvalue()}


STEPS = {"resolve": resolve, "tokenizer": tokenizer, "generate": generate, "cli": cli}


def main() -> None:
    for step in json.loads(sys.argv[1]):
        run = STEPS[step.pop("do")]
        try:
            result = run(**step)
        except ModelLoadError as exc:
            result = {"error": str(exc)}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
