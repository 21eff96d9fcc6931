"""Compile the Triton kernels' launches (kernels/triton/launch.py) for real GPU targets with no
GPU: Triton lowers each to PTX and the ptxas in Triton's wheel assembles the cubin, whose
metadata holds the shared memory one block needs.

The compiling runs in processes of their own (`compile_cases` starts them): the test suite
imports Triton under TRITON_INTERPRET=1, which makes Triton's own library functions (tl.max,
tl.cdiv) interpreted ones that its compiler cannot call, so no kernel compiles in that process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, CompiledKernel

from kernels.triton.launch import KernelLaunch
from kernels.triton.paged_attention import paged_attention_launch
from kernels.triton.quant_layout import PackedQuantWeight
from kernels.triton.quant_linear import quant_linear_launch, quant_linear_output
from kernels.triton.rms_norm import rms_norm_launch
from kernels.triton.rope_store_kv import rope_store_kv_launch
from kernels.triton.silu_mul import silu_mul_launch
from kernels.triton.store_kv import store_kv_launch


@dataclass(frozen=True)
class Model:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


MODELS = {
    m.name: m
    for m in (
        Model("SmolLM2-135M", 9, 3, 64),  # the default model
        Model("Llama-3.1-8B", 32, 8, 128),  # as Mistral 7B, Qwen3 8B
        Model("Gemma-7B", 16, 16, 256),  # the largest head dim the kernels are tested at
    )
}


@dataclass(frozen=True)
class Linear:
    """A linear layer's weight shape, [out_features, in_features]."""

    name: str
    n: int
    k: int


# Each model's down projection (its longest inputs): the shape the quantized linear's launches
# are compiled at. n and k are runtime arguments (every linear's a multiple of 16, so Triton
# specializes them alike): the compiled code depends on the rows, the format and the dtype.
LINEARS = {
    "SmolLM2-135M": Linear("down", 576, 1536),
    "Llama-3.1-8B": Linear("down", 4096, 14336),
}


@dataclass(frozen=True)
class QuantFormat:
    """A weight format of the quantized linear: bits, inputs a group (0: the whole row), mins."""

    bits: int
    group: int
    mins: bool

    @property
    def key(self) -> str:
        group = "row" if self.group == 0 else f"g{self.group}"
        return f"int{self.bits}-{group}{'-mins' if self.mins else ''}"


@dataclass(frozen=True)
class Case:
    """One kernel at one shape for one target; `capability` is 80 for compute capability 8.0."""

    kernel: str  # "paged_attention", "store_kv", "quant_linear" or one of FUSED_KERNELS
    model: str  # a key of MODELS
    dtype: str  # a torch dtype's name
    block_size: int
    capability: int
    # paged_attention's specialization for a layer with a sliding window and a softcap (Gemma 2's
    # 4096 and 50.0), which compiles code the plain one does not.
    window_and_softcap: bool = False
    # quant_linear: the weight format and the rows of x, at LINEARS[model] (block_size unused).
    quant: QuantFormat | None = None
    rows: int = 0

    @property
    def key(self) -> str:
        if self.quant is not None:
            return (
                f"{self.kernel}-{self.model}-{self.quant.key}-{self.dtype}"
                f"-m{self.rows}-sm{self.capability}"
            )
        variant = "-window-softcap" if self.window_and_softcap else ""
        return f"{self.kernel}{variant}-{self.model}-{self.dtype}-b{self.block_size}-sm{self.capability}"


@dataclass(frozen=True)
class Compiled:
    shared: int  # bytes of shared memory per block
    cubin_bytes: int
    seconds: float


@dataclass(frozen=True)
class Outcome:
    problems: dict[int, str | None]  # capability -> why nothing compiles for it here
    compiled: dict[str, Compiled]  # by Case.key
    errors: dict[str, str]  # by Case.key: the compiler's message


