"""Choose the attention backend at start-up."""

from __future__ import annotations

import logging

from kernels.attention.backend import AttentionBackend
from kernels.attention.torch_ref import TorchReferenceBackend

log = logging.getLogger(__name__)

BACKENDS = {"torch": TorchReferenceBackend}


def select_attention_backend(requested: str, device: str) -> AttentionBackend:
    """`auto` picks the fastest backend available on `device`; a name forces that backend."""
    if requested == "auto":
        name, why = "torch", f"the reference backend is the one available on {device}"
    elif requested in BACKENDS:
        name, why = requested, "forced by --attention-backend"
    else:
        raise ValueError(f"--attention-backend must be one of auto, {', '.join(BACKENDS)}; got {requested!r}")
    log.info("attention backend: %s (%s)", name, why)
    return BACKENDS[name]()
