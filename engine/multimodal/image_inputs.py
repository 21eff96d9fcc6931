"""What the engine does with images outside a step: expands a prompt's placeholders into its
images' spans (timed, for the metrics), checks that a request's images can be served, and
counts the encoder cache's work for the stats. One per vision-language engine."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import MultiModalInputs
from engine.multimodal.processing import ImageProcessing, expand_images
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


class ImageInputs:
    def __init__(self, processing: ImageProcessing, cache: EncoderCache, chunk_limit: int) -> None:
        self.processing = processing
        self.cache = cache  # the scheduler's: it plans each step's encoding with it
        self.chunk_limit = chunk_limit  # a step's token budget
        # Preprocessing times, appended by whichever thread expands a prompt's images.
        self._preprocessing: deque[float] = deque()
        self._counts_taken = (0, 0, 0)

    def expand(
        self, prompt_ids: list[int], images: Sequence[Any]
    ) -> tuple[list[int], MultiModalInputs]:
        """Thread-safe (the server runs it off the event loop)."""
        started = time.perf_counter()
        expanded = expand_images(self.processing, prompt_ids, images)
        self._preprocessing.append(time.perf_counter() - started)
        return expanded

    def check(self, mm: MultiModalInputs, params: SamplingParams) -> None:
        """Images a request cannot be served with (InvalidRequestError); thread-safe."""
        if params.use_beam_search:
            raise InvalidRequestError(
                "beam search is not served for prompts with images", "use_beam_search"
            )
        self.cache.check_fits(mm, self.chunk_limit)

    def record(self, stats: EngineStats) -> None:
        """The encoder cache's lookups, hits and encodings, and the preprocessing times, since
        the previous call."""
        counts = (self.cache.queries, self.cache.hits, self.cache.encoded)
        taken, self._counts_taken = self._counts_taken, counts
        stats.mm_cache_queries, stats.mm_cache_hits, stats.mm_images_encoded = (
            now - before for now, before in zip(counts, taken, strict=True)
        )
        while self._preprocessing:
            stats.mm_preprocessing_seconds.append(self._preprocessing.popleft())
