"""On a CUDA GPU (skipped without one; bench/gpu/gpu_check.sh runs it): a vision-language model's
greedy tokens equal transformers' on the same device (float32, Triton attention), with images
in chunks that cut their spans, a pool that preempts, and a repeated image served from the
encoder cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import LLM, SamplingParams
from tests.support.vision_models import build_llava, hf_vlm_greedy, sample_image

pytestmark = pytest.mark.gpu

TURN = "<|user|>\n{}\n<|assistant|>\n"
CASES = [
    (TURN.format("what <image> is this"), [sample_image(1)]),
    (TURN.format("compare <image> with <image>"), [sample_image(2), sample_image(3, (30, 64))]),
    (TURN.format("and <image>"), [sample_image(1)]),
]


def test_llava_greedy_tokens_equal_transformers_on_cuda(tmp_path: Path) -> None:
    folder = build_llava(tmp_path)
    llm = LLM(
        str(folder),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=6,
        block_size=16,
        num_kv_blocks=8,
        max_model_len=128,
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in CASES],
        params,
    )
    stats = llm.last_run_stats
    llm.close()
    for (text, images), out in zip(CASES, outs, strict=True):
        assert out.outputs[0].token_ids == hf_vlm_greedy(folder, text, images, 12, "cuda")
    assert stats.mm_images_encoded == 3 and stats.mm_cache_hits >= 1  # image 1 twice
