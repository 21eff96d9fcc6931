"""What a frontend may call on the engine: the `EngineClient` protocol (`AsyncEngine` is the
one implementation), the request it submits, and the errors it may get back (a stream raises
`RequestFailedError` when the engine failed that request alone). The server is written against
this, never against the engine thread's objects.

A request crosses once: `submit` checks it (the engine's limits, then its grammar compiled off
the event loop) and raises `InvalidRequestError` before anything is queued; the stream it
returns queues the request when first iterated, so a caller with several prompts submits all
of them before it starts any. Leaving a stream early aborts its request.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.engine_info import EngineInfo
from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.lora import LoRALoadError, LoRARequest
from engine.multimodal import MultiModalInputs
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = [
    "EngineClient",
    "EngineDeadError",
    "EngineRequest",
    "InvalidRequestError",
    "LoRALoadError",
    "LoRARequest",
    "PoolingRequest",
    "RequestFailedError",
]


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: str | list[int]  # as the client gave it: text, or token ids
    prompt_token_ids: list[int]  # the prompt tokenized by the caller (with its chat template)
    params: SamplingParams
    priority: int = 0  # lower is served earlier (--scheduling-policy priority)
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs under
    # The prompt's images (`expand_images`): prompt_token_ids then hold their expanded spans.
    multi_modal: MultiModalInputs | None = None


@dataclass(frozen=True)
class PoolingRequest:
    """One input to embed (a pooling engine): its tokens, already truncated where asked."""

    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: PoolingParams
    field: str = "input"  # the request field errors about the input name


class EngineClient(Protocol):
    # Frozen: names, limits, KV pool size, and a tokenizer of the caller's own.
    info: EngineInfo
    # Called on the engine thread after every iteration, idle ones included (metrics).
    on_stats: Callable[[EngineStats], None] | None
    # Why the engine thread stopped stepping, once a step has raised; None while healthy.
    error: BaseException | None

    @property
    def is_alive(self) -> bool: ...

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def dead_reason(self) -> str: ...

    def stuck_step(self, timeout: float) -> str | None: ...

    async def submit(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]: ...

    async def submit_pooling(
        self, request: PoolingRequest
    ) -> AsyncGenerator[PoolingRequestOutput, None]: ...

    async def expand_images(
        self, prompt: str | list[int], images: list[Image]
    ) -> tuple[list[int], MultiModalInputs]:
        """The prompt's tokens with each image placeholder expanded into its image's span, and
        the images as the engine reads them (InvalidRequestError when they do not pair up, or
        the model reads no images). Runs the image processor off the event loop."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def add_lora(self, request: LoRARequest) -> None:
        """Read and check an adapter on the engine thread, between steps (LoRALoadError)."""
        ...

    async def remove_lora(self, request: LoRARequest) -> None:
        """Forget an adapter: requests already running under it finish under it."""
        ...
