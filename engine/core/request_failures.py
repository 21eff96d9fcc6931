"""One request's failure inside a step stays that request's.

The step's per-request work (sampling a row, applying a token, detokenizing, a beam group's
step) runs through `RequestFailures.run`: an exception there is logged and kept against the
request, whose later work in the same step is skipped; the engine ends the request with
finish_reason "error" at the end of the step, and every other request goes on. What cannot be
blamed on one request (the model's forward pass, the scheduler) still stops the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RequestFailures:
    """The requests that raised during one step, each with its first exception."""

    errors: dict[str, Exception] = field(default_factory=dict)

    def run(self, request_id: str, work: Callable[[], T]) -> T | None:
        """`work()` for one request; None (and the request marked failed) if it raises, or if
        the request already failed in this step."""
        if request_id in self.errors:
            return None
        try:
            return work()
        except Exception as exc:  # noqa: BLE001 - any failure of one request ends only that one
            self.add(request_id, exc)
            return None

    def add(self, request_id: str, exc: Exception) -> None:
        if request_id not in self.errors:
            log.error(
                "request %s failed in the engine step; it ends with an error, the others go on",
                request_id,
                exc_info=exc,
            )
            self.errors[request_id] = exc

    def failed(self, request_id: str) -> bool:
        return request_id in self.errors

    def __bool__(self) -> bool:
        return bool(self.errors)


def describe(exc: BaseException) -> str:
    """What a client is told: the kind of failure, not the engine's internals."""
    return f"the engine failed this request ({type(exc).__name__}); other requests are unaffected"
