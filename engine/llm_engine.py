"""The engine: requests in, one scheduled step at a time, outputs out. Not thread-safe: one
thread (the engine thread) drives it."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from config import ConfigError, EngineConfig
from engine.async_scheduling import AppliedStep, PlannedStep, StepPipeline
from engine.async_scheduling.choice import use_async_scheduling
from engine.beam_search.steps import BeamSearches
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request_failures import RequestFailures, describe
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import Sample, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from engine.engine_info import EngineInfo
from engine.errors import InvalidRequestError
from engine.kv_events.publisher import KVEventPublisher
from engine.kv_events.wire import CacheSpec
from engine.kv_offload import KVOffloadConnector, check_kv_offload
from engine.loading.model_spec import ModelSpec, resolve_model_spec
from engine.loading.resolve import load_tokenizer
from engine.lora.adapters import LoRAAdapters
from engine.lora.checkpoint import LoRALoadError
from engine.lora.request import LoRARequest
from engine.lora.slots import PlacedAdapter
from engine.models.registry import image_processing_of
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.image_inputs import ImageInputs
from engine.multimodal.inputs import MultiModalInputs
from engine.outputs import EngineOutput, PoolingRequestOutput
from engine.pooling import PoolingParams
from engine.pooling_requests import PoolingRequests
from engine.processing.detokenizer import IncrementalDetokenizer
from engine.processing.output_processor import failed_output, make_output, update_texts
from engine.processing.request import Request, SequenceText
from engine.processing.tokenization import encode
from engine.sampling_params import SamplingParams
from engine.spec_decode import draft_kv_bytes_per_block, make_speculator
from engine.stats import EngineStats
from engine.stats_recorder import StatsRecorder
from engine.structured import GrammarCompiler, GrammarState
from engine.worker.executor import LocalExecutor, TensorParallelExecutor
from engine.worker.kv_sizing import (
    CudaMemoryProbe,
    bookkeeping_blocks,
    fixed_pool_blocks,
    profiled_pool_blocks,
)
from engine.worker.model_input import build_step_batch
from engine.worker.sampler import Sampler
from engine.worker.step_sampling import record_prompt_logprobs, sample_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckedRequest:
    """A request its caller has validated, with its grammar (if any) compiled: `add_request`
    checks it no more."""

    grammar: Any  # an xgrammar.CompiledGrammar, or None without a structured output


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        spec = resolve_model_spec(config)
        self.spec = spec
        self.async_scheduling = use_async_scheduling(config, spec)  # refused before any load
        self.model_path = spec.path
        self.vocab_size = spec.vocab_size
        self.block_size = spec.block_size
        self.max_model_len = spec.max_model_len
        self.pooler = spec.pooler
        # A draft model's K/V lives in the same block ids: each block holds both.
        per_block = spec.kv_bytes_per_block + draft_kv_bytes_per_block(config, spec)
        encoder = spec.info.encoder
        if encoder:
            num_blocks: int | None = bookkeeping_blocks(config, self.max_model_len, self.block_size)
        else:
            full_batch = config.scheduler.max_num_seqs * -(-self.max_model_len // self.block_size)
            num_blocks = fixed_pool_blocks(
                config, per_block, spec.device.startswith("cuda"), full_batch
            )
        if num_blocks is not None:  # refused before anything starts
            config.check_kv_capacity(self.max_model_len, num_blocks, self.block_size)
        check_kv_offload(config, spec, draft_kv_bytes_per_block(config, spec))
        windows = spec.info.sliding_windows
        # Blocks can be freed behind the windows only when every layer has one.
        slide = None if None in windows else max(w for w in windows if w is not None)
        # Opened before anything heavy, so that a bad --kv-events-config endpoint fails fast.
        events = config.cache.kv_events_config
        self.kv_events: KVEventPublisher | None = None
        self.offload: KVOffloadConnector | None = None
        if events is not None and events.enabled:
            if not config.cache.enable_prefix_caching or self.pooler is not None:
                # Events describe the prefix cache: with none, a subscriber would wait forever.
                raise ConfigError(
                    "--kv-events-config: KV events describe the prefix cache, which is off here "
                    "(--no-enable-prefix-caching, or a pooling model)"
                )
            self.kv_events = KVEventPublisher(events, CacheSpec(self.block_size, slide))
        try:
            self._start(config, spec, num_blocks, slide, per_block)
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.close()  # its thread frees the port as it ends
            if self.offload is not None:
                self.offload.close()
            raise

    def _start(
        self,
        config: EngineConfig,
        spec: ModelSpec,
        num_blocks: int | None,
        slide: int | None,
        per_block: int,
    ) -> None:
        encoder = spec.info.encoder
        # The tokenizer is read here, where it is used: tensor-parallel workers never need it.
        self.tokenizer = load_tokenizer(spec.tokenizer_path)
        # Thread-safe: the server compiles a request's grammar here before queueing it.
        self.grammars = GrammarCompiler(
            partial(load_tokenizer, spec.tokenizer_path),
            spec.vocab_size,
            self.tokenizer.eos_token_id,
            config.structured,
        )
        multi_rank = spec.tensor_parallel_size > 1
        executor = TensorParallelExecutor if multi_rank else LocalExecutor
        self.executor: LocalExecutor | TensorParallelExecutor = executor(config, spec)
        try:
            if num_blocks is None:
                probe = CudaMemoryProbe(torch.device(spec.device))
                num_blocks = profiled_pool_blocks(
                    config,
                    per_block,
                    self.max_model_len,
                    self.block_size,
                    self.executor.execute,
                    probe,
                )
                config.check_kv_capacity(self.max_model_len, num_blocks, self.block_size)
            if not encoder:  # an encoder keeps no KV: its blocks are bookkeeping only
                self.executor.allocate_kv(num_blocks)
        except BaseException:
            self.executor.close()
            raise
        self.info = EngineInfo.of(config, spec, self.tokenizer, num_blocks)
        max_loras = self.info.max_loras
        if config.scheduler.speculative_config is not None and self.pooler is not None:
            raise ConfigError("--speculative-config: a pooling model generates no tokens")
        # A pooled input needs every position's hidden state: none may come from the cache.
        caching = config.cache.enable_prefix_caching and self.pooler is None
        self.offload = self.executor.kv_offload(config, spec)
        self.kv = KVCacheManager(
            num_blocks,
            self.block_size,
            caching,
            slide,
            record_events=self.kv_events is not None,
            offload=self.offload,
        )
        self.loras = LoRAAdapters(max_loras, self.executor) if max_loras is not None else None
        # Images in prompts: the model's processing (placeholders into spans) and the cache
        # of its encoder's outputs.
        self.images: ImageInputs | None = None
        encoder_cache = None
        processing = image_processing_of(spec.architecture)
        if processing is not None:
            image_processing = processing(spec.hf_config, spec.path, self.tokenizer)
            budget = config.scheduler.max_num_batched_tokens
            encoder_cache = EncoderCache(
                config.scheduler.encoder_cache_size or max(budget, 16384),
                whole_spans=image_processing.whole_spans,
            )
            self.images = ImageInputs(image_processing, encoder_cache, budget)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_loras, encoder_cache)
        self.sampler = Sampler(config.model.seed)
        self.speculator = make_speculator(config, spec, self.kv, num_blocks, self.executor)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._recorder = StatsRecorder()
        self.beams = BeamSearches(
            self.requests,
            self.scheduler,
            self._recorder,
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            speculating=self.speculator is not None,
        )
        self.pooling = PoolingRequests(self.requests, self.scheduler, self._recorder, spec.pooler)
        self.step_shape = (0, 0)  # (sequences, tokens) of the step now or last run
        self._pipeline: StepPipeline | None = None
        if self.async_scheduling:
            self._pipeline = StepPipeline(self, self.executor.execute, self.beams.any_running)
        log.info("async scheduling %s", "on" if self.async_scheduling else "off")

    # ----------------------------------------------------------------- requests in

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode(self.tokenizer, prompt)
        return list(prompt)

    def expand_images(
        self, prompt: str | list[int], images: list[Any]
    ) -> tuple[list[int], MultiModalInputs]:
        """The prompt's tokens with each image placeholder expanded into its image's span, and
        its images as the engine reads them (InvalidRequestError when they do not pair up or
        the model reads no images). Thread-safe: the server runs it off the event loop."""
        if self.images is None:
            raise InvalidRequestError(
                f"the model {self.info.model or self.model_path} reads no images: send text only",
                param="messages",
            )
        return self.images.expand(self.tokenize(prompt), images)

    def check_images(self, mm: MultiModalInputs | None, params: SamplingParams) -> None:
        """Images a request cannot be served with (InvalidRequestError); thread-safe."""
        if mm is not None and self.images is not None:
            self.images.check(mm, params)

    def check(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        mm: MultiModalInputs | None = None,
    ) -> CheckedRequest:
        """Everything that would make the request fail inside a step is rejected here
        (InvalidRequestError); its grammar, if any, compiles."""
        self.info.validate(prompt_ids, params)
        self.info.check_priority(priority)
        self.check_images(mm, params)
        self.beams.check(params)
        structured = params.structured_outputs
        return CheckedRequest(self.grammars.compile(structured) if structured else None)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        checked: CheckedRequest | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        lora_read: bool = False,
        multi_modal: MultiModalInputs | None = None,
    ) -> str:
        """Queue a request. `prompt_token_ids`, when given, is the tokenized `prompt` (a text
        prompt is then not tokenized again); `checked`, when given, says it was validated and
        holds its compiled grammar. `priority` orders it under --scheduling-policy priority
        (lower first). `lora_request`: the LoRA adapter it runs under (--enable-lora);
        `lora_read`: the caller has just read it with `add_lora`, so it is not read again.
        `multi_modal`: the prompt's images, `prompt_token_ids` then holding their spans
        (`expand_images`)."""
        request_id = self._new_request_id(request_id)
        if lora_request is not None and not lora_read:
            try:
                self.add_lora(lora_request)
            except LoRALoadError as exc:  # the request names the adapter by its `model`
                raise LoRALoadError(str(exc), param="model") from None
        prompt_ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        if checked is None:
            checked = self.check(prompt_ids, params, priority, multi_modal)
        arrival = time.time() if arrival_time is None else arrival_time
        structured, grammar = params.structured_outputs, checked.grammar
        sequences = []
        # A beam search starts with one sequence: its group forks the beams.
        for i in range(1 if params.use_beam_search else params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed((params.seed + i) % 2**64)
            sequences.append(
                Sequence(
                    seq_id=request_id if i == 0 else f"{request_id}#{i}",
                    request_id=request_id,
                    index=i,
                    prompt_token_ids=prompt_ids,
                    params=params,
                    arrival_time=arrival,
                    priority=priority,
                    eos_token_id=self.tokenizer.eos_token_id,
                    generator=generator,
                    status=SequenceStatus.WAITING if i == 0 else SequenceStatus.AWAITING_FORK,
                    grammar=None if structured is None else GrammarState(grammar, structured),
                    lora=lora_request,
                    mm=multi_modal,
                )
            )
        beam = self.beams.start(sequences[0]) if params.use_beam_search else None
        sequences[0].forks = sequences[1:]
        request = Request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_ids,
            sequences,
            [
                SequenceText(
                    IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                )
                for _ in sequences
            ],
            arrival_time=arrival,
            beam=beam,
        )
        self.requests[request_id] = request
        self.scheduler.add(sequences[0])
        return request_id

    def _new_request_id(self, request_id: str | None) -> str:
        """`request_id`, or a fresh one when None (InvalidRequestError if it is in use)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        return request_id

    def prepare_lora(self, request: LoRARequest) -> PlacedAdapter:
        """Read and check an adapter's files without keeping it (LoRALoadError): it touches no
        state a step changes, so it runs on any thread, and the engine's thread need never wait
        on a file (AsyncEngine.add_lora runs it on a thread of its own, then `add_lora`)."""
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters need --enable-lora", param="model")
        return self.executor.prepare_lora(request)

    def add_lora(self, request: LoRARequest, prepared: PlacedAdapter | None = None) -> None:
        """Read and check an adapter now, so that a bad one fails here and not inside a step
        (LoRALoadError); a checked one is kept on the host, up to --max-cpu-loras. `prepared`:
        what `prepare_lora` read, kept without reading the files again."""
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters need --enable-lora", param="model")
        self.loras.add(request, prepared)

    def remove_lora(self, request: LoRARequest) -> None:
        """Forget an adapter's host copy and slot; requests running under it still finish
        under it (a slot it needs again is reloaded from its folder), and it is forgotten
        when the last of them ends."""
        if self.loras is None:
            return
        self.loras.remove(request)
        self._finish_unloads()

    def _finish_unloads(self) -> None:
        """Drop every unloaded adapter that no request runs or waits under any more."""
        if self.loras is None or not self.loras.unloading:
            return
        busy = [seq.lora for seq in (*self.scheduler.running, *self.scheduler.waiting)]
        for name in self.loras.drop_unloaded(busy):
            self._recorder.unloaded_adapter(name)

    def add_pooling_request(
        self,
        prompt: str | list[int],
        params: PoolingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        checked: bool = False,
    ) -> str:
        """Queue an input to embed: one sequence, scheduled whole in one step (never chunked),
        finished by that step, its blocks back in the pool after it. `checked`: the caller ran
        `info.validate_pooling` on it already."""
        request_id = self._new_request_id(request_id)
        prompt_ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        if not checked:
            self.info.validate_pooling(prompt_ids, params)
        arrival = time.time() if arrival_time is None else arrival_time
        text = prompt if isinstance(prompt, str) else None
        self.pooling.add(request_id, text, prompt_ids, params, arrival)
        return request_id

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """Stop a request wherever it is and free its blocks; its last output, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._stop(request, "abort")
        self._recorder.finished(request, time.time())
        if request.beam is not None:  # the hypotheses finished so far, if any
            return self.beams.output(request, request.beam)
        self._finish_unloads()
        if request.sequences[0].pooling is not None:
            return PoolingRequestOutput(request_id, request.prompt_token_ids, None)
        return make_output(request)

    def _stop(self, request: Request, reason: str) -> None:
        """End every sequence of the request still going (a beam search's live beams too) with
        `reason`, its blocks back in the pool."""
        if request.beam is not None:
            request.beam.abort(self.scheduler, reason=reason)
        for seq in request.sequences:
            if not seq.is_finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_health(self) -> None:
        """Raise if the engine can no longer step (a tensor-parallel worker is gone)."""
        self.executor.check()

    def close(self) -> None:
        """Stop the worker processes, if any, and the KV event publisher; the engine cannot
        step afterwards."""
        if self._pipeline is not None:
            self._pipeline.close()
        if self.speculator is not None:
            self.speculator.close()
        self.executor.close()
        if self.offload is not None:
            self.offload.close()  # its queued disk writes land first
        if self.kv_events is not None:
            self.kv_events.close()

    # ----------------------------------------------------------------- one step

    def step(self) -> list[EngineOutput]:
        """Schedule, run the model, sample, let the scheduler apply the results, make outputs."""
        outputs = self._pipeline.step() if self._pipeline is not None else self.sync_step()
        self._finish_unloads()  # an unloaded adapter whose last request ended in this step
        return outputs

    def sync_step(self) -> list[EngineOutput]:
        """One step start to end: nothing runs before or after it."""
        step = self.plan_step()
        if not isinstance(step, PlannedStep):
            self._publish_kv_events()
            return step
        if self.pooler is not None:
            return list(self.pooling.finish(step.out, self.executor.embed(step.batch.host)))
        logits = self.executor.execute(step.batch.host)
        if self.offload is not None:  # the blocks this step wrote, before any is reused
            self.kv.store_offloaded()
        if self.speculator is not None:
            self.speculator.observe(step.out)
        outputs = self.emit_step(self.apply_step(step, logits))
        if self.speculator is not None:  # the next step's drafts, from the tokens taken now
            self.speculator.propose(self.scheduler.running)
        return outputs

    def plan_step(self) -> PlannedStep | list[EngineOutput]:
        """Schedule the next step and build its batch; the outputs of what ended instead (no
        step: nothing to run, or an adapter that failed to load)."""
        self.kv.begin_step()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        slot_of = None
        if self.loras is not None:
            assignment = self.loras.assignment
            broken = self.loras.place({s.seq.lora for s in out.scheduled if s.seq.lora is not None})
            if broken is not None:
                return self._drop_adapter(broken, out)
            slot_of = lambda seq: assignment.slot_of(seq.lora)  # noqa: E731
        self._recorder.scheduled(
            [self.requests[s.seq.request_id] for s in out.scheduled], out.num_tokens, time.time()
        )
        self.step_shape = (len(out.scheduled), out.num_tokens)
        batch = build_step_batch(out, self.block_size, slot_of, self.images is not None)
        return PlannedStep(out, batch)

    def apply_step(self, step: PlannedStep, logits: torch.Tensor) -> AppliedStep:
        """Sample the step's rows and let the scheduler take its results (stop tokens, lengths
        and grammars end sequences here). Rows of sequences that ended or were preempted since
        the step was scheduled are discarded."""
        out, rows = step.live()
        # From here on the work is per request: one that raises ends alone, with an error.
        failures = RequestFailures()
        record_prompt_logprobs(out, rows, logits, failures)
        samples = sample_step(self.sampler, out, rows, logits, failures)
        self.scheduler.update_from_output(out, samples, self.max_model_len, failures)
        # Each sampler's tokens: one, or (speculative decoding) its drafts accepted and one more.
        taken = {id(seq): [] if s is None else [s] for seq, s in zip(out.samplers, samples)}
        if self.speculator is not None:
            take = partial(self.scheduler.take, max_model_len=self.max_model_len)
            self.speculator.verify(out, rows, logits, taken, self.sampler, take, failures)
        return AppliedStep(out, rows, logits, [taken[id(seq)] for seq in out.samplers], failures)

    def emit_step(self, step: AppliedStep) -> list[EngineOutput]:
        """The step's outputs: new text (a stop string found in it ends its sequence), beam
        steps, the requests that failed."""
        out = step.out
        outputs = self._make_outputs(out.samplers, step.samples, step.failures)
        if out.has_beam_rows:
            outputs.extend(self.beams.step(out, step.logits_rows, step.logits, step.failures))
        outputs.extend(self._end_failed(step.failures))
        self._publish_kv_events()  # after the step wrote the blocks it stored, as vLLM does
        return outputs

    def _end_failed(self, failures: RequestFailures) -> list[EngineOutput]:
        """End every request that failed in this step: its sequences (a beam search's forks
        included) leave the scheduler and free their blocks; its output says why."""
        outputs: list[EngineOutput] = []
        now = time.time()
        for request_id, exc in failures.errors.items():
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            self._stop(request, "error")
            # Whatever of it the scheduler still holds, even a fork its failure left half-made.
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                if seq.request_id == request_id:
                    seq.finish_reason = "error"
                    self.scheduler.finish(seq)
            self._recorder.finished(request, now, finish_reason="error")
            outputs.append(failed_output(request, describe(exc)))
        return outputs

    def _drop_adapter(
        self, broken: tuple[LoRARequest, LoRALoadError], out: SchedulerOutput
    ) -> list[EngineOutput]:
        """The step does not run: the requests under the adapter that failed to load end
        (aborted); the others run from the next step, where the scheduler finds them as it
        left them (their blocks allocated, the step's copy-on-write copies given back)."""
        request, exc = broken
        log.error("LoRA adapter %r failed to load; its requests end: %s", request.lora_name, exc)
        self.kv.unregister_step()  # first: the aborted requests' blocks must not stay cached
        self.scheduler.unschedule(out)
        self.kv.pending_copies[:0] = out.block_copies
        under = {seq.request_id for seq in self.scheduler.running + list(self.scheduler.waiting)}
        outputs = []
        for request_id in sorted(under):
            seqs = self.requests[request_id].sequences
            if any(seq.lora == request for seq in seqs):
                aborted = self.abort_request(request_id)
                if aborted is not None:
                    outputs.append(aborted)
        self.executor.forget_lora(request)
        return outputs

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.take_events())

    def _make_outputs(
        self, seqs: list[Sequence], samples: list[list[Sample]], failures: RequestFailures
    ) -> list[EngineOutput]:
        """The new text of every sequence that sampled (a stop string found in it finishes the
        sequence), then one output for each request they belong to."""
        touched: dict[str, Request] = {}
        now = time.time()
        for seq, taken in zip(seqs, samples):
            if not taken or failures.failed(seq.request_id):
                continue
            request = self.requests[seq.request_id]
            failures.run(request.request_id, partial(self._take_text, request, seq, taken, now))
            touched[request.request_id] = request
        outputs: list[EngineOutput] = []
        for request in touched.values():
            output = failures.run(request.request_id, partial(make_output, request))
            if output is None:
                continue
            outputs.append(output)
            if request.finished:
                self._recorder.finished(request, now)
                del self.requests[request.request_id]
        return outputs

    def _take_text(self, request: Request, seq: Sequence, taken: list[Sample], now: float) -> None:
        """The text of the tokens the sequence took this step; a stop string found after one
        of them drops the ones after it."""
        was_finished = seq.is_finished
        kept = update_texts(seq, request.texts[seq.index], [s.token_id for s in taken])
        self._recorder.token(request, seq, now, count=kept)
        if seq.finish_reason is not None and not was_finished:
            self.scheduler.finish(seq)

    # ----------------------------------------------------------------- statistics

    def take_stats(self) -> EngineStats:
        """What happened since the previous call, with the running/waiting/KV state now."""
        stats = self._recorder.take(self.scheduler, with_adapters=self.loras is not None)
        if self.offload is not None:
            stats.kv_offload = self.offload.take_stats()
        if self.speculator is not None:
            stats.spec_decode = self.speculator.take_stats()
        if self.images is not None:
            self.images.record(stats)
        if self.kv_events is not None:
            stats.kv_events_dropped = self.kv_events.take_dropped()
        return stats
