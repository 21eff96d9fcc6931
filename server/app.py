"""The FastAPI application: routes, errors, auth and CORS around one EngineClient."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

from config import ConfigError, ServerConfig
from config.engine_config import default_cache_dir
from engine.client import EngineClient, EngineDeadError
from engine.errors import InvalidRequestError
from engine.processing.tokenization import decode, encode
from server.anthropic.errors import AnthropicErrors
from server.anthropic.protocol import CountTokensRequest, Message, MessagesRequest, TokenCount
from server.anthropic.serving import count_tokens, create_message
from server.embeddings.route import pooling_router
from server.errors import APIError, engine_dead, install_error_handlers, invalid
from server.http.admission import GeneratingRoute, shutting_down
from server.http.auth import APIKeyMiddleware
from server.http.body_limit import BodyLimitMiddleware
from server.http.streaming import ClientDisconnected, client_gone
from server.lora.routes import lora_router
from server.metrics.collector import EngineMetrics
from server.metrics.names import MetricNames
from server.openai.chat.images import check_reads_images, expand_images, image_parts, load_images
from server.openai.chat.protocol import ChatCompletion, ChatCompletionRequest
from server.openai.chat.serving import create_chat_completion
from server.openai.completions.protocol import Completion, CompletionRequest
from server.openai.completions.serving import create_completion
from server.openai.inputs import chat_messages, render_chat
from server.openai.parsers.choose import choose_tool_call_parser
from server.openai.protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from server.openai.render.protocol import RenderedRequest
from server.openai.render.serving import render_chat_request, render_completion_request
from server.openai.responses.protocol import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from server.openai.responses.serving import create_response, input_items_page, not_found, retrieve
from server.openai.responses.store import open_response_store
from server.state import ServerState, served_model_names

log = logging.getLogger(__name__)

# A client decides the names; a log line must stay readable whatever it sends.
MAX_IGNORED_SHOWN, MAX_NAME_SHOWN = 20, 80


def log_ignored_fields(req: BaseModel) -> None:
    """Say once, by name, which top-level fields of the request nothing reads: they are
    accepted, as vLLM accepts them, so a client would otherwise never learn that they had no
    effect. `model_extra` holds only what the model does not declare, so a field declared
    later (or refused by a check) is never reported here."""
    names = sorted(req.model_extra or {})
    if not names:
        return
    shown = ", ".join(repr(name[:MAX_NAME_SHOWN]) for name in names[:MAX_IGNORED_SHOWN])
    if len(names) > MAX_IGNORED_SHOWN:
        shown += f", ... ({len(names) - MAX_IGNORED_SHOWN} more)"
    log.warning("The following fields were present in the request but ignored: {%s}", shown)


def attach_metrics(engine: EngineClient, config: ServerConfig) -> EngineMetrics:
    """The engine's metrics in a registry of their own, fed from now on by its thread."""
    info = engine.info
    metrics = EngineMetrics(
        CollectorRegistry(),
        served_model_names(engine, config)[0],
        info.block_size,
        info.num_kv_blocks,
        info.max_model_len,
        MetricNames(config.metrics_names),
        info.max_loras,
        info.num_speculative_tokens,
        info.accepts_images,
        info.kv_offload_tiers,
    )
    engine.on_stats = metrics.record
    return metrics


def package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


