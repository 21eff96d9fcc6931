"""Compute kernels and their dispatch: attention backends and the paged KV store."""
