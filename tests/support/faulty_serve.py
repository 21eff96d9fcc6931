"""A test-only launcher: `pagedserve` whose engine step raises once it has run
PAGEDSERVE_TEST_FAULT_AFTER steps with two or more requests in the batch (or, with
PAGEDSERVE_TEST_FAULT=hang, never returns from its first step: a kernel that hangs), so that
tests can watch what the real daemon does when its engine fails. Run as
`python -m tests.support.faulty_serve serve ...` from the repository root."""

from __future__ import annotations

import os
import sys
import threading

from engine.llm_engine import LLMEngine
from server import cli


def inject_fault(after_steps: int) -> None:
    real_step = LLMEngine.step
    steps = 0

    def faulty_step(self: LLMEngine):  # type: ignore[no-untyped-def]
        nonlocal steps
        if len(self.requests) >= 2:
            steps += 1
            if steps > after_steps:
                raise RuntimeError("injected fault")
        return real_step(self)

    LLMEngine.step = faulty_step  # type: ignore[method-assign]


def inject_hang() -> None:
    def hanging_step(self: LLMEngine):  # type: ignore[no-untyped-def]
        self.step_shape = (len(self.requests), 0)
        threading.Event().wait()  # forever

    LLMEngine.step = hanging_step  # type: ignore[method-assign]


if __name__ == "__main__":
    if os.environ.get("PAGEDSERVE_TEST_FAULT") == "hang":
        inject_hang()
    else:
        inject_fault(int(os.environ["PAGEDSERVE_TEST_FAULT_AFTER"]))
    sys.exit(cli.main(sys.argv[1:]))
