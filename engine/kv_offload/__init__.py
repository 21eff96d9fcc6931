"""KV offload tiers: full KV blocks copied out of the paged pool after the step that wrote
them (write-through), kept in host memory and on a local disk, and copied back into pool
blocks when a later prompt's prefix finds them (engine/core/kv_cache_manager.py asks after its
own prefix lookup). Blocks are named by keys stable across processes, so the disk tier
survives a restart."""

from engine.kv_offload.connector import KVOffloadConnector
from engine.kv_offload.setup import check_kv_offload, make_kv_offload

__all__ = ["KVOffloadConnector", "check_kv_offload", "make_kv_offload"]
