"""Write new tokens' K and V into the paged cache (the "reshape and cache" step)."""

from __future__ import annotations

import torch


def stored_rows(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the rows whose K/V are stored, or None for all of them; their slots): slots < 0 mark
    padding, which stores nothing."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return None, slot_mapping
    return valid.nonzero().squeeze(1), slot_mapping[valid]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; slots < 0 mark padding and are skipped."""
    num_blocks, block_size, heads, dim = k_cache.shape
    rows, slot_mapping = stored_rows(slot_mapping)
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    k_cache.view(num_blocks * block_size, heads, dim).index_copy_(
        0, slot_mapping, k.to(k_cache.dtype)
    )
    v_cache.view(num_blocks * block_size, heads, dim).index_copy_(
        0, slot_mapping, v.to(v_cache.dtype)
    )


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write of a shared partial block)."""
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], device=k_caches[0].device)
    dst = torch.tensor([p[1] for p in pairs], device=k_caches[0].device)
    for cache in (*k_caches, *v_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))
