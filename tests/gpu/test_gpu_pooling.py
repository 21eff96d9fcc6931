"""Pooling on a CUDA GPU (skipped without one; bench/gpu/gpu_check.sh runs these): a random-weight
BERT equal to transformers in float32 and within cosine 0.999 in bfloat16, and decoder pooling
through the GPU's paged attention backend equal to transformers' hidden states."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import LLM
from tests.support.embedding import build_random_bert, cosines, hf_cls_embed

pytestmark = pytest.mark.gpu

PROMPTS = [[2, *range(5 + i, 5 + i + n), 3] for i, n in enumerate((1, 7, 30, 60, 120, 126))]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_random_bert(tmp_path_factory.mktemp("bert"))


@pytest.mark.parametrize(("dtype", "floor"), [("float32", 0.99999), ("bfloat16", 0.999)])
def test_bert_on_gpu_matches_transformers(bert_dir, dtype: str, floor: float) -> None:
    llm = LLM(model=str(bert_dir), dtype=dtype, device="cuda", max_num_batched_tokens=512)
    got = torch.stack([o.outputs.data for o in llm.embed(PROMPTS)])
    expected = hf_cls_embed(bert_dir, PROMPTS, device="cuda")
    assert cosines(got, expected).min() >= floor
    assert llm.engine.kv.pool.num_free == llm.engine.info.num_kv_blocks


def test_decoder_mean_pooling_on_gpu(llama_dir) -> None:
    from transformers import AutoModel

    llm = LLM(
        model=str(llama_dir), runner="pooling", pooling_type="mean", dtype="float32", device="cuda"
    )
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 300)]
    got = torch.stack([o.outputs.data for o in llm.embed(prompts)])
    hf = AutoModel.from_pretrained(llama_dir, dtype=torch.float32).to("cuda").eval()
    for row, ids in zip(got, prompts):
        with torch.inference_mode():
            hidden = hf(input_ids=torch.tensor([ids], device="cuda")).last_hidden_state[0]
        expected = torch.nn.functional.normalize(hidden.mean(0), dim=0).cpu()
        assert cosines(row, expected) >= 0.9999  # tf32-free float32; the backend's own sums
    assert llm.engine.kv.pool.num_free == llm.engine.info.num_kv_blocks
