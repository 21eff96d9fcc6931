"""The bridge between asyncio and the engine thread.

`LLMEngine` is not thread-safe, so exactly one thread (the engine thread, the GPU thread on a GPU
node) drives it. Requests and aborts cross to it on a thread-safe queue that it drains at the
top of every iteration; each request's outputs come back to that request's own asyncio queue
through `loop.call_soon_threadsafe`, so the event loop never waits on the model.

What a frontend may use is the `EngineClient` surface (engine/client.py), all safe on the event
loop. `engine` belongs to the engine thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from config import EngineConfig
from engine.client import EngineRequest, PoolingRequest
from engine.coalesce import coalesce
from engine.core.request_failures import describe
from engine.daemon_pool import DaemonThreadPool
from engine.engine_info import EngineInfo
from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.llm_engine import CheckedRequest, LLMEngine
from engine.lora import LoRALoadError, LoRARequest
from engine.lora.read_threads import ReadThreads
from engine.lora.slots import PlacedAdapter
from engine.multimodal import MultiModalInputs
from engine.outputs import EngineOutput, PoolingRequestOutput, RequestOutput
from engine.processing.tokenization import encode
from engine.stats import EngineStats
from engine.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

STOP_POLL_SECONDS = 0.1  # how soon a request waiting on a grammar compile sees a shutdown
COMPILE_THREADS = 2  # grammar compiles at once; more wait their turn, within their timeout
LORA_READ_THREADS = 2  # adapter reads at once; more wait their turn, within their timeout


class _Sink:
    """Where one request's outputs go: a backlog its stream drains, fed on its own event loop.
    A deque and a future rather than an asyncio.Queue: the stream takes the whole backlog at
    once (to coalesce it), and the engine thread wakes each loop once per step, not once per
    output (`_post`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.backlog: collections.deque[EngineOutput | BaseException] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: EngineOutput | BaseException) -> None:
        """On the sink's loop."""
        self.backlog.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until the backlog holds something."""
        while not self.backlog:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def send(self, item: EngineOutput | BaseException) -> None:
        """From any thread: one item on its own (an abort's output, a failure)."""
        _post(self.loop, [(self, item)])


def _hand_out(batch: list[tuple[_Sink, EngineOutput | BaseException]]) -> None:
    for sink, item in batch:
        sink.put(item)


def _post(loop: asyncio.AbstractEventLoop, batch: list[tuple[_Sink, Any]]) -> None:
    # Each call_soon_threadsafe writes to the loop's wake-up socket and takes its lock: at
    # hundreds of streams, once per output was the engine thread's largest cost after its step.
    try:
        loop.call_soon_threadsafe(_hand_out, batch)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


@dataclass
class _Add:
    request: EngineRequest | PoolingRequest
    checked: CheckedRequest
    sink: _Sink
    # Stamped when the caller hands the request over, not when the engine thread takes it: a
    # request that waits in the inbox behind a running step has arrived all the same.
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Work on the engine's state that must run on its thread, between steps (adapters)."""

    fn: Callable[[LLMEngine], None]
    done: concurrent.futures.Future[None]


_WAKE = object()  # put on the inbox to make an idle engine thread look at the stop flag


class AsyncEngine:
    def __init__(self, engine: LLMEngine, thread: threading.Thread) -> None:
        """Made by from_config, on `thread`: the thread that built `engine` and will run it."""
        self.engine = engine
        # The engine thread detokenizes with its tokenizer; callers get a copy of their own,
        # since a fast tokenizer must not be used by two threads at once.
        self.info: EngineInfo = dataclasses.replace(
            engine.info, tokenizer=copy.deepcopy(engine.info.tokenizer)
        )
        # A stream hands over what queued up for it as one output (engine/coalesce.py); off
        # only to measure what that saves.
        self.coalesce = True
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | object] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # owned by the engine thread
        self._stopping = threading.Event()
        # Taken by a caller that enqueues and by the thread when it dies, so no request can
        # slip into the inbox after the thread's last look at it and then wait forever.
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._accepting = True  # False once the thread has taken its last look at the inbox
        # Called on the engine thread after every iteration, idle ones included (metrics).
        self.on_stats: Callable[[EngineStats], None] | None = None
        # When the step now running began (time.monotonic()); None between steps.
        self.step_started: float | None = None
        # Grammar compiles, off the event loop and the engine thread; daemon threads, so that
        # an abandoned compile never holds the process up (concurrent.futures' are joined).
        self._compiles = DaemonThreadPool(COMPILE_THREADS, "pagedserve-grammar")
        # Adapter reads at run time, off the engine thread (see engine/lora/read_threads.py).
        self._lora_reads = ReadThreads(LORA_READ_THREADS, "pagedserve-lora-read")
        self.thread = thread
        self._go = (
            threading.Event()
        )  # the thread waits on it before its loop: set by start() or shutdown()
        # A tensor-parallel worker's death wakes an idle thread, whose check_health() fails.
        engine.executor.on_failure = lambda: self._inbox.put(_WAKE)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """The engine built on the thread that will run it, which then waits for start(). On a
        CPU, torch's OpenMP workers belong to the thread that first runs a parallel op; a second
        thread with a team of its own makes the runtime, seeing more threads than cores, stop
        spinning between ops and sleep instead, so that every op waits for a wake-up: a server
        whose engine was built on the main thread ran at 0.74x of the offline engine on 2 cores."""
        return cls.built_by(lambda: LLMEngine(config))

    @classmethod
    def built_by(cls, build: Callable[[], LLMEngine]) -> AsyncEngine:
        """The engine `build` makes, built and then run on a thread of its own (see
        from_config); a benchmark's stand-in engine enters here."""
        built: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()

        def build_then_run() -> None:
            try:
                async_engine = cls(build(), threading.current_thread())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                built.put(exc)
                return
            built.put(async_engine)
            async_engine._go.wait()
            async_engine._run()

        thread = threading.Thread(target=build_then_run, name="pagedserve-engine", daemon=True)
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            thread.join()
            raise result
        return result

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._go.set()

    @property
    def is_alive(self) -> bool:
        return self._accepting and self.thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread (requests still in flight end with finish_reason 'abort'), then the
        engine's worker processes, if any."""
        self._stopping.set()
        self._inbox.put(_WAKE)
        self._go.set()  # a thread never started runs its loop, sees the stop flag and closes
        if self.thread.is_alive():
            self.thread.join(timeout)
        self._compiles.shutdown()
        self.engine.close()

    # ----------------------------------------------------------------- asyncio side

    async def submit(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Check the request (InvalidRequestError: nothing is queued) and return its stream of
        outputs, the last one with `finished` set. The grammar, if any, compiles on a worker
        thread (a large schema can take a second) so the engine thread finds it compiled."""
        params = request.params
        self.info.validate(request.prompt_token_ids, params)
        self.info.check_priority(request.priority)
        if request.multi_modal is not None:
            self.engine.check_images(request.multi_modal, params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = await self._compile(params.structured_outputs)
        # A generation request's stream carries only RequestOutputs (the engine makes them).
        return cast(
            AsyncGenerator[RequestOutput, None], self._stream(request, CheckedRequest(grammar))
        )

    async def expand_images(
        self, prompt: str | list[int], images: list[Image]
    ) -> tuple[list[int], MultiModalInputs]:
        """`LLMEngine.expand_images` on a worker thread: the image processor is CPU work the
        event loop and the engine thread must not wait on. Text is tokenized first, here, with
        the caller's tokenizer (`info.tokenizer`): the worker thread never touches a tokenizer."""
        if isinstance(prompt, str):
            prompt = encode(self.info.tokenizer, prompt)
        return await asyncio.to_thread(self.engine.expand_images, prompt, images)

    async def submit_pooling(
        self, request: PoolingRequest
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Check an input to embed (InvalidRequestError: nothing is queued) and return its
        stream: one output, finished. Leaving it early aborts the request."""
        self.info.validate_pooling(request.prompt_token_ids, request.params, request.field)
        return cast(
            AsyncGenerator[PoolingRequestOutput, None], self._stream(request, CheckedRequest(None))
        )

    async def _compile(self, structured: StructuredOutputsParams) -> Any:
        """The grammar compiled on one of a few threads of its own (a compile holds a core; the
        rest wait their turn), within --grammar-compile-timeout, waiting included. A compile past
        it, or one a shutdown overtakes, is abandoned: its request fails at once, and the
        thread's result, when it comes, goes only to the cache."""
        timeout = self.engine.config.structured.grammar_compile_timeout
        deadline = time.monotonic() + timeout
        grammars = self.engine.grammars
        # The size and keyword checks first, outside the compile queue (they parse at most
        # --max-grammar-bytes): a refused constraint never waits for a compile thread.
        await asyncio.to_thread(grammars.check, structured)
        compiling = asyncio.get_running_loop().run_in_executor(
            self._compiles, functools.partial(grammars.compile, structured, checked=True)
        )
        try:
            while not compiling.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise InvalidRequestError(
                        f"the constraint did not compile within {timeout:g} s "
                        "(--grammar-compile-timeout)",
                        "structured_outputs",
                    )
                await asyncio.wait({compiling}, timeout=min(left, STOP_POLL_SECONDS))
                if self._stopping.is_set() and not compiling.done():
                    raise EngineDeadError("the engine has shut down")
            return compiling.result()
        finally:
            compiling.cancel()  # a compile still queued never starts

    def abort(self, request_id: str) -> None:
        """Stop a request (a no-op for one that finished or is unknown); its stream ends with a
        last output whose finish_reason is 'abort'."""
        self._inbox.put(_Abort(request_id))

    async def add_lora(self, request: LoRARequest) -> None:
        """Read and check the adapter's files on a thread of their own, then hand what was read
        to the engine thread, which only keeps it: the engine thread never waits on a file, so
        a slow or hostile folder fails its own load (LoRALoadError, a 400) while every request
        goes on."""
        prepared = await self._read_lora(request)
        await self._call(lambda engine: engine.add_lora(request, prepared))

    async def _read_lora(self, request: LoRARequest) -> PlacedAdapter:
        """The adapter read within --lora-load-timeout, waiting for a read thread included. A
        read past it is abandoned: its load fails at once, and what the read returns, when it
        does, is dropped (nothing is kept until the engine thread is handed it)."""
        timeout = self.engine.config.lora.lora_load_timeout
        deadline = time.monotonic() + timeout
        reading = asyncio.get_running_loop().run_in_executor(
            self._lora_reads, self.engine.prepare_lora, request
        )
        try:
            while not reading.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoRALoadError(
                        f"LoRA adapter {request.lora_path!r}: reading it timed out after "
                        f"{timeout:g} s (--lora-load-timeout)"
                    )
                await asyncio.wait({reading}, timeout=min(left, STOP_POLL_SECONDS))
                if self._stopping.is_set() and not reading.done():
                    raise EngineDeadError("the engine has shut down")
            return reading.result()
        finally:
            reading.cancel()  # a read still waiting for a thread never starts

    async def remove_lora(self, request: LoRARequest) -> None:
        await self._call(lambda engine: engine.remove_lora(request))

    async def _call(self, fn: Callable[[LLMEngine], None]) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if not self._accepting:
                raise EngineDeadError(self.dead_reason())
            self._inbox.put(_Call(fn, done))
        await asyncio.wrap_future(done)

    async def _stream(
        self, request: EngineRequest | PoolingRequest, checked: CheckedRequest
    ) -> AsyncGenerator[EngineOutput, None]:
        """Queues the request when first iterated; leaving early (a client that went away)
        aborts it."""
        sink = _Sink(asyncio.get_running_loop())
        with self._lock:
            if not self._accepting:
                raise EngineDeadError(self.dead_reason())
            self._inbox.put(_Add(request, checked, sink, arrival_time=time.time()))
        finished = False
        backlog = sink.backlog
        try:
            while not finished:
                await sink.wait()
                item = backlog.popleft()
                if isinstance(item, BaseException):
                    finished = True  # the engine already forgot this request
                    raise item
                # Outputs that queued while this reader was busy go out as one.
                while self.coalesce and backlog and isinstance(item, RequestOutput):
                    later = backlog[0]
                    merged = coalesce(item, later) if isinstance(later, RequestOutput) else None
                    if merged is None:
                        break
                    item = merged
                    backlog.popleft()
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    def stuck_step(self, timeout: float) -> str | None:
        """Why the engine counts as stuck: its step has run past `timeout` seconds (with the
        shape of the batch it runs); None while it is not."""
        started = self.step_started
        if started is None or time.monotonic() - started <= timeout:
            return None
        shape = self.engine.step_shape
        return (
            f"the engine step has run for {time.monotonic() - started:.0f} s (limit {timeout:g} s, "
            f"--engine-step-timeout): {shape[0]} sequences, {shape[1]} tokens"
        )

    def dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {type(self.error).__name__}: {self.error}"
        return "the engine is not running"

    # ----------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                self.engine.check_health()
                outputs = []
                if self.engine.has_unfinished_requests() and not self._stopping.is_set():
                    self.step_started = time.monotonic()
                    try:
                        outputs = self.engine.step()
                    finally:
                        self.step_started = None
                # Metrics first: a client that has its answer finds it counted at /metrics.
                self._record_stats()
                self._deliver_all(outputs)
        except BaseException as exc:  # a failed step must fail every request, never hang one
            log.exception("the engine step failed; failing every request in flight")
            self.error = exc
            self._close(EngineDeadError(self.dead_reason(), failed=True))
        else:
            for request_id in list(self.engine.requests):
                aborted = self.engine.abort_request(request_id)
                if aborted is not None:
                    self._deliver(aborted)
            self._close(EngineDeadError("the engine has shut down"))

    def _record_stats(self) -> None:
        if self.on_stats is None:
            return
        stats = self.engine.take_stats()
        try:
            self.on_stats(stats)
        except Exception:  # an observer's failure must not stop the serving
            log.exception("recording the engine's statistics failed; serving goes on")

    def _close(self, reason: EngineDeadError) -> None:
        """Stop accepting, then fail whatever is still waiting: nothing can be left hanging."""
        with self._lock:
            self._accepting = False
        while True:
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                break
            if isinstance(item, _Add):
                item.sink.send(reason)
            elif isinstance(item, _Call):
                item.done.set_exception(reason)
        for sink in self._sinks.values():
            sink.send(reason)
        self._sinks.clear()

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _Call):
                try:
                    item.fn(self.engine)
                except Exception as exc:  # noqa: BLE001 - the caller's to raise (a bad adapter)
                    item.done.set_exception(exc)
                else:
                    item.done.set_result(None)
            elif isinstance(item, _Abort):
                output = self.engine.abort_request(item.request_id)
                sink = self._sinks.pop(item.request_id, None)
                if output is not None and sink is not None:
                    sink.send(output)

    def _add(self, item: _Add) -> None:
        request = item.request
        try:
            if isinstance(request, PoolingRequest):
                self.engine.add_pooling_request(
                    request.prompt,
                    request.params,
                    request.request_id,
                    arrival_time=item.arrival_time,
                    prompt_token_ids=request.prompt_token_ids,
                    checked=True,
                )
                self._sinks[request.request_id] = item.sink
                return
            self.engine.add_request(
                request.prompt,
                request.params,
                request.request_id,
                arrival_time=item.arrival_time,
                prompt_token_ids=request.prompt_token_ids,
                checked=item.checked,
                priority=request.priority,
                lora_request=request.lora_request,
                multi_modal=request.multi_modal,
            )
        except InvalidRequestError as exc:  # an id already in use
            item.sink.send(exc)
            return
        except Exception as exc:  # a request that cannot enter fails alone
            log.error("request %s could not be added", request.request_id, exc_info=exc)
            item.sink.send(RequestFailedError(describe(exc)))
            return
        self._sinks[request.request_id] = item.sink

    def _deliver_all(self, outputs: list[EngineOutput]) -> None:
        """A step's outputs, in one hand-over per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, Any]]] = {}
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._sinks.pop(output.request_id, None)
            if sink is None:
                continue
            item: EngineOutput | BaseException = output
            if isinstance(output, RequestOutput) and output.error is not None:
                item = RequestFailedError(output.error)  # the request's stream raises it
            batches.setdefault(sink.loop, []).append((sink, item))
        for loop, batch in batches.items():
            _post(loop, batch)

    def _deliver(self, output: EngineOutput) -> None:
        self._deliver_all([output])
