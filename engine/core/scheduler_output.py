"""What the scheduler hands the step, and what the step hands back: the runners read these
types without importing the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.multimodal.inputs import ImageItem
from engine.outputs import PositionLogprobs


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    block_table: list[int]
    # The first position the step computes (the sequence's planned computed tokens).
    start: int = 0
    # Who samples a token from this sequence's last row: nobody while its prompt is still
    # being chunked; else the sequence, then the siblings that fork from it at this step.
    samplers: list[Sequence] = field(default_factory=list)
    # A beam whose last row goes to its beam group instead of a sampler.
    beam_row: bool = False
    # Guessed tokens computed after the sequence's last one (speculative decoding): each of
    # their rows is verified, and the first token the target disagrees with ends them.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_real_tokens(self) -> int:
        """The tokens computed that are the sequence's own (all but the drafts)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def samples_token(self) -> bool:
        return bool(self.samplers)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    has_beam_rows: bool = False  # some scheduled beam completes its row this step
    # Images the step encodes (their outputs enter the encoder cache), and the cached outputs
    # evicted since the step before (the runner drops them).
    encoder_inputs: list[ImageItem] = field(default_factory=list)
    encoder_evicted: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def samplers(self) -> list[Sequence]:
        """Every sequence that samples a token this step, in the order of its logits row."""
        return [seq for s in self.scheduled for seq in s.samplers]


@dataclass
class Sample:
    """One sampled token, with its logprobs when the request asked for them."""

    token_id: int
    logprobs: PositionLogprobs | None
