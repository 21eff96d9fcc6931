"""The state of one sequence as it moves through the scheduler.

A request with n > 1 samples becomes n sequences: the first one prefills the prompt, and at the
step its prompt completes, the other n - 1 fork from it, sharing its KV blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.lora.request import LoRARequest
from engine.multimodal.inputs import MultiModalInputs
from engine.outputs import PositionLogprobs
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured import GrammarState


class BeamRows(Protocol):
    """What the scheduler asks of a beam's group (engine/core/beam_search.py)."""

    def drop_row(self, seq: Sequence) -> None:
        """The beam is preempted: the logits row it handed in will be recomputed."""

    def seats_to_come(self) -> int:
        """Beams the group may still fork before it is at its width."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    AWAITING_FORK = "awaiting_fork"  # a sibling sample waiting for its prompt's prefill
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str  # unique per sequence: "<request id>" for sample 0, "<request id>#<i>" otherwise
    request_id: str  # the user's request it samples for
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower is scheduled first under the priority policy
    eos_token_id: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Scheduled in steps whose results are not applied yet (async scheduling plans the next
    # step while one runs): their tokens, and the sampled tokens they will append.
    num_inflight_tokens: int = 0
    num_pending_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    # Waiting for KV room: since when (refused blocks at the head of the queue, or preempted),
    # and how long in all before this.
    kv_wait_since: float | None = None
    kv_wait: float = 0.0
    last_token_time: float | None = None  # when this sample's latest token was sampled
    generator: torch.Generator | None = None
    forks: list[Sequence] = field(default_factory=list)
    grammar: GrammarState | None = None  # where a structured output has got to
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    # Filled chunk by chunk while the prompt is first computed (for echo); None when not asked.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # A pooling request: scheduled whole in one step, finished by it (no tokens sampled).
    pooling: PoolingParams | None = None
    # The beam search this sequence is a beam of: it hands its logits row to the group
    # instead of sampling. None for every other request.
    beam: BeamRows | None = None
    # The LoRA adapter the sequence runs under; None: the base model.
    lora: LoRARequest | None = None
    # Guesses of the tokens after its last one (speculative decoding), verified by its next
    # step; consumed when that step is scheduled.
    spec_token_ids: list[int] = field(default_factory=list)
    # The prompt's images (their spans hold placeholder tokens); None for a text prompt.
    mm: MultiModalInputs | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_planned_computed(self) -> int:
        """Tokens computed once the steps already scheduled have run."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_planned_tokens(self) -> int:
        """Tokens the sequence will have once the steps already scheduled have sampled."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: such a sequence must run its whole prompt (no cache hits)."""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def kv_wait_until(self, now: float) -> float:
        """Seconds this sequence has waited for KV room, counting a wait still going on."""
        ongoing = 0.0 if self.kv_wait_since is None else now - self.kv_wait_since
        return self.kv_wait + ongoing

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first `num_output_tokens` generated tokens (a stop string ended the
        text at one of several tokens taken in one step)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - drop :]
        if self.logprobs is not None:
            del self.logprobs[num_output_tokens:]
