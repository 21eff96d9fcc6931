"""Paged attention backends behind one interface."""

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from kernels.attention.selector import select_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "select_attention_backend"]
