"""Every failure leaves the server as OpenAI's error object, with the status code the SDKs map
to their exception classes: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import InvalidRequestError
from engine.client import EngineDeadError, RequestFailedError

log = logging.getLogger(__name__)


class ResponseStoreError(RuntimeError):
    """The response store cannot be opened, read or written (unwritable path, disk full, locked,
    corrupt, its server unreachable).

    A server-side condition, not the client's fault: the routes answer it with 503. It is declared
    here, with the other errors the handlers map, so that the handlers need not import the store."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, object]]:
        message, param = _utf8(self.message), _utf8(self.param)
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _utf8(text: str | None) -> str | None:
    """`text` as UTF-8 can carry it: a lone surrogate a client sent (a model name, a logit_bias
    key) is written out as its escape, instead of failing the response that reports it."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(name: str) -> APIError:
    return APIError(
        404, f"The model '{name}' does not exist", param="model", code="model_not_found"
    )


def engine_dead(exc: EngineDeadError) -> APIError:
    if exc.failed:
        return APIError(500, str(exc), type="server_error")
    return APIError(503, str(exc), type="service_unavailable")


def as_api_error(exc: BaseException) -> APIError:
    """The error object for anything a request can fail with, in a response or mid-stream."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return invalid(str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        return engine_dead(exc)
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type="server_error")
    if isinstance(exc, ResponseStoreError):  # the server's storage, not the request, failed
        log.error("%s", exc)  # its address and cause are for the operator, not the client
        return APIError(
            503,
            "the response store is unavailable; try again later",
            type="service_unavailable",
            code="response_store_error",
        )
    return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})


def _is_union_tag(part: object) -> bool:
    """A union member's name in an error location ('str', 'list[str]', 'constrained-int',
    'TextPart'), never a field name: those are snake_case identifiers or list indexes."""
    if not isinstance(part, str):
        return False
    return part in _SCALAR_TAGS or any(ch in part for ch in "[]-") or part[:1].isupper()


def _union_prefix(loc: tuple[object, ...]) -> tuple[object, ...] | None:
    for i, part in enumerate(loc):
        if _is_union_tag(part):
            return loc[:i]
    return None


def _pick(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report. A union reports the errors of every member; each member's first
    error is where it gave up. The member that took the value's type and refused its value (a
    negative token id, a fifth stop string) says the most, then the member that got deepest
    into the value, then the one that got furthest along it (`[1, NaN]` is a list of token ids
    that fails at item 1, not a list of strings that fails at item 0)."""
    first = errors[0]
    prefix = _union_prefix(tuple(first.get("loc", ())))
    if prefix is None:
        return first
    stops: dict[tuple[object, ...], dict[str, Any]] = {}
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if _union_prefix(loc) == prefix:
            stops.setdefault(loc[: len(prefix) + 1], error)

    def rank(error: dict[str, Any]) -> tuple[bool, int, tuple[int, ...]]:
        loc = tuple(error.get("loc", ()))
        wrong_type = str(error.get("type", "")).endswith(("_type", "_parsing"))
        return (not wrong_type, len(loc), tuple(p for p in loc if isinstance(p, int)))

    # max() keeps the first of equals: pydantic lists the members in the order declared.
    return max(stops.values(), key=rank)


def _json_kind(value: object) -> str:
    kinds = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _body_error(first: dict[str, Any], content_type: str | None) -> APIError | None:
    """The body as a whole is wrong (empty, not an object, not JSON at all): say that, not
    pydantic's words for it."""
    kind = first.get("type")
    if kind == "json_invalid":
        return invalid(
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        )
    if tuple(first.get("loc", ())) != ("body",):
        return None
    if kind == "missing":
        return invalid(
            "the request body is empty: send a JSON object, with Content-Type: application/json"
        )
    given = first.get("input")
    if isinstance(given, (bytes, bytearray)):
        # FastAPI parses only a body declared as JSON; text/plain and form bodies are what any web
        # page may send across origins without a CORS preflight, so they are never guessed at.
        sent = f"Content-Type: {content_type}" if content_type else "no Content-Type"
        return invalid(
            f"the request body must be JSON, sent with Content-Type: application/json (got {sent[:100]})"
        )
    return invalid(f"the request body must be a JSON object, not {_json_kind(given)}")


def _validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending parameter."""
    first = _pick(list(exc.errors()))
    whole = _body_error(first, content_type)
    if whole is not None:
        return whole
    # Union members add their type names to the location; keep the field path only.
    # The location's first part says where (body, query, path): the param is the field alone.
    loc = list(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    path = [str(p) for p in loc if not _is_union_tag(p)]
    param = ".".join(path) or None
    given = first.get("input")
    shown = (
        json.dumps(given)[:100]
        if isinstance(given, (int, float, str, bool)) or given is None
        else None
    )
    detail = f"{first['msg']}" + (f" (got {shown})" if shown is not None and param else "")
    return invalid(f"{param}: {detail}" if param else detail, param)


def _unparsable_body(exc: StarletteHTTPException) -> APIError | None:
    """FastAPI answers a body its JSON parser raised on (other than with a syntax error) with a
    bare 400 "There was an error parsing the body"; the parser's own error says why."""
    cause = exc.__cause__
    if (
        exc.status_code != 400
        or cause is None
        or exc.detail != "There was an error parsing the body"
    ):
        return None
    if isinstance(cause, UnicodeDecodeError):
        reason = f"it is not UTF-8 text (byte {cause.object[cause.start : cause.start + 1]!r} at position {cause.start})"
    elif isinstance(cause, RecursionError):
        reason = "it is nested too deeply"
    elif isinstance(cause, ValueError):  # e.g. an integer longer than Python's 4300-digit limit
        reason = str(cause).split(";")[0]
    else:
        return None
    return invalid(f"the request body is not valid JSON: {reason}")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        unparsable = _unparsable_body(exc)
        if unparsable is not None:
            return unparsable.response()
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, message, type=kind).response(dict(exc.headers or {}))

    @app.exception_handler(APIError)
    async def _on_api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def _on_engine(_: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()

    for kind in (InvalidRequestError, EngineDeadError, RequestFailedError, ResponseStoreError):
        app.add_exception_handler(kind, _on_engine)

    @app.exception_handler(Exception)
    async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return as_api_error(exc).response()