def compile_cases(cases: list[Case], probes: list[int], workdir: Path, cache_dir: Path) -> Outcome:
    """Compile `cases`, and probe the toolchain for every capability in them and in `probes`,
    with Triton's compiler as a GPU machine runs it: no interpreter, no architecture override.
    Compiled kernels are kept in `cache_dir`, not ~/.triton: Triton keys each one by the
    kernel's source, its constants and options, the target, and the versions of Triton and
    ptxas, so a kernel that changed compiles again and an unchanged one is read back with the
    shared memory its compile reported. A failed compile is never kept. Compiling is CPU-bound:
    the cases are dealt to one process per core (at most 4; each one starts by importing torch
    and Triton)."""
    workers = max(1, min(4, os.cpu_count() or 1, len(cases)))
    dealt = [cases[i::workers] for i in range(workers)]
    running = [
        _start(
            workdir / f"worker{i}",
            sorted({*(probes if i == 0 else []), *(c.capability for c in share)}),
            share,
            cache_dir,
        )
        for i, share in enumerate(dealt)
    ]
    outcome = Outcome({}, {}, {})
    try:
        for folder, process in running:
            returncode = process.wait(timeout=1200)
            if returncode != 0:
                stderr = (folder / "stderr").read_text()[-4000:]
                raise RuntimeError(
                    f"the compile process in {folder} exited {returncode}:\n{stderr}"
                )
            raw = json.loads((folder / "outcome.json").read_text())
            outcome.problems.update({int(c): p for c, p in raw["problems"].items()})
            outcome.compiled.update({k: Compiled(**v) for k, v in raw["compiled"].items()})
            outcome.errors.update(raw["errors"])
    finally:
        for _, process in running:
            if process.poll() is None:  # one failed or hung: stop the others compiling
                process.kill()
                process.wait()
    return outcome


def _start(
    folder: Path, probes: list[int], cases: list[Case], cache_dir: Path
) -> tuple[Path, subprocess.Popen]:
    folder.mkdir(parents=True)
    request = folder / "cases.json"
    request.write_text(json.dumps({"probes": probes, "cases": [asdict(c) for c in cases]}))
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH")
    }
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.triton_compile",
                str(request),
                str(folder / "outcome.json"),
            ],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdout=stdout,  # where Triton prints the PTX of a kernel ptxas rejects
            stderr=stderr,
        )
    return folder, process


# --------------------------------------------------------------------------- the compile process


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _qkv(model: Model, dtype: torch.dtype, tokens: int) -> tuple[torch.Tensor, ...]:
    """q, k and v as the model passes them: views into one fused projection (strided rows)."""
    q_size, kv_size = model.heads * model.head_dim, model.kv_heads * model.head_dim
    fused = _meta(tokens, q_size + 2 * kv_size, dtype=dtype)
    q, k, v = fused.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(tokens, model.heads, model.head_dim),
        k.view(tokens, model.kv_heads, model.head_dim),
        v.view(tokens, model.kv_heads, model.head_dim),
    )


