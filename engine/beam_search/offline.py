"""The offline beam search API, shaped like vLLM's: `LLM.beam_search(prompts, BeamSearchParams)`
returns one `BeamSearchOutput` per prompt, its `beam_width` best sequences best first."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # beam search ranks raw logprobs: anything else is refused
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # transformers' meaning: True, False (stop when no running beam can beat the finished
    # ones, by a heuristic) or "never" (the same, with the length penalty's best case).
    early_stopping: bool | str = False
    stop_token_ids: list[int] = field(default_factory=list)

    def to_sampling_params(self) -> SamplingParams:
        """The engine-facing form (validated there): n is the beam width."""
        return SamplingParams(
            n=self.beam_width,
            use_beam_search=True,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            stop_token_ids=list(self.stop_token_ids),
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the generated ones (vLLM's layout)
    output_token_ids: list[int]
    text: str
    cum_logprob: float  # sum of the generated tokens' logprobs
    score: float  # cum_logprob / len(output_token_ids) ** length_penalty: the ranking key
    finish_reason: str  # "stop" (EOS or a stop token id) or "length"
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
