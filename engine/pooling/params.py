"""What one pooling request asks for beyond its tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    # Keep only the first `dimensions` values (renormalized when the model normalizes); only for
    # models that declare they support it. None: the whole embedding.
    dimensions: int | None = None
