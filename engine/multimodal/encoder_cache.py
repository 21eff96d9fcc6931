"""Which images' encoder outputs the model runner holds, and which images each step encodes.

The scheduler side only counts: the runner keeps the tensors, encodes what a step lists and
drops what `take_evicted` names. An image's output is referenced by every sequence whose next
chunks still read its span, and is evicted (least recently used first) only once none does;
the cache's size is in embedding rows, and so is the per-step encoder budget.

A chunk that reaches an image whose output is not cached encodes it whole in that step, if
the step's budget and the cache have room for it; else the chunk stops before the image and
the sequence goes on in a later step. An image larger than the whole cache is refused when
its request arrives (`check_fits`), so nothing waits for room that can never be.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.multimodal.inputs import ImageItem, MultiModalInputs


@dataclass
class EncoderPlan:
    """What a sequence's chunk needs of the encoder: images to encode in this step, and every
    image of the chunk (to reference until the sequence is past them)."""

    encode: list[ImageItem] = field(default_factory=list)
    read: list[ImageItem] = field(default_factory=list)


class EncoderCache:
    def __init__(self, capacity: int, whole_spans: bool = False) -> None:
        self.capacity = capacity  # embedding rows
        # The model's image tokens attend to each other both ways (Gemma 3): a span is computed
        # in one chunk, never begun in one step and finished in another.
        self.whole_spans = whole_spans
        self.rows: OrderedDict[bytes, int] = OrderedDict()  # cached outputs, least recent first
        self.readers: dict[bytes, set[str]] = {}  # hash -> sequences still to read it
        self.evicted: list[bytes] = []  # since the runner last took them
        # Counted for the metrics, from the start: images a chunk reached, those found cached,
        # and those encoded.
        self.queries = 0
        self.hits = 0
        self.encoded = 0

    @property
    def used(self) -> int:
        return sum(self.rows.values())

    def check_fits(self, mm: MultiModalInputs, chunk_limit: int) -> None:
        """Refuse an image the cache can never hold, or (whole spans) whose span no chunk of
        `chunk_limit` tokens can hold."""
        for index, item in enumerate(mm.items):
            if self.whole_spans and item.length > chunk_limit:
                raise InvalidRequestError(
                    f"image {index} takes {item.length} prompt tokens, computed in one step: "
                    f"more than a step's budget ({chunk_limit}, --max-num-batched-tokens)",
                    param="multi_modal_data",
                )
            if item.num_embeds > self.capacity:
                raise InvalidRequestError(
                    f"image {index} needs {item.num_embeds} encoder rows, more than the encoder "
                    f"cache holds ({self.capacity}, --encoder-cache-size)",
                    param="multi_modal_data",
                )

    def room_for(self, rows: int) -> bool:
        """Room for `rows` more once every unreferenced output is evicted."""
        pinned = sum(n for h, n in self.rows.items() if self.readers.get(h))
        return pinned + rows <= self.capacity

    def plan(
        self, mm: MultiModalInputs, start: int, num_new: int, budget: int, planned: set[bytes]
    ) -> tuple[int, EncoderPlan]:
        """How many of the `num_new` tokens from `start` can run this step, and what they
        need: the chunk stops before the first image that is neither cached nor planned
        (`planned`: hashes this step encodes already) and does not fit `budget` rows and the
        cache's room."""
        plan = EncoderPlan()
        for item in mm.items_in(start, start + num_new):
            plan.read.append(item)
            if item.hash in self.rows or item.hash in planned:
                continue
            rows = item.num_embeds + sum(i.num_embeds for i in plan.encode)
            if rows > budget or not self.room_for(rows):
                plan.read.pop()
                return max(0, item.offset - start), plan
            plan.encode.append(item)
        if self.whole_spans:
            for item in plan.read:
                if item.end > start + num_new:  # the chunk would end inside the span
                    cut = plan.read.index(item)
                    plan.encode = [i for i in plan.encode if i in plan.read[:cut]]
                    plan.read = plan.read[:cut]
                    return max(0, item.offset - start), plan
        return num_new, plan

    def whole_span_start(self, mm: MultiModalInputs, cached: int) -> int:
        """Where a sequence may begin computing, given `cached` prompt tokens found in the
        prefix cache: never inside a span that must be computed whole (the hit stops before
        it)."""
        if not self.whole_spans:
            return cached
        for item in mm.items:
            if item.offset < cached < item.end:
                return item.offset
        return cached

    def commit(self, seq_id: str, plan: EncoderPlan) -> None:
        """The chunk was scheduled: its new images take room (evicting what no one reads), and
        it reads all of its images until it is past them."""
        for item in plan.read:
            self.queries += 1
            if item.hash in self.rows:
                self.hits += 1
                self.rows.move_to_end(item.hash)
            self.readers.setdefault(item.hash, set()).add(seq_id)
        for item in plan.encode:
            self.encoded += 1
            self._evict_for(item.num_embeds)
            self.rows[item.hash] = item.num_embeds

    def _evict_for(self, rows: int) -> None:
        for key in list(self.rows):
            if self.used + rows <= self.capacity:
                return
            if not self.readers.get(key):
                del self.rows[key]
                self.readers.pop(key, None)
                self.evicted.append(key)

    def passed(self, seq_id: str, mm: MultiModalInputs, computed: int) -> None:
        """The sequence has computed `computed` tokens: it reads no image before them again."""
        for item in mm.items:
            if item.end <= computed:
                self._unread(item.hash, seq_id)

    def release(self, seq_id: str, mm: MultiModalInputs) -> None:
        """The sequence finished or was preempted: it reads none of its images (for now)."""
        for item in mm.items:
            self._unread(item.hash, seq_id)

    def _unread(self, key: bytes, seq_id: str) -> None:
        readers = self.readers.get(key)
        if readers is not None:
            readers.discard(seq_id)

    def drop(self, items: list[ImageItem]) -> None:
        """Outputs planned by a step that will not run: never computed, so not cached."""
        for item in items:
            if self.rows.pop(item.hash, None) is not None:
                self.evicted.append(item.hash)

    def take_evicted(self) -> list[bytes]:
        evicted, self.evicted = self.evicted, []
        return evicted
