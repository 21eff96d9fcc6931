"""Beam search in the engine's step: each beam hands its last logits row to its request's
group (engine/core/beam_search.py); a group with every row in takes its beam step; a search
answers once, at its end, with its hypotheses."""

from __future__ import annotations

import time
from functools import partial

import torch
from transformers import PreTrainedTokenizerBase

from engine.core.beam_search import BeamGroup, beam_group_for
from engine.core.request_failures import RequestFailures
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.processing.request import Request
from engine.sampling_params import SamplingParams
from engine.stats_recorder import StatsRecorder


class BeamSearches:
    """The beam searches among the engine's requests: `requests` is the engine's table, which
    a search leaves when it ends."""

    def __init__(
        self,
        requests: dict[str, Request],
        scheduler: Scheduler,
        recorder: StatsRecorder,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        speculating: bool,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.recorder = recorder
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.speculating = speculating

    def check(self, params: SamplingParams) -> None:
        """A beam search this engine cannot run (InvalidRequestError)."""
        if params.use_beam_search and self.speculating:
            raise InvalidRequestError(
                "beam search does not run with speculative decoding (--speculative-config)",
                "use_beam_search",
            )

    def start(self, root: Sequence) -> BeamGroup:
        """The group of a new search: `root` is its one sequence, whose beams the group forks."""
        return beam_group_for(root, self.vocab_size, self.max_model_len)

    def any_running(self) -> bool:
        """A beam search is running or waiting: its steps run alone (async scheduling)."""
        return any(r.beam is not None for r in self.requests.values())

    def step(
        self,
        out: SchedulerOutput,
        logits_rows: list[tuple[int, int]],
        logits: torch.Tensor,
        failures: RequestFailures,
    ) -> list[RequestOutput]:
        """Hand each beam's last row to its group; a group with every row in takes its beam
        step; a group that is done answers with its hypotheses."""
        outputs = []
        now = time.time()
        for s, (first, count) in zip(out.scheduled, logits_rows):
            if not s.beam_row:  # (another request may have finished and left this step)
                continue
            if failures.failed(s.seq.request_id):
                continue
            request = self.requests[s.seq.request_id]
            group = request.beam
            if group is None or not group.take_row(s.seq, logits[first + count - 1]):
                continue
            stepped = len(group.beams)  # each live beam generated a token this step
            first_token = request.first_token_time is None
            failures.run(request.request_id, partial(group.advance, self.scheduler))
            if failures.failed(request.request_id):
                continue
            self.recorder.token(request, group.root, now, count=stepped)
            if group.done:
                outputs.append(self.output(request, group))
                self.recorder.finished(request, now)
                del self.requests[request.request_id]
            elif first_token:
                # A search answers only at its end, but it has started: say so with an output
                # of no choices, which ends its wait in the server's admission queue (whose
                # --max-queue-time would otherwise drop a search longer than it).
                outputs.append(
                    RequestOutput(
                        request_id=request.request_id,
                        prompt=request.prompt,
                        prompt_token_ids=request.prompt_token_ids,
                        outputs=[],
                        finished=False,
                        num_cached_tokens=group.root.num_cached_tokens,
                    )
                )
        return outputs

    def output(self, request: Request, group: BeamGroup) -> RequestOutput:
        """The search's answer: its hypotheses finished so far, best first."""
        params = group.root.params
        outputs = []
        for i, hyp in enumerate(group.finished):
            # As for sampling, a stop token ends the text without being shown.
            shown = hyp.token_ids[:-1] if hyp.finish_reason == "stop" else hyp.token_ids
            text = str(self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens))
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(hyp.token_ids),
                    finish_reason=hyp.finish_reason,
                    stop_reason=hyp.stop_reason,
                    text_delta=text,
                    token_ids_delta=list(hyp.token_ids),
                    cumulative_logprob=hyp.cumulative_logprob,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=True,
            num_cached_tokens=group.root.num_cached_tokens,
        )
