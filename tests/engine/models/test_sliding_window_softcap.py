"""Sliding windows and softcaps (kernels/attention/backend.py): the torch reference, which
every backend is checked against, against the naive statement of both in tests/support/attention_cases.py;
proof that those checks catch a window one key too wide or narrow and a cap left off; and the
torch and CPU backends running windowed and global layers on one step's metadata.

The CPU kernel, Triton and flash-attn cases are in their own test files."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention.backend import AttentionMetadata, check_window_and_softcap
from kernels.attention.cpu_backend import CpuPagedBackend
from kernels.attention.torch_ref import TorchReferenceBackend
from tests.support.attention_cases import (
    SHAPES,
    SOFTCAPS,
    WINDOWS,
    check_against_reference,
    check_layers_of_one_step,
    naive_attention,
    random_step,
)

# Decodes past several blocks, a long chunk after cached context and a fresh one: a window cuts
# into each in a different place.
LONGER = [(700, 1), (3, 1), (520, 130), (129, 129)]


def _step(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.float32):
    gen, rng = torch.Generator().manual_seed(11), random.Random(11)
    q, k, v, caches, meta = random_step(gen, rng, shapes, 16, 8, 2, 64)
    return q.to(dtype), k.to(dtype), v.to(dtype), caches.to(dtype), meta


def _reference(step, window: int | None, softcap: float | None) -> torch.Tensor:
    q, k, v, caches, meta = step
    meta.backend_plan = None
    caches = caches.clone()
    return TorchReferenceBackend().forward(
        q, k, v, caches[0], caches[1], meta, 0.125, sliding_window=window, softcap=softcap
    )


@pytest.mark.parametrize("shapes", [SHAPES, LONGER], ids=["mixed", "longer"])
@pytest.mark.parametrize("softcap", [None, *SOFTCAPS])
@pytest.mark.parametrize("window", [None, *WINDOWS])
def test_reference_equals_the_naive_attention(
    window: int | None, softcap: float | None, shapes: list[tuple[int, int]]
) -> None:
    step = _step(shapes)
    q, k, v, caches, meta = step
    want = naive_attention(q, k, v, caches[0], caches[1], meta, 0.125, window, softcap)
    torch.testing.assert_close(_reference(step, window, softcap), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 40])
def test_reference_in_bfloat16_stays_near_the_naive_attention(window: int) -> None:
    """The reference's masks and explicit softcap path with half-precision inputs."""
    step = _step(SHAPES + LONGER, torch.bfloat16)
    q, k, v, caches, meta = step
    for softcap in (None, 2.0):
        want = naive_attention(q, k, v, caches[0], caches[1], meta, 0.125, window, softcap)
        torch.testing.assert_close(_reference(step, window, softcap), want, atol=2e-2, rtol=1.6e-2)


class _Misapplied:
    """The torch reference with its options misapplied by `window_shift` keys or with the cap
    left off: a stand-in for a backend with such a bug."""

    name = "misapplied"
    graph_safe = False

    def __init__(self, window_shift: int, drop_softcap: bool) -> None:
        self.window_shift, self.drop_softcap = window_shift, drop_softcap

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
        if sliding_window is not None:
            sliding_window += self.window_shift
        return TorchReferenceBackend().forward(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta,
            scale,
            sliding_window=sliding_window,
            softcap=None if self.drop_softcap else softcap,
            kv_stored=kv_stored,
        )


@pytest.mark.parametrize(
    ("window", "shift"), [(w, s) for w in WINDOWS if w < 300 for s in (-1, 1) if w + s > 0]
)
def test_a_window_off_by_one_is_caught(window: int, shift: int) -> None:
    """W - 1 or W + 1 keys instead of W fail the check every backend's window tests use, on the
    shapes they use (a window past every context cannot be told from a wider one)."""
    with pytest.raises(AssertionError):
        check_against_reference(
            lambda: _Misapplied(shift, False), 8, 2, 64, 16, sliding_window=window
        )


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_a_softcap_left_off_is_caught(softcap: float) -> None:
    with pytest.raises(AssertionError):
        check_against_reference(lambda: _Misapplied(0, True), 8, 2, 64, 16, softcap=softcap)


def test_the_misapplied_backend_passes_when_nothing_is_misapplied() -> None:
    """The two tests above fail for the bug, not for the wrapper."""
    check_against_reference(
        lambda: _Misapplied(0, False), 8, 2, 64, 16, sliding_window=5, softcap=2.0
    )


@pytest.mark.parametrize("make_backend", [TorchReferenceBackend, CpuPagedBackend])
def test_windowed_and_global_layers_of_one_step(make_backend) -> None:
    """Plans kept on the metadata for one window are never used by a layer with another: LONGER
    has chunks past the CPU kernel's query limit, which the CPU backend plans for SDPA."""
    check_layers_of_one_step(make_backend)
    check_layers_of_one_step(make_backend, shapes=SHAPES + LONGER)


@pytest.mark.parametrize(("window", "softcap"), [(0, None), (-3, None), (None, 0.0), (None, -1.0)])
def test_meaningless_options_are_refused(window: int | None, softcap: float | None) -> None:
    with pytest.raises(ValueError):
        check_window_and_softcap(window, softcap)
