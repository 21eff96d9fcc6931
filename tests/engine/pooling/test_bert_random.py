"""A random-weight BertModel of another shape (3 layers, tanh-GELU, its own vocabulary) with no
sentence-transformers files: served by the default runner (auto: an encoder pools), [CLS]
pooling and normalization by default, equal to transformers in float32."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from tests.support.embedding import build_random_bert, cosines, hf_cls_embed


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_random_bert(tmp_path_factory.mktemp("bert"))


def test_random_bert_cls_pooling_matches_transformers(bert_dir) -> None:
    llm = LLM(model=str(bert_dir), dtype="float32", max_num_batched_tokens=256)
    assert llm.engine.info.runner == "pooling"
    prompts = [[2, *range(5 + i, 5 + i + n), 3] for i, n in enumerate((1, 7, 30, 60, 120, 126))]
    got = torch.stack([o.outputs.data for o in llm.embed(prompts)])
    assert got.shape == (6, 64)
    assert cosines(got, hf_cls_embed(bert_dir, prompts)).min() >= 0.99999
    assert llm.engine.kv.pool.num_free == llm.engine.info.num_kv_blocks