def create_app(
    engine: EngineClient, config: ServerConfig, metrics: EngineMetrics | None = None
) -> FastAPI:
    """The app serves `engine`, which the caller starts and stops (one engine can back several
    apps), and `metrics` at /metrics (see `attach_metrics`)."""
    tools = choose_tool_call_parser(config.tool_call_parser, engine.info.tokenizer)
    log.info("tool calls: the %s format, because %s", tools.name, tools.reason)
    state = ServerState.build(engine, config, tools.name, metrics.reject if metrics else None)
    metrics_registry = metrics.registry if metrics else CollectorRegistry()
    store = open_response_store(
        config.responses_store,
        default_cache_dir(),
        config.responses_max_age_s,
        config.responses_max_bytes,
    )

    modules = config.parsed_lora_modules()
    if modules and engine.info.max_loras is None:
        raise ConfigError("--lora-modules needs --enable-lora")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Before the first request: a bad adapter stops the start-up with its reason.
        for module in modules:
            await state.loras.load(engine, module.name, module.path, module.base_model_name)
        yield
        state.close()
        store.close()

    app = FastAPI(title="pagedserve", version=package_version(), lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, client_gone)
    # Each middleware added wraps the ones before it: CORS, body limit, then the key; the
    # generating routes' admission runs after them all (see GeneratingRoute).
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    # Around the key check and the body limit: their errors too take Anthropic's shape there.
    app.add_middleware(AnthropicErrors)
    # Outermost: a CORS preflight is answered before the key is asked for.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
    )

    def unavailable() -> APIError:
        return engine_dead(EngineDeadError(engine.dead_reason()))

    def require_engine() -> None:
        if not engine.is_alive:
            raise unavailable()

    def require_generating() -> None:
        """An embedding model's server answers the generating routes with a 400 that says so."""
        try:
            engine.info.check_generates()
        except InvalidRequestError as exc:
            raise invalid(str(exc), exc.param) from None

    def card(name: str) -> ModelCard:
        adapter = state.loras.get(name)
        return ModelCard(
            id=name,
            created=state.created,
            root=state.model_root if adapter is None else adapter.lora_path,
            parent=None if adapter is None else state.model_names[0],
            max_model_len=state.max_model_len,
            task="embed" if engine.info.pooler is not None else "generate",
        )

    generating = APIRouter(route_class=GeneratingRoute)

    @generating.post("/v1/completions", response_model=None)
    async def completions(
        req: CompletionRequest, request: Request
    ) -> Completion | StreamingResponse:
        log_ignored_fields(req)
        require_engine()
        require_generating()
        return await create_completion(state, req, request)

    @generating.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        req: ChatCompletionRequest, request: Request
    ) -> ChatCompletion | StreamingResponse:
        log_ignored_fields(req)
        require_engine()
        require_generating()
        return await create_chat_completion(state, req, request)

    @generating.post("/v1/responses", response_model=None)
    async def responses(
        req: ResponsesRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        log_ignored_fields(req)
        require_engine()
        require_generating()
        return await create_response(state, store, req, request)

    @generating.post("/v1/messages", response_model=None)
    async def messages(req: MessagesRequest, request: Request) -> Message | StreamingResponse:
        log_ignored_fields(req)
        require_engine()
        require_generating()
        return await create_message(state, req, request)

    app.include_router(generating)

    def before_pooling(req: BaseModel) -> None:
        log_ignored_fields(req)
        require_engine()

    app.include_router(pooling_router(state, before_pooling))
    if config.allow_runtime_lora_updating:
        app.include_router(lora_router(state.loras, engine))

    # vLLM's render routes (routers tokenize through them): prepared as their routes prepare
    # a request, nothing generated; no admission, as nothing is queued.
    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(req: ChatCompletionRequest) -> RenderedRequest:
        log_ignored_fields(req)
        return await render_chat_request(state, req)

    # (Its answer is built as JSON bytes off the event loop: `response_model` only documents it.)
    @app.post("/v1/completions/render", response_model=list[RenderedRequest])
    async def completions_render(req: CompletionRequest) -> Response:
        log_ignored_fields(req)
        return await render_completion_request(state, req)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest) -> TokenCount:
        log_ignored_fields(req)
        return await count_tokens(state, req)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> ResponseObject:
        return ResponseObject.model_validate((await retrieve(store, response_id)).response)

    @app.get("/v1/responses/{response_id}/input_items")
    async def get_input_items(
        response_id: str,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        before: str | None = None,
    ) -> InputItemList:
        stored = await retrieve(store, response_id)
        return input_items_page(stored, limit, order, after, before)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> DeletedResponse:
        if not await asyncio.to_thread(store.delete, response_id):
            raise not_found(response_id)
        return DeletedResponse(id=response_id)

    @app.get("/v1/models")
    async def models() -> ModelList:
        names = [*state.model_names, *state.loras.adapters]
        return ModelList(data=[card(name) for name in names])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return card(state.resolve_model(model_id))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return unavailable().response()
        stuck = engine.stuck_step(config.engine_step_timeout)
        if stuck is not None:
            return APIError(503, stuck, type="service_unavailable", code="engine_stuck").response()
        if state.gate.draining:  # so that load balancers stop sending requests here
            return shutting_down().response()
        return Response(status_code=200)

    @app.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": package_version()}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, object]:
        log_ignored_fields(req)
        state.resolve_model(req.model)
        req.check()
        if req.messages is not None:
            images = image_parts(req.messages)
            check_reads_images(state, images)
            messages = chat_messages(req.messages, state.engine.info.accepts_images)
            ids = await state.off_loop(
                render_chat, state.tokenizer, messages, req.add_generation_prompt
            )
            if images:  # counted as the model reads them: each image's whole span
                ids, _ = await expand_images(state, ids, await load_images(state, images))
        else:
            ids = await state.off_loop(
                encode, state.tokenizer, req.prompt or "", req.add_special_tokens
            )
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        log_ignored_fields(req)
        state.resolve_model(req.model)
        bad = [t for t in req.tokens if t >= state.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                param="tokens",
            )
        return {"prompt": await state.off_loop(decode, state.tokenizer, req.tokens)}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    return app
