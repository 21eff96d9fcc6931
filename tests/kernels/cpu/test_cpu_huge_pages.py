"""The CPU KV pool on transparent huge pages (kernels/cpu/huge_pages.py)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.cpu.huge_pages import HUGE_PAGE_BYTES, huge_page_zeros, transparent_huge_pages

THP_ON = transparent_huge_pages() in ("always", "madvise")
needs_thp = pytest.mark.skipif(
    not THP_ON, reason=f"this kernel's transparent huge pages are {transparent_huge_pages()}"
)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """How many bytes of the mapping that holds `tensor` are on huge pages now (AnonHugePages
    of its entry in /proc/self/smaps); 0 where that cannot be read."""
    address = tensor.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's header: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_thp_mode_is_read_from_the_kernel() -> None:
    assert transparent_huge_pages() in ("always", "madvise", "never", "unavailable")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zeros_start_on_a_huge_page_boundary(dtype: torch.dtype) -> None:
    t = huge_page_zeros(3 * HUGE_PAGE_BYTES // dtype.itemsize + 5, dtype)
    assert t.dtype == dtype and t.numel() == 3 * HUGE_PAGE_BYTES // dtype.itemsize + 5
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert t.count_nonzero() == 0
    t[-1] = 7  # the whole range is writable, the last element included
    assert t[-1] == 7


@needs_thp
def test_zeros_are_backed_by_huge_pages() -> None:
    t = huge_page_zeros(16 * HUGE_PAGE_BYTES // 2, torch.bfloat16)
    # At least half of its 16 MiB: the kernel may be short of free huge pages.
    assert huge_page_bytes(t) >= 8 * HUGE_PAGE_BYTES
    if transparent_huge_pages() == "madvise":  # only what asked for them has them
        # A fresh mapping that did not ask, not a malloc'd tensor: numpy madvises the large
        # blocks it allocates, and once the engine keeps freed memory in the heap
        # (kernels/cpu/malloc.py) a later small tensor may sit in such a block.
        plain = mmap.mmap(-1, 16 * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        ordinary = torch.frombuffer(plain, dtype=torch.uint8).fill_(1)  # faulted in
        assert huge_page_bytes(ordinary) == 0


@needs_thp
def test_engine_kv_pool_is_one_huge_page_mapping(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=128, num_kv_blocks=512, block_size=16)
    caches = llm.engine.executor.runner.kv_caches
    first_k, last_v = caches[0][0], caches[-1][1]
    # Every layer's K and V are views of one pool, in layer order, on huge pages.
    assert all(
        k.untyped_storage().data_ptr() == first_k.untyped_storage().data_ptr() for k, _ in caches
    )
    span = last_v.data_ptr() + last_v.nbytes - first_k.data_ptr()
    assert span == 2 * len(caches) * first_k.nbytes
    assert huge_page_bytes(first_k) > 0
    # The engine writes and reads it: a prompt's K/V land in the pool.
    llm.generate(["The pool holds"], SamplingParams(max_tokens=2, temperature=0))
    assert first_k.count_nonzero() > 0 and last_v.count_nonzero() > 0
