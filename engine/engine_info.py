"""What a caller may know about a running engine, fixed at start-up, and the request checks that
need nothing else: both are safe to use from any thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError
from engine.pooling import PoolerSpec, PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the server reads this module: it need not import the loading code)
    from config import EngineConfig
    from engine.loading.model_spec import ModelSpec

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class EngineInfo:
    model: str | None  # the model as configured (None: the bundled default)
    model_path: str  # the folder the weights were loaded from
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    block_size: int  # tokens per KV block
    num_kv_blocks: int  # the KV pool's size
    scheduling_policy: str = "fcfs"
    # Set when the engine pools (embeddings) instead of generating.
    pooler: PoolerSpec | None = None
    max_num_batched_tokens: int = 2048  # a pooled input runs whole within one step's budget
    max_loras: int | None = None  # LoRA slots (--max-loras); None: LoRA is off
    # Tokens guessed per sequence and step (--speculative-config); None: no speculation.
    num_speculative_tokens: int | None = None
    # The model reads images in its prompts (a vision-language model).
    accepts_images: bool = False
    kv_offload_tiers: tuple[str, ...] = ()  # the KV offload tiers on: 'host', 'disk'

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        spec: ModelSpec,
        tokenizer: PreTrainedTokenizerBase,
        num_kv_blocks: int,
    ) -> EngineInfo:
        """What an engine started with `config` on the model `spec` resolved serves."""
        drafting = config.scheduler.speculative_config
        return cls(
            model=config.model.model,
            model_path=str(spec.path),
            tokenizer=tokenizer,
            max_model_len=spec.max_model_len,
            vocab_size=spec.vocab_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            block_size=spec.block_size,
            num_kv_blocks=num_kv_blocks,
            scheduling_policy=config.scheduler.scheduling_policy,
            pooler=spec.pooler,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            num_speculative_tokens=drafting.num_speculative_tokens if drafting else None,
            accepts_images=spec.multimodal,
            kv_offload_tiers=config.kv_offload.tiers,
        )

    @property
    def runner(self) -> str:
        return "generate" if self.pooler is None else "pooling"

    def check_generates(self) -> None:
        if self.pooler is not None:
            raise InvalidRequestError(
                "this model embeds (it was started with --runner pooling): it serves "
                "/v1/embeddings, /v1/score and /v1/rerank, not text generation",
                "model",
            )

    def validate_pooling(
        self, prompt_ids: list[int], params: PoolingParams, field: str = "input"
    ) -> None:
        """What would make a pooling request fail inside a step; `field` names the request's
        input field in the error."""
        if self.pooler is None:
            raise InvalidRequestError(
                "this model generates text: embeddings need a server started with "
                "--runner pooling on an embedding model",
                "model",
            )
        if not prompt_ids:
            raise InvalidRequestError("the input must not be empty", field)
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", field
            )
        limit = min(self.max_model_len, self.max_num_batched_tokens)
        if len(prompt_ids) > limit:
            which = (
                f"the model's window (max_model_len) is {self.max_model_len}"
                if limit == self.max_model_len
                else f"max_num_batched_tokens is {self.max_num_batched_tokens}"
            )
            raise InvalidRequestError(
                f"the input has {len(prompt_ids)} tokens and {which}; shorten it or set "
                "truncate_prompt_tokens",
                field,
            )
        dims = params.dimensions
        if dims is not None:
            if not self.pooler.supports_truncation:
                raise InvalidRequestError(
                    "this model does not support dimensions (it declares no Matryoshka "
                    f"truncation); its embeddings have {self.pooler.dimensions}",
                    "dimensions",
                )
            if not 1 <= dims <= self.pooler.dimensions:
                raise InvalidRequestError(
                    f"dimensions must be between 1 and {self.pooler.dimensions}, got {dims}",
                    "dimensions",
                )

    def check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority other than 0 means nothing to a first-come server, so it is
        refused there rather than silently ignored."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} needs a server started with --scheduling-policy priority",
                "priority",
            )

    def _check_beam_room(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Preempted beams recompute apart (sharing only what the prefix cache still holds),
        so the pool must hold every beam at full length unshared, or a search could wait for
        room that never comes."""
        longest = self.max_model_len
        if params.max_tokens is not None:
            longest = min(longest, num_prompt_tokens + params.max_tokens)
        needed = params.n * -(-longest // self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                f"beam search with n={params.n} over {longest} tokens may need {needed} KV "
                f"blocks; the pool has {self.num_kv_blocks}",
                "n",
            )

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Everything that would make the request fail inside a step is rejected here. Reads
        only this frozen info, so the event loop may call it while the engine thread steps."""
        self.check_generates()
        if not prompt_ids:
            raise InvalidRequestError("the prompt must not be empty", "prompt")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", "prompt"
            )
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate",
                "prompt",
            )
        params.validate()
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}", "n")
        if params.use_beam_search:
            self._check_beam_room(len(prompt_ids), params)
        for name, value in (
            ("logprobs", params.logprobs),
            ("prompt_logprobs", params.prompt_logprobs),
        ):
            if value is not None and value > MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"{name} must be at most {MAX_LOGPROBS}, got {value}", name
                )
        for name, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= int(t) < vocab]
            if bad:
                raise InvalidRequestError(
                    f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})", name
                )
