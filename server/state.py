"""What every route needs: the engine bridge, a tokenizer of the server's own, names and limits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from config import ServerConfig
from engine import PoolingRequestOutput, RequestOutput
from engine.client import EngineClient, LoRARequest
from engine.loading.default_model import DEFAULT_EMBEDDING_MODEL_NAME, DEFAULT_MODEL_NAME
from server.errors import APIError, model_not_found
from server.http.admission import Gate
from server.lora.registry import LoRARegistry

T = TypeVar("T")
# A generation's outputs, or a pooling request's one output: both pass the admission gate alike.
Out = TypeVar("Out", RequestOutput, PoolingRequestOutput)


def served_model_names(engine: EngineClient, config: ServerConfig) -> list[str]:
    info = engine.info
    default = DEFAULT_MODEL_NAME if info.pooler is None else DEFAULT_EMBEDDING_MODEL_NAME
    return list(config.served_model_name or [info.model or default])


@dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    model_names: list[str]
    tokenizer: PreTrainedTokenizerBase  # the frontend's own (see EngineClient.info)
    gate: Gate
    # The format tool calls are read in (and, for `generic`, asked for): --tool-call-parser, or
    # what `auto` chose from the chat template (server/openai/parsers/choose.py).
    tool_call_parser: str
    loras: LoRARegistry = field(default_factory=lambda: LoRARegistry([]))
    created: int = field(default_factory=lambda: int(time.time()))
    # Tokenizing and chat templating run here, one at a time, off the event loop: a fast
    # tokenizer is not safe to call from several threads at once.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")
    )

    @classmethod
    def build(
        cls,
        engine: EngineClient,
        config: ServerConfig,
        tool_call_parser: str,
        on_reject: Callable[[str], None] | None = None,
    ) -> ServerState:
        names = served_model_names(engine, config)
        return cls(
            engine,
            config,
            names,
            engine.info.tokenizer,
            Gate(config.max_waiting_requests, on_reject),
            tool_call_parser,
            LoRARegistry(names),
        )

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    @property
    def model_root(self) -> str:
        return self.engine.info.model_path

    def resolve_model(self, requested: str | None, adapters: bool = True) -> str:
        """The name to report; 404 for a model this server does not serve (a LoRA adapter's
        name is a model's here, as in vLLM). `adapters` False: a route that runs only the base
        model (pooling), where an adapter's name would otherwise be silently ignored."""
        if requested is None or requested == "":
            return self.model_names[0]
        adapter = self.loras.get(requested) if adapters else None
        if requested not in self.model_names and adapter is None:
            raise model_not_found(requested)
        return requested

    def lora_for(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` selects; None: the base model."""
        if not requested or requested in self.model_names:
            return None
        adapter = self.loras.get(requested)
        if adapter is None:  # unloaded since the route resolved the name
            raise model_not_found(requested)
        return adapter

    async def generate(
        self, request: Request, submitted: AsyncGenerator[Out, None]
    ) -> AsyncGenerator[Out, None]:
        """The outputs of a request submitted to the engine (openai/inputs.py `submit`); the
        first one ends the HTTP request's wait in the admission gate's queue."""
        ticket = request.scope.get("state", {}).get("ticket")
        if ticket is None:
            raise RuntimeError(f"{request.url.path} generates but is not a GeneratingRoute")
        async with aclosing(submitted) as outputs:
            if not ticket.started:  # (a sibling of a multi-prompt request may have started it)
                first = await self._first_output(outputs)
                ticket.start()
                yield first
            async for output in outputs:
                yield output

    async def _first_output(self, outputs: AsyncIterator[Out]) -> Out:
        limit = self.config.max_queue_time
        try:
            return await asyncio.wait_for(
                anext(outputs), limit
            )  # a timeout cancels it: the request is aborted
        except asyncio.TimeoutError:  # not TimeoutError itself before Python 3.11
            self.gate.reject("queue_timeout")
            raise APIError(
                503,
                f"no token within this server's limit of {limit:g} s (--max-queue-time)",
                type="service_unavailable",
                code="queue_timeout",
            ) from None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
