"""Which attention backend and KV block size the engine runs with, given the device, dtype, head
dim, GPU generation and which kernel libraries import; and the errors for a backend that cannot
run. The platform is described, not detected, so every GPU case runs here."""

from __future__ import annotations

import sys
from typing import get_args

import pytest
import torch

from config import ConfigError
from config.engine_config import AttentionBackendName
from kernels.attention.platform import Platform, import_error
from kernels.attention.registry import BACKENDS, NAMES
from kernels.attention.selector import AttentionChoice, build_backend, choose

HOPPER, AMPERE, TURING = (9, 0), (8, 0), (7, 5)


def platform(
    capability: tuple[int, int] | None = HOPPER,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 128,
    missing: tuple[str, ...] = (),
) -> Platform:
    def importable(module: str) -> str | None:
        return f"{module} is not installed" if module in missing else None

    return Platform(
        "cpu" if capability is None else "cuda", dtype, head_dim, capability, importable
    )


@pytest.mark.parametrize(
    ("case", "block_size", "name", "chosen_block", "why_words"),
    [
        (platform(None, torch.float32), None, "cpu", 16, ["fastest"]),
        (platform(None, torch.bfloat16), 128, "cpu", 128, ["fastest"]),
        (
            platform(None, missing=("kernels.cpu.paged_attention_op",)),
            None,
            "torch",
            16,
            ["slow", "not cpu: kernels.cpu.paged_attention_op is not installed"],
        ),
        # On a GPU Triton first, as measured (kernels/attention/registry.py); flash-attn 4 only
        # when named, so a Hopper or Blackwell GPU with it installed still gets Triton.
        (platform(HOPPER), None, "triton", 16, ["fastest"]),
        (platform((10, 0)), 64, "triton", 64, ["fastest"]),  # a block size given is kept
        (platform(HOPPER, torch.float32), None, "triton", 16, ["fastest"]),
        (platform(TURING), None, "triton", 16, []),
        (platform(HOPPER, head_dim=512), None, "triton", 16, []),
        (
            platform(HOPPER, missing=("triton",)),
            None,
            "flash-attn",
            256,
            ["not triton: triton is not installed"],
        ),
        (platform(AMPERE, missing=("triton",)), 512, "flash-attn", 512, []),
        (
            platform(AMPERE, missing=("triton",)),
            16,
            "torch",
            16,
            ["slow", "multiple of 256, got 16"],
        ),
        (
            platform(AMPERE, torch.float32, missing=("triton",)),
            None,
            "torch",
            16,
            ["not float32", "--dtype"],
        ),
        (
            platform(HOPPER, missing=("flash_attn.flash_attn_interface", "triton")),
            None,
            "torch",
            16,
            [
                "slow",
                "not flash-attn:",
                "not triton: triton is not installed (pip install triton)",
            ],
        ),
    ],
)
def test_auto_takes_the_fastest_that_can_run(
    case: Platform, block_size: int | None, name: str, chosen_block: int, why_words: list[str]
) -> None:
    choice = choose("auto", case, block_size)
    assert (choice.name, choice.block_size) == (name, chosen_block)
    for words in why_words:
        assert words in choice.why


@pytest.mark.parametrize(
    ("requested", "case", "block_size", "chosen_block"),
    [
        ("torch", platform(HOPPER), None, 16),
        ("cpu", platform(None), None, 16),
        ("triton", platform(HOPPER), None, 16),
        ("flash-attn", platform(HOPPER), None, 256),
        ("flash-attn-4", platform((10, 3)), None, 128),
    ],
)
def test_a_named_backend_is_taken_when_it_can_run(
    requested: str, case: Platform, block_size: int | None, chosen_block: int
) -> None:
    assert choose(requested, case, block_size) == AttentionChoice(
        requested, "forced by --attention-backend", chosen_block
    )


def test_triton_on_a_cpu_only_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = platform(None, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose("triton", cpu).name == "triton"
    assert choose("auto", cpu).name == "cpu"  # the interpreter is for tests, never chosen by itself
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(
        ConfigError, match="--attention-backend triton: it needs a CUDA device, not cpu"
    ):
        choose("triton", cpu)


@pytest.mark.parametrize(
    ("requested", "case", "block_size", "words"),
    [
        ("flash-attn", platform(None, torch.float32), None, "needs a CUDA device, not cpu"),
        ("flash-attn", platform(AMPERE), 128, "--block-size a multiple of 256, got 128"),
        ("flash-attn", platform(AMPERE, torch.float32), None, "float16 or bfloat16, not float32"),
        ("flash-attn", platform(TURING), None, "8.0 or later"),
        (
            "flash-attn",
            platform(AMPERE, missing=("flash_attn.flash_attn_interface",)),
            None,
            "flash_attn.flash_attn_interface is not installed",
        ),
        ("flash-attn-4", platform(AMPERE), None, "Hopper and Blackwell"),
        (
            "flash-attn-4",
            platform(HOPPER, missing=("flash_attn.cute",)),
            None,
            "flash_attn.cute is not installed",
        ),
        ("triton", platform(HOPPER, missing=("triton",)), None, "pip install triton"),
        ("cpu", platform(HOPPER), None, "it runs on the CPU, not cuda"),
        (
            "cpu",
            platform(None, missing=("kernels.cpu.paged_attention_op",)),
            None,
            "paged_attention_op is not installed",
        ),
        (
            "flash",
            platform(HOPPER),
            None,
            "must be one of auto, triton, flash-attn, flash-attn-4, cpu, torch",
        ),
    ],
)
def test_a_backend_that_cannot_run_is_a_config_error(
    requested: str, case: Platform, block_size: int | None, words: str
) -> None:
    with pytest.raises(ConfigError, match="--attention-backend") as info:
        choose(requested, case, block_size)
    assert words in str(info.value)


def test_import_error_names_what_is_missing_or_broken(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert import_error("torch") is None
    assert import_error("no_such_kernels_pkg") == "no_such_kernels_pkg is not installed"
    (tmp_path / "broken_kernels_pkg.py").write_text(
        "raise OSError('libcudart.so.13: cannot open shared object file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = import_error("broken_kernels_pkg")
    assert reason is not None and "does not import: OSError: libcudart.so.13" in reason
    assert "broken_kernels_pkg" not in sys.modules


def test_flash_attn_4_alone_is_not_taken_for_flash_attn_2(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flash-attn 4 installs only `flash_attn/cute/`: `import flash_attn` then succeeds as a
    namespace package, but flash-attn 2's functions are not there."""
    cute = tmp_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text("def flash_attn_varlen_func(*args, **kwargs): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    hopper = Platform("cuda", torch.bfloat16, 128, HOPPER, import_error)
    assert import_error("flash_attn") is None  # the trap: the namespace package imports
    with pytest.raises(ConfigError, match=r"flash_attn\.flash_attn_interface does not import"):
        choose("flash-attn", hopper, 256)
    assert choose("flash-attn-4", hopper).name == "flash-attn-4"


def test_the_config_accepts_exactly_the_registered_backends() -> None:
    assert set(get_args(AttentionBackendName)) == {"auto", *NAMES}
    assert len(set(NAMES)) == len(BACKENDS)


def test_every_backend_that_can_run_here_is_built_by_its_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    here = Platform.detect("cpu", torch.float32, 64)
    runnable = [e.name for e in BACKENDS if e.unfit(here, None) is None]
    assert {"torch", "cpu", "triton"} <= set(runnable)
    for name in runnable:
        assert build_backend(name).name == name  # the row builds its own backend