def _quant_linear_launch(case: Case, dtype: torch.dtype) -> KernelLaunch:
    assert case.quant is not None
    linear = LINEARS[case.model]
    n, k, bits = linear.n, linear.k, case.quant.bits
    groups = k // (case.quant.group or k)
    weight = PackedQuantWeight(
        _meta(k * bits // 32, n, dtype=torch.int32),
        _meta(groups, n, dtype=torch.float32),
        _meta(groups, n, dtype=torch.float32) if case.quant.mins else None,
        bits,
        n,
        k,
    )
    x = _meta(case.rows, k, dtype=dtype)
    return quant_linear_launch(x, weight, None, quant_linear_output(x, weight))


# The decoder layers' fused kernels (kernels/triton/fused_ops.py).
FUSED_KERNELS = ("rms_norm", "add_rms_norm", "silu_mul", "rope_store_kv")


def _fused_launch(case: Case, model: Model, dtype: torch.dtype, tokens: int) -> KernelLaunch:
    """A fused kernel at the model's shapes: rows of heads x head_dim (its hidden size, but for
    Gemma's), an MLP 4 times wider, the rotary + store with q/k norms (the branch with more
    code)."""
    hidden = model.heads * model.head_dim
    rows, weight = _meta(tokens, hidden, dtype=dtype), _meta(hidden, dtype=dtype)
    if case.kernel == "rms_norm":
        return rms_norm_launch(rows, weight, 1e-6, torch.empty_like(rows))
    if case.kernel == "add_rms_norm":
        out, summed = torch.empty_like(rows), torch.empty_like(rows)
        return rms_norm_launch(rows, weight, 1e-6, out, torch.empty_like(rows), summed)
    if case.kernel == "silu_mul":
        return silu_mul_launch(
            _meta(tokens, 8 * hidden, dtype=dtype), _meta(tokens, 4 * hidden, dtype=dtype)
        )
    q, k, v = _qkv(model, dtype, tokens)
    cache = _meta(64, case.block_size, model.kv_heads, model.head_dim, dtype=dtype)
    rope = _meta(tokens, model.head_dim, dtype=dtype)
    norm = _meta(model.head_dim, dtype=dtype)
    return rope_store_kv_launch(
        q,
        k,
        v,
        torch.empty_like(q),
        rope,
        torch.empty_like(rope),
        cache,
        torch.empty_like(cache),
        _meta(tokens, dtype=torch.int64),
        (norm, torch.empty_like(norm)),
        1e-6,
    )


def launch_for(case: Case) -> KernelLaunch:
    """The launch the kernel's own launch code builds for this shape, from meta tensors."""
    model, dtype = MODELS[case.model], getattr(torch, case.dtype)
    if case.kernel == "quant_linear":
        return _quant_linear_launch(case, dtype)
    tokens, reqs = 96, 4
    q, k, v = _qkv(model, dtype, tokens)
    k_cache = _meta(64, case.block_size, model.kv_heads, model.head_dim, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    if case.kernel in FUSED_KERNELS:
        return _fused_launch(case, model, dtype, tokens)
    if case.kernel == "store_kv":
        return store_kv_launch(k, v, k_cache, v_cache, _meta(tokens, dtype=torch.int64))
    return paged_attention_launch(
        q,
        k_cache,
        v_cache,
        torch.empty_like(q),
        _meta(reqs, 48, dtype=torch.int32),  # block tables
        _meta(reqs + 1, dtype=torch.int32),  # cu_seqlens_q
        _meta(reqs, dtype=torch.int32),  # seqlens_k
        max_query_len=64,
        scale=model.head_dim**-0.5,
        sliding_window=4096 if case.window_and_softcap else None,
        softcap=50.0 if case.window_and_softcap else None,
    )


_POINTEE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}
_DIVISIBLE = [["tt.divisibility", 16]]


def compile_launch(launch: KernelLaunch, capability: int) -> CompiledKernel:
    """Compile `launch` for `capability` with the signature, constexprs and options its launch
    would give Triton's JIT on a GPU."""
    fn = launch.kernel
    names = set(launch.args) | set(launch.constexprs)
    if names != set(fn.arg_names):  # the launch and the kernel disagree: fail, never guess
        raise TypeError(
            f"{fn.__name__}: launch passes {sorted(names)}, kernel takes {fn.arg_names}"
        )
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for index, name in enumerate(fn.arg_names):
        if name in launch.constexprs:
            signature[name], constexprs[name] = "constexpr", launch.constexprs[name]
            continue
        value = launch.args[name]
        # As Triton's JIT specializes: an int equal to 1 becomes a constant, and a pointer or
        # an int divisible by 16 is marked so (torch aligns its allocations, and the views
        # here start on 16-byte boundaries), which sets vector widths.
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _POINTEE[value.dtype]
            attrs[(index,)] = _DIVISIBLE
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int) and value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = _DIVISIBLE
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: no Triton type for {name}={value!r}")
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target, options=dict(launch.options))


def toolchain_problem(capability: int) -> str | None:
    """Why nothing at all compiles for `capability` here (e.g. a ptxas older than the
    architecture), or None when a trivial kernel compiles: a failure after that is the kernel's."""
    probe = ASTSource(fn=_trivial, signature={"x_ptr": "*fp32"})
    try:
        triton.compile(probe, target=GPUTarget("cuda", capability, 32))
    # Whatever fails here is the toolchain's (missing or old ptxas, unknown target, LLVM): the
    # kernel is trivial.
    except Exception as exc:  # noqa: BLE001
        return f"Triton {triton.__version__} cannot compile for sm{capability} here: {type(exc).__name__}: {str(exc).strip()}"
    return None


@triton.jit
def _trivial(x_ptr):
    tl.store(x_ptr, 1.0)


def _main(request: Path, result: Path) -> None:
    spec = json.loads(request.read_text())
    problems = {c: toolchain_problem(c) for c in spec["probes"]}
    compiled: dict[str, dict[str, object]] = {}
    errors: dict[str, str] = {}
    for raw in spec["cases"]:
        quant = raw.pop("quant")
        case = Case(**raw, quant=None if quant is None else QuantFormat(**quant))
        if problems[case.capability] is not None:
            continue
        started = time.perf_counter()
        try:
            kernel = compile_launch(launch_for(case), case.capability)
        # Any error is this case's to report: its test fails with it, the others still run.
        except Exception as exc:  # noqa: BLE001
            errors[case.key] = f"{type(exc).__name__}: {exc}"
            continue
        compiled[case.key] = asdict(
            Compiled(
                kernel.metadata.shared, len(kernel.asm["cubin"]), time.perf_counter() - started
            )
        )
    result.write_text(json.dumps({"problems": problems, "compiled": compiled, "errors": errors}))


if __name__ == "__main__":
    _main(Path(sys.argv[1]), Path(sys.argv[2]))
