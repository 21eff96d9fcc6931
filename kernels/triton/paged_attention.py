"""Causal attention over the paged KV cache for one varlen step: decode rows, prefill chunks and
chunks that follow a cached prefix, in one kernel.

A program takes BLOCK_M query rows of one request and one query head; it walks the request's
context in tiles of BLOCK_N keys (each key found through the block table: any power-of-two
block size works), with an online softmax, and stops at the last key its rows may see. A
query row at index r of a chunk of q_len rows sits at position context_len - q_len + r.

With a sliding window of W keys (SLIDING) a row at position p sees only p-W+1 .. p, and a program
starts at the tile of keys holding its first row's first visible key: the tiles before it are
never read. With a softcap c (SOFTCAP) scores s become c * tanh(s / c) before the mask. Both
are compile-time flags, so the plain kernel does none of their work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import KernelLaunch


@triton.jit
def _tanh(x):
    """tanh in float32 from exp (libdevice's has no implementation under the interpreter):
    (1 - e) / (1 + e) with e = exp(-2|x|), which cannot overflow; below |x| = 1/4, where 1 - e
    loses digits to cancellation, the Taylor series to x^9 (first omitted term under 3e-9)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    near = a2 * (62.0 / 2835.0) - 17.0 / 315.0
    near = near * a2 + 2.0 / 15.0
    near = near * a2 - 1.0 / 3.0
    near = (near * a2 + 1.0) * a
    t = tl.where(a < 0.25, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seqlens_k_ptr,
    scale,
    window,  # keys a row sees, its own included (read only when SLIDING)
    softcap,  # the cap of the scores (read only when SOFTCAP)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_table,
    QUERIES_PER_KV: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two (80, 96: masked lanes)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" keeps float32 exact; "tf32" for half types (unused by them)
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    if tile * BLOCK_M < q_len:
        ctx_len = tl.load(seqlens_k_ptr + req)
        kv_head = head // QUERIES_PER_KV
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        dim_ok = offs_d < HEAD_DIM
        row_ok = offs_m < q_len
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        q_pos = ctx_len - q_len + offs_m
        if SLIDING:
            # The tile's rows past the chunk (never stored) take its last row's place, so that
            # their windows hold a key and their sums are not 0 / 0.
            q_pos = tl.minimum(q_pos, ctx_len - 1)
        # The last row of this tile sees keys up to its own position.
        hi = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * BLOCK_M)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lo = 0
        if SLIDING:  # the tile's first row sees the earliest keys: start at its window's tile
            lo = tl.maximum(0, ctx_len - q_len + tile * BLOCK_M + 1 - window) // BLOCK_N * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = offs_n < hi
            block = tl.load(
                block_tables_ptr + req * stride_table + offs_n // BLOCK_SIZE, mask=key_ok, other=0
            )
            slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
            kv = slot[:, None] * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
            k = tl.load(k_cache_ptr + kv, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
            v = tl.load(v_cache_ptr + kv, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAP:
                s = softcap * _tanh(s / softcap)
            visible = (offs_n[None, :] <= q_pos[:, None]) & key_ok[None, :]
            if SLIDING:
                visible &= offs_n[None, :] > q_pos[:, None] - window
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
            if SLIDING:
                # A row whose window starts past this tile has seen no key yet (its maximum is
                # -inf): exponents taken from 0 keep its sums at 0 instead of exp(-inf + inf).
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_ref[:, None])
            alpha = tl.exp(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32
    seqlens_k: torch.Tensor,  # [num_reqs] int32
    max_query_len: int,  # from the host, so that launching needs no device sync
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,  # keys a row sees, its own included; None: all
    softcap: float | None = None,  # scores capped to softcap * tanh(s / softcap); None: not
) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0 or seqlens_k.shape[0] == 0:
        return out
    paged_attention_launch(
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        seqlens_k,
        max_query_len,
        scale,
        sliding_window=sliding_window,
        softcap=softcap,
    ).run()
    return out


def paged_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> KernelLaunch:
    """The kernel's launch for these tensors (shapes as `paged_attention`'s): the tiles are
    chosen here, and the GPU compile test reads them from here too."""
    _, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    block_m = 16
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot wants every side >= 16
    block_n = 64 if block_d <= 128 else 32  # keeps a K and a V tile in registers at head_dim 256
    return KernelLaunch(
        kernel=_paged_attention_kernel,
        grid=(triton.cdiv(max_query_len, block_m), heads, seqlens_k.shape[0]),
        args={
            "q_ptr": q,
            "k_cache_ptr": k_cache,
            "v_cache_ptr": v_cache,
            "out_ptr": out,
            "block_tables_ptr": block_tables,
            "cu_seqlens_q_ptr": cu_seqlens_q,
            "seqlens_k_ptr": seqlens_k,
            "scale": scale,
            "window": 0 if sliding_window is None else sliding_window,
            "softcap": 0.0 if softcap is None else float(softcap),
            "stride_q_tok": q.stride(0),
            "stride_q_head": q.stride(1),
            "stride_o_tok": out.stride(0),
            "stride_o_head": out.stride(1),
            "stride_table": block_tables.stride(0),
        },
        constexprs={
            "QUERIES_PER_KV": heads // kv_heads,
            "KV_HEADS": kv_heads,
            "HEAD_DIM": dim,
            "BLOCK_D": block_d,
            "BLOCK_SIZE": block_size,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "SLIDING": sliding_window is not None,
            "SOFTCAP": softcap is not None,
            "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        },
    )
