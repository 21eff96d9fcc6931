"""Pooling models: how a checkpoint reduces hidden states to one vector (`PoolerSpec`), what a
request may ask of it (`PoolingParams`), and the reduction itself (`pool`)."""

from engine.pooling.params import PoolingParams
from engine.pooling.pooler import pool
from engine.pooling.spec import PoolerSpec, resolve_pooler

__all__ = ["PoolerSpec", "PoolingParams", "pool", "resolve_pooler"]
