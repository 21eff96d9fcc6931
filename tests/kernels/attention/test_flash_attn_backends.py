"""The flash-attn 2 and 4 backends against the torch reference, through a stand-in for the
flash-attn kernels (tests/support/flash_attn_standin.py: flash-attn needs a CUDA GPU). This checks what
the backends themselves do: which call a step takes, the cache layout, block tables, offsets and
lengths they pass, and the documented argument rules; with a sliding window and a softcap, that
they pass them under the libraries' names and in their conventions (the stand-in masks and caps
as the libraries do). The kernels' numerics are checked only by tests/gpu/test_gpu.py on a GPU with
flash-attn installed."""

from __future__ import annotations

import sys

import pytest

from kernels.attention.selector import build_backend
from tests.support import flash_attn_standin
from tests.support.attention_cases import DECODES, SHAPES, check_against_reference


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stand-in installed; the names of the kernel calls made, in order."""
    flash_attn_standin.install(monkeypatch)
    made: list[str] = []
    for module, name in (
        ("flash_attn", "flash_attn_varlen_func"),
        ("flash_attn", "flash_attn_with_kvcache"),
        ("flash_attn.cute", "flash_attn_varlen_func"),
    ):
        original = getattr(sys.modules[module], name)

        def counted(*args, _original=original, _label=f"{module}.{name}", **kwargs):
            made.append(_label)
            return _original(*args, **kwargs)

        monkeypatch.setattr(sys.modules[module], name, counted)
    return made


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(
    ("shapes", "kernel"),
    [
        (SHAPES, "flash_attn.flash_attn_varlen_func"),
        (DECODES, "flash_attn.flash_attn_with_kvcache"),
    ],
)
def test_flash_attn_2(
    calls: list[str], heads: int, kv_heads: int, dim: int, shapes, kernel: str
) -> None:
    """Blocks of 256: a step with prefill chunks takes the varlen call, an all-decode step the KV-cache call."""
    check_against_reference(lambda: build_backend("flash-attn"), heads, kv_heads, dim, 256, shapes)
    assert calls == [kernel]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("shapes", [SHAPES, DECODES])
def test_flash_attn_4(calls: list[str], heads: int, kv_heads: int, block_size: int, shapes) -> None:
    """One varlen call with a page table and per-request key counts, whatever the step's mix."""
    check_against_reference(
        lambda: build_backend("flash-attn-4"), heads, kv_heads, 128, block_size, shapes
    )
    assert calls == ["flash_attn.cute.flash_attn_varlen_func"]


# (sliding window, softcap): within a block of 256 with a cap that bites, across blocks (DECODES
# has a context of 513), a cap alone, and a window of one key.
WINDOW_SOFTCAP = [(5, 2.0), (300, None), (None, 50.0), (1, None)]


@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
@pytest.mark.parametrize(
    ("shapes", "kernel"),
    [
        (SHAPES, "flash_attn.flash_attn_varlen_func"),
        (DECODES, "flash_attn.flash_attn_with_kvcache"),
    ],
)
def test_flash_attn_2_window_and_softcap(
    calls: list[str], shapes, kernel: str, window: int | None, softcap: float | None
) -> None:
    check_against_reference(
        lambda: build_backend("flash-attn"),
        8,
        2,
        64,
        256,
        shapes,
        sliding_window=window,
        softcap=softcap,
    )
    assert calls == [kernel]


@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
@pytest.mark.parametrize("shapes", [SHAPES, DECODES])
def test_flash_attn_4_window_and_softcap(
    calls: list[str], shapes, window: int | None, softcap: float | None
) -> None:
    check_against_reference(
        lambda: build_backend("flash-attn-4"),
        8,
        2,
        128,
        16,
        shapes,
        sliding_window=window,
        softcap=softcap,
    )
    assert calls == ["flash_attn.cute.flash_attn_varlen_func"]


def test_the_stand_in_enforces_flash_attn_2_block_sizes(calls: list[str]) -> None:
    """A block of 16 tokens breaks flash-attn 2's rule; the stand-in must say so, as the kernel would."""
    with pytest.raises(AssertionError, match="multiple of 256"):
        check_against_reference(lambda: build_backend("flash-attn"), 4, 4, 64, 16, SHAPES)
