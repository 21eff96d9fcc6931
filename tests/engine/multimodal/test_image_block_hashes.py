"""Prefix-cache block hashes carry the images their tokens stand for: the same placeholder
tokens with another image never hit, the text before the image still does, and KV events
say which images each stored block covers (vLLM's `extra_keys`)."""

from __future__ import annotations

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.kv_events.events import BlockStored
from engine.multimodal.inputs import ImageItem, MultiModalInputs
from engine.sampling_params import SamplingParams

BLOCK = 4
IMAGE = 99  # the placeholder token of every image


def sequence(seq_id: str, image: bytes) -> Sequence:
    # Two text blocks, an image over positions 8..13 (two blocks and a half), text after.
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, *[IMAGE] * 6, 9, 10, 11, 12, 13]
    item = ImageItem(image, 8, 6, tuple(range(6)), {"pixel_values": torch.zeros(1)})
    return Sequence(seq_id, seq_id, 0, tokens, SamplingParams(), 0.0, mm=MultiModalInputs((item,)))


def test_another_image_hits_only_the_text_before_it() -> None:
    kv = KVCacheManager(32, BLOCK, enable_caching=True, record_events=True)
    first = sequence("a", b"image-one")
    assert kv.allocate_slots(first, first.num_tokens) is not None
    kv.free(first)
    same, other = sequence("b", b"image-one"), sequence("c", b"image-two")
    # Full blocks before the last token: all 4 for the same image, the 2 text ones for another.
    assert len(kv.get_computed_blocks(same)) == 4
    assert len(kv.get_computed_blocks(other)) == 2


def test_stored_blocks_name_their_images() -> None:
    kv = KVCacheManager(32, BLOCK, enable_caching=True, record_events=True)
    seq = sequence("a", b"image-one")
    kv.allocate_slots(seq, seq.num_tokens)
    (stored,) = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    key = b"image-one".hex()
    # Blocks 0-1 are text, 2-3 hold the image's positions 8..13 (block 3 also text after it).
    assert stored.extra_keys == [None, None, [key], [key]]


def test_text_prompts_hash_as_before_and_store_no_extra_keys() -> None:
    kv = KVCacheManager(32, BLOCK, enable_caching=True, record_events=True)
    seq = Sequence("t", "t", 0, list(range(1, 13)), SamplingParams(), 0.0)
    kv.allocate_slots(seq, seq.num_tokens)
    (stored,) = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert stored.extra_keys is None
