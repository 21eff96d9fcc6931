"""Keep freed activation memory in the process instead of handing it back to the kernel.

torch allocates CPU tensors with malloc. glibc serves blocks over its mmap threshold (128 KiB
at first, raised as large blocks are freed, up to 32 MiB) with a fresh mmap and unmaps them on
free, and it trims the heap top back to the kernel. A prefill step's activations are megabytes
each (2,048 rows x 1,536 features in bf16: 6 MiB), so every op of every layer page-faulted its
output in anew and the kernel zeroed it: ~200,000 faults a step for 16 x 128 prompt tokens on
the default model, a third of the step in the kernel. Raising both thresholds makes freed
blocks reused as the next step's ones (the faults go to ~0, prefill 1.5x faster); the price is
that the process keeps its peak working set, as a serving process does anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest allowed mmap threshold on 64-bit (HEAP_MAX_SIZE / 2); bigger blocks still map.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> str | None:
    """Raise glibc's mmap and trim thresholds for this process. None when done, else why not
    (not glibc, or the call refused): the engine then runs as before, only slower."""
    name = ctypes.util.find_library("c")
    if name is None:
        return "no C library found"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return f"{name} has no mallopt (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1
        or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1
    ):
        return "mallopt refused the thresholds"
    return None
