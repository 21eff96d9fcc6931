"""The user's request as the engine holds it: its prompt, its n sequences and their texts."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.beam_search import BeamGroup
from engine.core.sequence import Sequence
from engine.processing.detokenizer import IncrementalDetokenizer


@dataclass
class SequenceText:
    """The text of one sample and how much of it has been handed out."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0


@dataclass
class Request:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence]
    texts: list[SequenceText] = field(default_factory=list)
    # Engine timestamps (time.time()) for the latency metrics.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    beam: BeamGroup | None = None  # a beam search's state (its beams live in the group)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)
