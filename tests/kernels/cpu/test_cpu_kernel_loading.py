"""The C++ CPU kernels are built at install (setup.py) and only loaded at run time: a process with
no compiler imports the CLI, the server and the engine, and serves `--help`, compiling nothing;
a kernel that cannot load here (built for CPU features this one lacks) leaves its work to the
torch ops and says why, and the engine still generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import targets
from kernels.cpu.extension import BuildInfo, why_not_loadable

ROOT = Path(__file__).resolve().parents[3]
CPU_DIR = ROOT / "kernels" / "cpu"


def no_compiler_env(tmp_path: Path) -> dict[str, str]:
    """This environment with no compiler to be found: an empty PATH, and CXX/CC that fail."""
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(
        PATH=str(empty),
        CXX="/bin/false",
        CC="/bin/false",
        TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"),
        PYTHONPATH=str(ROOT),
    )
    return env


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_the_checkout_holds_every_kernel_built_from_its_current_sources() -> None:
    info = BuildInfo.read(CPU_DIR / targets.BUILD_INFO)
    assert info is not None, "the kernels were not built: run `make install`"
    for stem in targets.KERNELS:
        assert list(CPU_DIR.glob(f"{targets.module_name(stem)}.*.so")), stem
        assert info.sources[stem] == targets.source_digest(targets.source_path(stem)), (
            f"{stem}.cpp changed since the kernels were built: run `make install`"
        )


def test_cli_server_and_engine_import_and_serve_help_with_no_compiler(tmp_path: Path) -> None:
    env = no_compiler_env(tmp_path)
    code = """
import json, sys
import server.app, engine
from server.cli import main
from kernels.cpu import extension, layer_stack, bf16_linear  # every kernel, layer_stack last
sys.argv = ["pagedserve", "serve", "--help"]
try:
    main()
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
print(json.dumps({stem: module.__file__ for stem, module in extension._loaded.items()}))
"""
    done = run_python(code, env)
    assert done.returncode == 0, done.stderr
    assert "usage: pagedserve serve" in done.stdout
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(loaded) == sorted(targets.KERNELS)
    # Each is the module built at install, and the run-time builder never ran.
    for stem, path in loaded.items():
        assert Path(path).parent == CPU_DIR and Path(path).name.startswith(f"_{stem}."), path
    assert not (tmp_path / "torch_extensions").exists()
    assert "unavailable" not in done.stderr


def test_a_kernel_built_for_features_this_cpu_lacks_falls_back_with_a_logged_reason(
    tmp_path: Path, llama_dir: Path
) -> None:
    # This CPU as an x86-64 baseline one (no AVX at all): every built kernel must be refused
    # before it is loaded (it could execute an instruction the CPU lacks), none built (no
    # compiler), and the engine must still generate, on the torch ops.
    env = no_compiler_env(tmp_path)
    code = f"""
import logging
logging.basicConfig(level=logging.INFO)
from kernels.cpu import extension
extension.cpu_features = lambda: frozenset({{"fpu", "sse", "sse2"}})
from engine import LLM, SamplingParams
llm = LLM({str(llama_dir)!r}, device="cpu", dtype="bfloat16", max_model_len=64)
[out] = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
assert len(out.outputs[0].token_ids) == 4
"""
    done = run_python(code, env)
    assert done.returncode == 0, done.stderr[-4000:]
    log = done.stderr
    for stem in ("paged_attention", "fused_ops"):
        assert f"CPU kernel {stem} unavailable, torch ops run instead" in log, log[-4000:]
    assert "this CPU lacks them" in log and "avx2" in log
    # In a checkout the development fallback tries to build for this CPU, and finds no compiler.
    assert "no C++ compiler" in log or "building it here failed" in log
    assert not list((tmp_path / "torch_extensions").rglob("*.so"))


INFO = BuildInfo("x86-64-v3", ("avx", "avx2", "fma"), "2.13.0+cpu", {})


@pytest.mark.parametrize(
    ("features", "torch_version", "expected"),
    [
        (frozenset({"sse2", "avx", "avx2", "fma", "avx512f"}), "2.13.0+cpu", None),
        (None, "2.13.0+cpu", None),  # flags unreadable (not Linux): trust the build
        (frozenset({"sse2", "avx"}), "2.13.0+cpu", "uses avx2, fma: this CPU lacks them"),
        (frozenset({"avx", "avx2", "fma"}), "2.14.0", "built against torch 2.13.0+cpu"),
    ],
)
def test_why_not_loadable(
    features: frozenset[str] | None, torch_version: str, expected: str | None
) -> None:
    reason = why_not_loadable(INFO, features, torch_version)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason


def test_a_portable_target_needs_fewer_features_than_avx512_code() -> None:
    macros = "#define __AVX2__ 1\n#define __FMA__ 1\n#define __x86_64__ 1\n#define __AVX512F__ 1\n"
    assert targets.cpu_features_of(macros) == ["avx2", "avx512f", "fma"]
    assert targets.compile_flags("fused_ops", "x86-64-v3")[-2:] == [
        "-march=x86-64-v3",
        "-ffp-contract=off",
    ]
