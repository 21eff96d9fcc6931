"""The offline API, shaped like vLLM's: `LLM(model=None, **config).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from transformers import PreTrainedTokenizerBase

from config import EngineConfig
from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.core.beam_search import length_divisor
from engine.errors import RequestFailedError
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.multimodal.inputs import MultiModalInputs
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling import PoolingParams
from engine.processing.prompt_inputs import PlainPrompt, PromptType, as_prompt_batch
from engine.processing.tokenization import encode_chat, pooling_tokens, truncation
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

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
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. All prompts are validated before any runs. A prompt
        is a text, a list of token ids, `{"prompt": text}` or `{"prompt_token_ids": ids}`.
        `priority` (one per prompt, lower first) needs `scheduling_policy="priority"`.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); needs `enable_lora=True`. A prompt dict may carry images
        (`"multi_modal_data": {"image": ...}`) for a vision-language model; its text or
        tokens then hold one image placeholder per image."""
        images: list[list[Any]] = []
        batch = as_prompt_batch(prompts, images)
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
        loras: list[LoRARequest | None] = (
            [lora_request] * len(batch)
            if lora_request is None or isinstance(lora_request, LoRARequest)
            else list(lora_request)
        )
        if len(loras) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(loras)} LoRA requests")
        token_ids: list[list[int]] = []
        multi_modal: list[MultiModalInputs | None] = []
        for prompt, shown in zip(batch, images):
            if shown:
                ids, mm = self.engine.expand_images(prompt, shown)
                token_ids.append(ids)
                multi_modal.append(mm)
            else:
                token_ids.append(self.engine.tokenize(prompt))
                multi_modal.append(None)
        # Every prompt checked before any is queued: one bad prompt fails the call, not a step.
        checked = [
            self.engine.check(ids, p, rank, mm)
            for ids, p, rank, mm in zip(token_ids, params, priorities, multi_modal)
        ]
        for adapter in {lora for lora in loras if lora is not None}:  # each read once, here
            self.engine.add_lora(adapter)
        request_ids = [
            self.engine.add_request(
                prompt,
                p,
                prompt_token_ids=t,
                checked=c,
                priority=rank,
                lora_request=lora,
                lora_read=True,
                multi_modal=mm,
            )
            for prompt, p, t, c, rank, lora, mm in zip(
                batch, params, token_ids, checked, priorities, loras, multi_modal
            )
        ]
        return cast(list[RequestOutput], self._run(request_ids))

    def _run(self, request_ids: list[str]) -> list[RequestOutput | PoolingRequestOutput]:
        final: dict[str, RequestOutput | PoolingRequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    final[output.request_id] = output
        self.last_run_stats = self.engine.take_stats()
        return [final[i] for i in request_ids]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), in order, all batched by the
        scheduler; needs a pooling engine (`runner="pooling"`, or an encoder model).
        `truncate_prompt_tokens`: keep at most that many tokens (-1: the model's window)."""
        batch = as_prompt_batch(prompts)
        params = pooling_params or PoolingParams()
        token_ids = [self._pooling_tokens(p, truncate_prompt_tokens) for p in batch]
        for ids in token_ids:  # every input checked before any is queued
            self.engine.info.validate_pooling(ids, params, "prompts")
        request_ids = [
            self.engine.add_pooling_request(prompt, params, prompt_token_ids=ids, checked=True)
            for prompt, ids in zip(batch, token_ids)
        ]
        return cast(list[PoolingRequestOutput], self._run(request_ids))

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
    ) -> list[float]:
        """Cosine similarity of each pair's embeddings (one text against many, or pairwise)."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise ValueError(f"{len(first)} first texts for {len(second)} second texts")
        outs = self.embed([*first, *second], truncate_prompt_tokens=truncate_prompt_tokens)
        vectors = []
        for o in outs:
            assert o.outputs is not None, "only an aborted request has no embedding"
            vectors.append(o.outputs.data)
        n = len(first)
        return [
            float(torch.nn.functional.cosine_similarity(a, b, dim=0))
            for a, b in zip(vectors[:n], vectors[n:])
        ]

    def _pooling_tokens(self, prompt: PlainPrompt, truncate: int | None) -> list[int]:
        count = truncation(truncate, self.engine.max_model_len)
        return pooling_tokens(self.tokenizer, prompt, count)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """One output per prompt, in order: the `beam_width` best sequences, best first (by
        cumulative logprob / generated length ** length_penalty). Prompts take the shapes
        `generate` takes, vLLM's `{"prompt": text}` and `{"prompt_token_ids": ids}` among them."""
        outputs = self.generate(prompts, params.to_sampling_params())
        results = []
        for out in outputs:
            if out.error is not None:
                raise RequestFailedError(out.error)
            sequences = []
            for o in out.outputs:
                cum = o.cumulative_logprob
                assert cum is not None  # a beam search output always carries it
                stop = o.stop_reason if isinstance(o.stop_reason, int) else None
                sequences.append(
                    BeamSearchSequence(
                        tokens=[*out.prompt_token_ids, *o.token_ids],
                        output_token_ids=list(o.token_ids),
                        text=o.text,
                        cum_logprob=cum,
                        score=cum / length_divisor(len(o.token_ids), params.length_penalty),
                        finish_reason=o.finish_reason or "length",
                        stop_reason=stop,
                    )
                )
            results.append(BeamSearchOutput(sequences))
        return results

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
