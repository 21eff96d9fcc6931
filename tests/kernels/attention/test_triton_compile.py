"""Every Triton kernel compiles, without a GPU, for the GPUs it is meant to run on (A100: sm80,
H100/H200: sm90, B200: sm100), at every shape the attention selector can give it, and fits the
shared memory one block may have there. The launches come from the kernels' own launch code
(given meta tensors), so the tiles compiled here are the tiles a GPU would run.

Shapes: each dtype --dtype allows (the Triton backend takes all three), the head dims of real
models (64 and 128, as SmolLM2 and Llama 3 / Qwen / Mistral have; 256, the largest the kernels
are tested at), the default block size, and every block size --block-size allows at the
default model's shape; and the attention kernel's specialization for a sliding window and a
softcap at every model's shape in bfloat16: 93 compiles, about 45 s of CPU, spread over the
cores in processes of their own. A target the toolchain here cannot build for at all is
skipped, saying why."""

from __future__ import annotations

import importlib.util
import os
import typing

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # as in test_triton_kernels.py
    if os.environ.get("CI"):
        raise RuntimeError("triton is not installed: pip install -e '.[dev]'")
    pytest.skip("triton is not installed", allow_module_level=True)

from pydantic import ValidationError

from config.engine_config import CacheConfig, DType
from kernels.attention.registry import BY_NAME
from tests.support.triton_compile import MODELS, Case, Outcome, compile_cases

DEFAULT_BLOCK_SIZE = BY_NAME["triton"].default_block_size

# The most shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin, which
# Triton checks a kernel against before its first launch): the SM's 164 KiB (A100) or 228 KiB
# (H100, B200) less the 1 KiB CUDA reserves per block. Source: CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability" (maximum shared memory per thread block:
# 163 KB for 8.0, 227 KB for 9.0 and 10.0), and the Ampere, Hopper and Blackwell tuning guides.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
CAPABILITIES = sorted(SHARED_LIMIT)
UNBUILDABLE = 990  # no ptxas knows sm_990: the probe must say so


def _allowed(block_size: int) -> bool:
    try:
        CacheConfig(block_size=block_size)
    except ValidationError:
        return False
    return True


DTYPES = [name for name in typing.get_args(DType) if name != "auto"]
BLOCK_SIZES = [2**i for i in range(16) if _allowed(2**i)]
DEFAULT_MODEL = "SmolLM2-135M"

CASES = [
    *(
        Case(kernel, model, dtype, DEFAULT_BLOCK_SIZE, capability)
        for kernel in ("paged_attention", "store_kv")
        for model in MODELS
        for dtype in DTYPES
        for capability in CAPABILITIES
    ),
    # The block size only changes how a key finds its slot, so one shape covers the rest: the
    # default model's, in the half type a GPU runs it in.
    *(
        Case("paged_attention", DEFAULT_MODEL, "bfloat16", block_size, capability)
        for block_size in BLOCK_SIZES
        if block_size != DEFAULT_BLOCK_SIZE
        for capability in CAPABILITIES
    ),
    # The window and the softcap add compile-time branches; the half type a GPU runs them in.
    *(
        Case("paged_attention", model, "bfloat16", DEFAULT_BLOCK_SIZE, capability, True)
        for model in MODELS
        for capability in CAPABILITIES
    ),
]


@pytest.fixture(scope="module")
def outcome(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    # Only the cases this run selected (-k), so that checking one does not compile them all.
    selected = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and isinstance(callspec.params.get("case"), Case):
            selected.append(callspec.params["case"])
    return compile_cases(selected, [UNBUILDABLE], tmp_path_factory.mktemp("triton-compile"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_kernel_compiles_and_fits_shared_memory(case: Case, outcome: Outcome) -> None:
    problem = outcome.problems[case.capability]
    if problem is not None:
        pytest.skip(problem)
    assert case.key not in outcome.errors, outcome.errors.get(case.key)
    compiled = outcome.compiled[case.key]
    assert compiled.cubin_bytes > 0
    if case.kernel == "paged_attention":  # its dot products stage tiles there: zero is a misread
        assert compiled.shared > 0
    limit = SHARED_LIMIT[case.capability]
    assert compiled.shared <= limit, (
        f"{case.key} needs {compiled.shared} bytes of shared memory per block; "
        f"sm{case.capability} allows {limit}: it would fail to launch there"
    )


def test_shapes_cover_what_the_config_allows() -> None:
    """The lists above come from the config, so a new dtype or block size is compiled too."""
    assert BLOCK_SIZES == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert DEFAULT_BLOCK_SIZE in BLOCK_SIZES
    assert {getattr(torch, name) for name in DTYPES} == {
        torch.float16,
        torch.bfloat16,
        torch.float32,
    }


def test_a_target_the_toolchain_cannot_build_is_a_skip_reason(outcome: Outcome) -> None:
    """A target newer than the ptxas here is reported, with ptxas's words (so its cases skip,
    saying why), rather than passing."""
    problem = outcome.problems[UNBUILDABLE]
    assert problem is not None and "sm_990" in problem, problem
