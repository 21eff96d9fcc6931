"""Gemma 3's image tokens attend to each other both ways: a soft token sees every soft token of
its own image, the later ones included, on top of the causal (and, in the local layers, the
sliding-window) mask, as transformers ORs its blockwise mask into the causal one and then
applies the window to both.

The engine computes an image's span in one chunk (`whole_spans`), so every image row of a step
has all of its image's keys in the cache once the layer's backend has stored the step's K/V.
`ImagesBothWays` wraps the step's backend: after the ordinary causal attention it recomputes
the rows of each image with that mask, over its sequence's cached keys up to the image's end,
and writes them over the causal ones. Text rows are left as the backend computed them.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.attention.torch_ref import attention_with_softcap, context_slots


class ImagesBothWays:
    """An attention backend: `inner`'s output, with the rows of `spans` ((first row, end row,
    sequence index in the step) of each image) attending both ways within their image."""

    graph_safe = False  # reads the step's host context lengths

    def __init__(self, inner: AttentionBackend, spans: list[tuple[int, int, int]]) -> None:
        self.inner = inner
        self.name = inner.name
        self.spans = spans

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        out = self.inner.forward(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            kv_stored=kv_stored,
        )
        starts = list(itertools.accumulate(meta.query_lens, initial=0))
        for first, end, seq in self.spans:
            # The image's first position in its sequence: its rows are the chunk's last ones
            # counted back from the sequence's context length.
            position = meta.context_lens[seq] - meta.query_lens[seq] + first - starts[seq]
            out[first:end] = _image_rows(
                q[first:end],
                k_cache,
                v_cache,
                meta.block_tables[seq],
                position,
                scale,
                sliding_window,
                softcap,
            )
        return out


def _image_rows(
    q: torch.Tensor,  # [n, heads, dim]: one image's rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    position: int,  # the image's first position
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [n, heads, dim]
    _, block_size, kv_heads, dim = k_cache.shape
    end = position + q.shape[0]
    first_key = 0 if window is None else max(0, position - window + 1)
    slots = context_slots(block_table, end, block_size, first_key)
    keys = k_cache.view(-1, kv_heads, dim).index_select(0, slots).to(q.dtype).transpose(0, 1)
    values = v_cache.view(-1, kv_heads, dim).index_select(0, slots).to(q.dtype).transpose(0, 1)
    rows = torch.arange(position, end, device=q.device).unsqueeze(1)
    key_positions = torch.arange(first_key, end, device=q.device).unsqueeze(0)
    # Causal, or any key of the image (every key from `position` on is one).
    visible = (key_positions <= rows) | (key_positions >= position)
    if window is not None:
        visible &= key_positions > rows - window
    # [1, heads, n, dim]: SDPA's CPU kernels run the 4-D layout faster than the 3-D one.
    query, keys, values = (t.unsqueeze(0) for t in (q.transpose(0, 1), keys, values))
    if softcap is None:
        # An additive mask: SDPA's CPU kernel runs it several times faster than a boolean one.
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(~visible, float("-inf"))
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=bias, scale=scale, enable_gqa=True
        )
    else:
        attn = attention_with_softcap(query, keys, values, visible, scale, softcap)
    return attn[0].transpose(0, 1)
