"""What every route needs: the engine bridge, a tokenizer of the server's own, names and limits."""

from __future__ import annotations

import asyncio
import copy
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from config import ServerConfig
from engine.async_engine import AsyncEngine
from server.errors import model_not_found

T = TypeVar("T")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_names(engine: AsyncEngine, config: ServerConfig) -> list[str]:
    return list(config.served_model_name or [engine.engine.config.model.model or DEFAULT_MODEL_NAME])


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_names: list[str]
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))
    # Tokenizing and chat templating run here, one at a time, off the event loop: a fast
    # tokenizer is not safe to call from several threads at once.
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer"))

    @classmethod
    def build(cls, engine: AsyncEngine, config: ServerConfig) -> "ServerState":
        # The engine thread detokenizes with its own copy; this one is the frontend's.
        return cls(engine, config, served_model_names(engine, config), copy.deepcopy(engine.engine.tokenizer))

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.vocab_size

    @property
    def model_root(self) -> str:
        return str(self.engine.engine.model_path)

    def resolve_model(self, requested: str | None) -> str:
        """The name to report; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.model_names[0]
        if requested not in self.model_names:
            raise model_not_found(requested)
        return requested

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
