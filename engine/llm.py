"""The offline API, shaped like vLLM's: `LLM(model=None, **config).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.processing.tokenization import encode_chat
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

Prompt = str | list[int]
Message = dict[str, object]


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        # What the engine measured during the last generate() call (preemptions, prefix-cache
        # hits, latencies): offline runs publish no metrics, so this is where they can be read.
        self.last_run_stats = EngineStats()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel worker processes and leave the process group, if any, so that
        another tensor-parallel `LLM` can start in this process; a second call does nothing.
        Dropping the last reference to this `LLM` (or leaving its `with` block) does the same."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. All prompts are validated before any runs.
        `priority` (one per prompt, lower first) needs `scheduling_policy="priority"`."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            batch: list[Prompt] = [cast(Prompt, prompts)]  # one prompt: text or token ids
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(batch)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(batch)
        if len(priorities) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(priorities)} priorities")
        token_ids = [self.engine.tokenize(prompt) for prompt in batch]
        # Every prompt checked before any is queued: one bad prompt fails the call, not a step.
        checked = [
            self.engine.check(ids, p, rank) for ids, p, rank in zip(token_ids, params, priorities)
        ]
        request_ids = [
            self.engine.add_request(prompt, p, prompt_token_ids=t, checked=c, priority=rank)
            for prompt, p, t, c, rank in zip(batch, params, token_ids, checked, priorities)
        ]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    final[output.request_id] = output
        self.last_run_stats = self.engine.take_stats()
        return [final[i] for i in request_ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = (
            [messages]
            if messages and isinstance(messages[0], dict)
            else cast(list[list[Message]], messages)
        )
        prompts = [self.render_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return encode_chat(self.tokenizer, messages, add_generation_prompt)
