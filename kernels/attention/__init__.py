"""Paged attention backends behind one interface."""

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from kernels.attention.selector import AttentionChoice, Platform, build_backend, choose

__all__ = [
    "AttentionBackend",
    "AttentionChoice",
    "AttentionMetadata",
    "Platform",
    "build_backend",
    "choose",
]
