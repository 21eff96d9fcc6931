"""Every Triton kernel compiles, without a GPU, for the GPUs it is meant to run on (A100: sm80,
H100/H200: sm90, B200: sm100), at every shape the attention selector can give it, and fits the
shared memory one block may have there. The launches come from the kernels' own launch code
(given meta tensors), so the tiles compiled here are the tiles a GPU would run.

Shapes: each dtype --dtype allows (the Triton backend takes all three), the head dims of real
models (64 and 128, as SmolLM2 and Llama 3 / Qwen / Mistral have; 256, the largest the kernels
are tested at), the default block size, and every block size --block-size allows at the
default model's shape; and the attention kernel's specialization for a sliding window and a
softcap at every model's shape in bfloat16: 93 compiles, about 45 s of CPU, spread over the
cores in processes of their own. Then the quantized linear (kernels/triton/quant_linear.py) on
sm90 in the weight formats the default model and a 7B Llama are served in: 16 compiles more,
about 17 s of CPU. Then the decoder layers' fused kernels (kernels/triton/fused_ops.py): 44
compiles more, about 20 s of CPU. A target the toolchain here cannot build for at all is
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

from config.engine_config import CacheConfig, DType, default_cache_dir
from kernels.attention.registry import BY_NAME
from tests.support.triton_compile import (
    FUSED_KERNELS,
    MODELS,
    Case,
    Outcome,
    QuantFormat,
    compile_cases,
)

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

GPTQ_4BIT = QuantFormat(4, 128, True)
QUANT_FORMATS = {
    DEFAULT_MODEL: [
        QuantFormat(4, 32, True),
        QuantFormat(4, 32, False),
        QuantFormat(8, 32, False),
        QuantFormat(8, 0, False),
    ],
    "Llama-3.1-8B": [GPTQ_4BIT, QuantFormat(4, 128, False), QuantFormat(8, 0, False)],
}

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
    # The quantized linear (W4A16/W8A16) on Hopper, where it is meant to run: the formats each
    # model is served in (GGUF's Q4_1, Q4_0 and Q8_0 in groups of 32 and int8 per row for the
    # default model; GPTQ/AWQ's groups of 128 and int8 per row for the 7B), at a decode step's
    # rows and a long prefill's (the smallest and the largest tiles, which stage the most in
    # shared memory); the middle tile and fp16 activations at the 7B's common 4-bit format.
    *(
        Case("quant_linear", model, "bfloat16", 0, 90, quant=fmt, rows=rows)
        for model, formats in QUANT_FORMATS.items()
        for fmt in formats
        for rows in (1, 512)
    ),
    Case("quant_linear", "Llama-3.1-8B", "bfloat16", 0, 90, quant=GPTQ_4BIT, rows=48),
    Case("quant_linear", "Llama-3.1-8B", "float16", 0, 90, quant=GPTQ_4BIT, rows=1),
    # The decoder layers' fused kernels: every model and dtype on Hopper, the default model in
    # the half type on the other targets.
    *(
        Case(kernel, model, dtype, DEFAULT_BLOCK_SIZE, 90)
        for kernel in FUSED_KERNELS
        for model in MODELS
        for dtype in DTYPES
    ),
    *(
        Case(kernel, DEFAULT_MODEL, "bfloat16", DEFAULT_BLOCK_SIZE, capability)
        for kernel in FUSED_KERNELS
        for capability in CAPABILITIES
        if capability != 90
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
    # Compiled kernels are kept between runs (~40 MB), beside the converted default model: an
    # unchanged kernel is read back, a changed one compiles again (see `compile_cases`).
    cache = default_cache_dir() / "triton-compile"
    return compile_cases(selected, [UNBUILDABLE], tmp_path_factory.mktemp("triton-compile"), cache)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_kernel_compiles_and_fits_shared_memory(case: Case, outcome: Outcome) -> None:
    problem = outcome.problems[case.capability]
    if problem is not None:
        pytest.skip(problem)
    assert case.key not in outcome.errors, outcome.errors.get(case.key)
    compiled = outcome.compiled[case.key]
    assert compiled.cubin_bytes > 0
    if case.kernel in ("paged_attention", "quant_linear"):  # tl.dot stages tiles in shared memory
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
