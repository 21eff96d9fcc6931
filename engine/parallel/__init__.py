"""Tensor parallelism: which slice of every layer a rank holds, the collectives the layers call,
the compact form a step's batch travels in, and the worker processes of ranks 1..N-1."""
