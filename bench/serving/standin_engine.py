"""A stand-in engine that emits tokens at GPU rates on a CPU, to measure the HTTP frontend alone.

It takes `LLMEngine`'s place behind the real `AsyncEngine` bridge, so the frontend sees what it
sees on a GPU node: an engine thread that steps, and each request's outputs handed to its
asyncio queue with `loop.call_soon_threadsafe`, one `RequestOutput` per request per step built
by the real `make_output` from real `Sequence`s, with text from the real incremental
detokenizer and the default model's tokenizer. What it does not do is run a model: a decode step
for every running request is a sleep to the next tick of `--step-ms` (where a GPU thread waits
on its device, the GIL released), and each sequence's "model" reads a fixed English text from a
place its prompt decides, so the same prompt always yields the same tokens (streamed or not, at
any temperature). No grammars, beam search, LoRA or pooling.

    python bench/serving/standin_engine.py --port 8010 --step-ms 10    # serve it over the real app
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from typing import cast

from config import ServerConfig
from config.engine_config import default_cache_dir
from engine.async_engine import AsyncEngine
from engine.core.sequence import Sequence, SequenceStatus
from engine.engine_info import EngineInfo
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.loading.default_model import default_model_dir
from engine.loading.resolve import load_tokenizer
from engine.outputs import EngineOutput, PositionLogprobs
from engine.processing.detokenizer import IncrementalDetokenizer
from engine.processing.output_processor import make_output, update_text
from engine.processing.request import Request, SequenceText
from engine.sampling_params import SamplingParams

# What every sequence reads, each from its own place; ordinary prose, so the detokenizer sees
# ordinary words, spaces, punctuation and a few multi-byte characters.
_TEXT = (
    "The river ran high that spring, and the old ferryman said he had never seen it so brown. "
    "Children watched from the bridge as branches, barrels and once a whole chicken coop went "
    "by. By June the water had fallen again; the café by the landing reopened, its chairs "
    "still smelling of mud, and people came back to sit in the evening light — slowly at "
    "first, then all at once, as if nothing had happened. "
)
_FAKE_LOGPROB = -0.25  # every token's; alternatives get lower ones


class _NoWorkers:
    """The executor surface AsyncEngine touches: nothing to fail or close."""

    on_failure: object = None

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


class StandInEngine:
    """Duck-types the parts of LLMEngine that AsyncEngine calls."""

    def __init__(self, step_s: float, max_num_seqs: int = 1024, max_model_len: int = 8192) -> None:
        path = default_model_dir(default_cache_dir())
        self.tokenizer = load_tokenizer(path)
        self.info = EngineInfo(
            model=None,
            model_path=str(path),
            tokenizer=self.tokenizer,
            max_model_len=max_model_len,
            vocab_size=len(self.tokenizer),
            max_num_seqs=max_num_seqs,
            block_size=16,
            num_kv_blocks=max_num_seqs * max_model_len // 16,
        )
        self.executor = _NoWorkers()
        self.step_s = step_s
        self.requests: dict[str, Request] = {}
        self.step_shape = (0, 0)
        self._text_ids: list[int] = self.tokenizer.encode(_TEXT, add_special_tokens=False)
        self._next_tick: float | None = None
        self.tokens_emitted = 0
        self.last_emitted = 0.0

    # ------------------------------------------------------------ what AsyncEngine calls

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float,
        prompt_token_ids: list[int],
        **_: object,
    ) -> str:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.use_beam_search or params.structured_outputs is not None:
            raise NotImplementedError("the stand-in engine runs no beam search and no grammar")
        sequences = [
            Sequence(
                seq_id=request_id if i == 0 else f"{request_id}#{i}",
                request_id=request_id,
                index=i,
                prompt_token_ids=prompt_token_ids,
                params=params,
                arrival_time=arrival_time,
                status=SequenceStatus.RUNNING,
            )
            for i in range(params.n)
        ]
        texts = [
            SequenceText(
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            )
            for _ in sequences
        ]
        prompt_text = prompt if isinstance(prompt, str) else None
        self.requests[request_id] = Request(
            request_id, prompt_text, prompt_token_ids, sequences, texts, arrival_time
        )
        return request_id

    def abort_request(self, request_id: str) -> EngineOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.is_finished:
                seq.finish_reason, seq.status = "abort", SequenceStatus.FINISHED
        return make_output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_health(self) -> None:
        pass

    def close(self) -> None:
        pass

    def step(self) -> list[EngineOutput]:
        """One decode step: a token for every running sequence, at the next tick."""
        self._wait_for_tick()
        outputs: list[EngineOutput] = []
        running = 0
        for request in list(self.requests.values()):
            for seq, text in zip(request.sequences, request.texts):
                if not seq.is_finished:
                    self._advance(seq, text)
                    running += 1
            outputs.append(make_output(request))
            if request.finished:
                del self.requests[request.request_id]
        self.step_shape = (running, running)
        self.tokens_emitted += running
        if running:
            self.last_emitted = time.time()
        return outputs

    # ------------------------------------------------------------ internals

    def _wait_for_tick(self) -> None:
        # Ticks keep their cadence while busy (a GPU's steps do not wait for the host's last
        # one to be read); after an idle spell the clock starts over.
        now = time.perf_counter()
        tick = self._next_tick
        if tick is None or tick < now - self.step_s:
            tick = now
        if tick > now:
            time.sleep(tick - now)
        self._next_tick = tick + self.step_s

    def _advance(self, seq: Sequence, text: SequenceText) -> None:
        params = seq.params
        ids = self._text_ids
        start = zlib.crc32(bytes(str(seq.prompt_token_ids[-8:]), "ascii")) + 31 * seq.index
        token = ids[(start + seq.num_output_tokens) % len(ids)]
        seq.append_token(token)
        if seq.logprobs is not None:
            seq.logprobs.append(self._position_logprobs(token, params.logprobs or 0))
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        update_text(seq, text, token)
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED

    def _position_logprobs(self, token: int, top: int) -> PositionLogprobs:
        position = {token: _FAKE_LOGPROB}
        for k in range(top):
            position.setdefault((token + 1 + k) % self.info.vocab_size, _FAKE_LOGPROB - 1 - k)
        return position


def offline_rate(step_s: float, streams: int, max_tokens: int) -> float:
    """Tokens per second the stand-in emits with nobody reading: the offline engine's rate."""
    engine = StandInEngine(step_s)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(streams):
        engine.add_request("", params, f"r{i}", time.time(), [1000 + i, 2000 + i])
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return engine.tokens_emitted / (time.perf_counter() - started)


def start_standin(step_s: float, coalesce: bool = True) -> AsyncEngine:
    """The stand-in behind the real bridge, its thread started."""
    engine = AsyncEngine.built_by(lambda: cast(LLMEngine, StandInEngine(step_s)))
    engine.coalesce = coalesce
    engine.start()
    return engine


def main() -> None:
    import uvicorn

    from server.app import create_app

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--step-ms", type=float, default=10.0, help="one decode step every N ms")
    parser.add_argument(
        "--no-coalesce", action="store_true", help="one event per output, however far behind"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval: how long a thread keeps the GIL",
    )
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    engine = start_standin(args.step_ms / 1000, coalesce=not args.no_coalesce)
    try:
        config = ServerConfig(host="127.0.0.1", port=args.port, responses_store="none")
        app = create_app(engine, config)
        standin = cast(StandInEngine, engine.engine)

        @app.get("/standin/tokens")
        def tokens() -> dict[str, float]:
            """Tokens emitted so far and when the last came (time.time()): the engine's own
            rate under load, beside what the client read."""
            return {"tokens": standin.tokens_emitted, "last": standin.last_emitted}

        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
