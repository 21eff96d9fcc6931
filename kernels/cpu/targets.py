"""What the CPU kernels are built from and for: their sources, compiler flags, the target CPU,
and which CPU features a target lets the compiler use. Read by setup.py (the build, which loads
this file by path, so it imports nothing but the standard library) and by extension.py (the
loader, which checks those features before it loads a built module).

The target is PAGEDSERVE_CPU_ARCH, a GCC `-march` value: `native` (the default: a local install
runs the fastest code this machine has) or a named level such as `x86-64-v3`, for a build that
runs elsewhere (the Docker image). Whatever the compiler may emit under that target is recorded
at build time; a machine without one of those features gets the torch fallback, not SIGILL.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

ARCH_ENV = "PAGEDSERVE_CPU_ARCH"
DEFAULT_ARCH = "native"
# "1": build them or fail; "0": a pure-Python package; "auto" (unset): build them where torch is
# importable in the build environment (pip's build isolation hides the installed torch).
BUILD_ENV = "PAGEDSERVE_BUILD_KERNELS"
# Written beside the built modules: the target, the features it needs, the torch built against.
BUILD_INFO = "_build.json"

# Kernel stem -> extra compiler flags. Each builds kernels/cpu/<stem>.cpp into kernels.cpu._<stem>.
# fused_ops: no `a * b + c` fused into one rounding where torch rounds twice.
KERNELS: dict[str, tuple[str, ...]] = {
    "paged_attention": (),
    "prefill_attention": (),
    "bf16_linear": (),
    "fused_ops": ("-ffp-contract=off",),
    "layer_stack": (),
    "quant_linear": (),
}

# -fopenmp: at::parallel_for (a header template) runs every work item on one thread without it;
# its calls bind to the OpenMP runtime torch already loaded, so both share one thread pool.
BASE_FLAGS = ("-O3", "-fno-math-errno", "-fopenmp")

# GCC's predefined macro for an instruction-set extension -> its name in /proc/cpuinfo's flags.
# The vector and bit-manipulation extensions the compiler emits on its own under -march.
ISA_MACROS: dict[str, str] = {
    "__SSE3__": "pni",
    "__SSSE3__": "ssse3",
    "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__BMI__": "bmi1",
    "__BMI2__": "bmi2",
    "__LZCNT__": "abm",
    "__MOVBE__": "movbe",
    "__AVX512F__": "avx512f",
    "__AVX512CD__": "avx512cd",
    "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512IFMA__": "avx512ifma",
    "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16",
    "__AVXVNNI__": "avx_vnni",
    "__GFNI__": "gfni",
    "__VAES__": "vaes",
    "__VPCLMULQDQ__": "vpclmulqdq",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8",
}

SOURCE_DIR = Path(__file__).resolve().parent


def target_arch(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(ARCH_ENV, "").strip() or DEFAULT_ARCH


def compile_flags(stem: str, arch: str) -> list[str]:
    return [*BASE_FLAGS, f"-march={arch}", *KERNELS[stem]]


def module_name(stem: str) -> str:
    """The built module's name inside kernels.cpu (a leading underscore: not an API)."""
    return f"_{stem}"


def source_path(stem: str) -> Path:
    return SOURCE_DIR / f"{stem}.cpp"


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cpu_features_of(macros: str) -> list[str]:
    """The /proc/cpuinfo flags a build needs, from the compiler's `-dM -E` macro dump."""
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    return sorted(flag for macro, flag in ISA_MACROS.items() if macro in defined)
