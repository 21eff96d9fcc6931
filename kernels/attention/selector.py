"""Choose the attention backend at start-up, and say which and why."""

from __future__ import annotations

import importlib.util
import logging
import os

from config import ConfigError
from kernels.attention.backend import AttentionBackend

log = logging.getLogger(__name__)

NAMES = ("torch", "triton")


class BackendUnavailableError(ConfigError):
    """The backend asked for cannot run here (a bad setting: the command line exits 2)."""


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def choose(requested: str, device: str) -> tuple[str, str]:
    """(backend name, why): `auto` takes the fastest available on `device`; a name is checked."""
    cuda = device.startswith("cuda")
    if requested == "auto":
        if cuda and triton_installed():
            return "triton", "CUDA device and triton installed"
        if cuda:
            return "torch", "triton is not installed (pip install triton): the reference backend, slow"
        return "torch", f"the reference backend is the one for {device}"
    if requested not in NAMES:
        raise BackendUnavailableError(f"--attention-backend must be one of auto, {', '.join(NAMES)}; got {requested!r}")
    if requested == "triton":
        if not triton_installed():
            raise BackendUnavailableError("--attention-backend triton: triton is not installed (pip install triton)")
        if not cuda and not _interpreted():
            raise BackendUnavailableError(
                f"--attention-backend triton needs a CUDA device, not {device} (or TRITON_INTERPRET=1 to run its "
                "kernels on the CPU, slowly)"
            )
    return requested, "forced by --attention-backend"


def select_attention_backend(requested: str, device: str) -> AttentionBackend:
    name, why = choose(requested, device)
    log.info("attention backend: %s (%s)", name, why)
    if name == "triton":
        from kernels.attention.triton_backend import TritonBackend  # triton is imported only when used

        return TritonBackend()
    from kernels.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend()
