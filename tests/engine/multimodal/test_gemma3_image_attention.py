"""Gemma 3's both-ways image rows against attention over the whole sequence at once with
transformers' mask (causal or same image, then the window), scores capped or not, for an
image in the middle of a chunk that follows cached context, beside another request's decode."""

from __future__ import annotations

import pytest
import torch

from engine.models.gemma3_image_attention import ImagesBothWays
from kernels.attention import AttentionMetadata
from kernels.attention.torch_ref import TorchReferenceBackend

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
SCALE = DIM**-0.5
CACHED, LENGTH = 4, 14  # the chunk computes positions 4..13 of a 14-token sequence
IMAGE = range(6, 11)  # its image's soft tokens


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    softcap: float | None,
    image: range = IMAGE,
) -> torch.Tensor:
    """Every row of one sequence over all its keys, [n, heads, dim]."""
    pos = torch.arange(q.shape[0])
    p, j = pos.unsqueeze(1), pos.unsqueeze(0)
    in_image = torch.tensor([i in image for i in range(q.shape[0])])
    visible = (j <= p) | (in_image.unsqueeze(1) & in_image.unsqueeze(0))
    if window is not None:
        visible &= j > p - window
    group = HEADS // KV_HEADS
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_image_rows_equal_attention_with_the_image_mask(
    window: int | None, softcap: float | None
) -> None:
    torch.manual_seed(0)
    q = torch.randn(LENGTH, HEADS, DIM)
    k, v = torch.randn(LENGTH, KV_HEADS, DIM), torch.randn(LENGTH, KV_HEADS, DIM)
    # Another request decodes its 6th token in the same step, first in the batch.
    dq, dk, dv = (
        torch.randn(1, HEADS, DIM),
        torch.randn(6, KV_HEADS, DIM),
        torch.randn(6, KV_HEADS, DIM),
    )
    k_cache = torch.zeros(8, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[6, 7, 0, 0], [2, 5, 1, 3]], dtype=torch.int32)

    def slots(seq: int, positions: range) -> torch.Tensor:
        return torch.tensor([int(tables[seq, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])

    # What earlier steps stored: the decode's first 5 tokens, the chunk's cached context.
    k_cache.view(-1, KV_HEADS, DIM)[slots(0, range(5))] = dk[:5]
    v_cache.view(-1, KV_HEADS, DIM)[slots(0, range(5))] = dv[:5]
    k_cache.view(-1, KV_HEADS, DIM)[slots(1, range(CACHED))] = k[:CACHED]
    v_cache.view(-1, KV_HEADS, DIM)[slots(1, range(CACHED))] = v[:CACHED]
    chunk = range(CACHED, LENGTH)
    meta = AttentionMetadata(
        slot_mapping=torch.cat([slots(0, range(5, 6)), slots(1, chunk)]),
        block_tables=tables,
        cu_seqlens_q=torch.tensor([0, 1, 1 + len(chunk)], dtype=torch.int32),
        seqlens_k=torch.tensor([6, LENGTH], dtype=torch.int32),
        query_lens=[1, len(chunk)],
        context_lens=[6, LENGTH],
    )
    first_row = 1 + IMAGE.start - CACHED
    backend = ImagesBothWays(TorchReferenceBackend(), [(first_row, first_row + len(IMAGE), 1)])
    out = backend.forward(
        torch.cat([dq, q[CACHED:]]),
        torch.cat([dk[5:], k[CACHED:]]),
        torch.cat([dv[5:], v[CACHED:]]),
        k_cache,
        v_cache,
        meta,
        SCALE,
        sliding_window=window,
        softcap=softcap,
    )
    want = _dense(q, k, v, window, softcap)[CACHED:]
    torch.testing.assert_close(out[1:], want, rtol=1e-5, atol=1e-5)
    # The decode row is the backend's own causal one.
    causal = TorchReferenceBackend().forward(
        dq,
        dk[5:],
        dv[5:],
        k_cache,
        v_cache,
        _only_decode(meta),
        SCALE,
        sliding_window=window,
        softcap=softcap,
    )
    torch.testing.assert_close(out[:1], causal, rtol=1e-5, atol=1e-5)
    # The image rows differ from causal ones: the mask is not causal after all.
    assert not torch.allclose(
        out[first_row], _dense(q, k, v, window, softcap, range(0))[IMAGE.start]
    )


def _only_decode(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[:1],
        block_tables=meta.block_tables[:1],
        cu_seqlens_q=meta.cu_seqlens_q[:2],
        seqlens_k=meta.seqlens_k[:1],
        query_lens=meta.query_lens[:1],
        context_lens=meta.context_lens[:1],
    )
