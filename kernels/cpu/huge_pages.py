"""CPU tensors backed by 2 MiB pages (Linux transparent huge pages), for the KV pool.

A decode step reads every running sequence's keys and values, scattered over the pool by the
block table: hundreds of megabytes a step at a thousand tokens of context, in blocks of a few
KiB. With 4 KiB pages nearly every block costs a TLB miss, and the hardware prefetcher stops at
each 4 KiB boundary. Asking the kernel for huge pages (`madvise(MADV_HUGEPAGE)` on a fresh
anonymous mapping, before its first touch) took the default model's decode attention from 36
to 31 ms a step at 1,088 tokens of context, 16 sequences (2 cores; measured 2026-11-24, round E in
the git history of bench/README.md).

The memory is an anonymous `mmap` owned by the tensor (freed with it). Where the kernel's
transparent huge pages are off ("never"), or there is no `madvise`, the tensor is the same,
on ordinary pages.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> str:
    """The kernel's THP mode: "always", "madvise" or "never"; "unavailable" where there is no
    such setting (not Linux, or a kernel built without THP)."""
    try:
        text = THP_MODE_FILE.read_text()
    except OSError:
        return "unavailable"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor of `numel` elements that starts on a 2 MiB boundary of a mapping
    the kernel was asked to back with huge pages (zeroing it then faults them in)."""
    nbytes = numel * dtype.itemsize
    # A spare huge page: mmap aligns to 4 KiB only, and the tensor starts at the next 2 MiB.
    # Private: a shared anonymous mapping is shmem, which THP's `enabled` setting does not cover.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out: ordinary pages
            pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    tensor = raw[offset : offset + nbytes].view(dtype)
    return tensor.zero_()
