"""Streamed chunks written from prebuilt JSON: what a chunk repeats (id, object, created, model)
is encoded once per stream, and a choice of plain text (no logprobs, no tool call) is written
with one json.dumps of its text. A pydantic model per token and its model_dump_json were the
largest part of the server's own work per streamed token at hundreds of streams; anything
beyond plain text still goes through the models, so the bytes mean the same either way.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from server.openai.protocol import Usage


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class ChunkFrame:
    """`data: {"id":..., "object":..., "created":..., "model":..., "choices":[...], "usage":...}`
    for one stream, its fixed fields encoded once."""

    def __init__(
        self, response_id: str, kind: str, created: int, model: str, with_usage: bool
    ) -> None:
        self._head = (
            f'data: {{"id":{_string(response_id)},"object":{_string(kind)},'
            f'"created":{created},"model":{_string(model)},"choices":['
        )
        # Without include_usage the field is left out, as the models' `exclude` leaves it.
        self._with_usage = with_usage
        self._tail = '],"usage":null}\n\n' if with_usage else "]}\n\n"

    def event(self, choices: list[str], usage: Usage | None = None) -> str:
        """One event of these encoded choices."""
        if usage is not None and self._with_usage:
            return f'{self._head}{",".join(choices)}],"usage":{usage.model_dump_json()}}}\n\n'
        return f"{self._head}{','.join(choices)}{self._tail}"


def _tail(finish_reason: str | None, stop_reason: int | str | None) -> str:
    finish = "null" if finish_reason is None else _string(finish_reason)
    if stop_reason is None:
        stop = "null"
    elif isinstance(stop_reason, int):
        stop = str(stop_reason)
    else:
        stop = _string(stop_reason)
    return f'"finish_reason":{finish},"stop_reason":{stop}}}'


def text_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: int | str | None
) -> str:
    """A completion choice of text and no logprobs (CompletionChoice's fields, in order)."""
    return f'{{"index":{index},"text":{_string(text)},"logprobs":null,' + _tail(
        finish_reason, stop_reason
    )


def content_choice(
    index: int, content: str, finish_reason: str | None, stop_reason: int | str | None
) -> str:
    """A chat chunk choice whose delta is content alone, no logprobs (ChatChunkChoice's)."""
    return f'{{"index":{index},"delta":{{"content":{_string(content)}}},"logprobs":null,' + _tail(
        finish_reason, stop_reason
    )


def model_choice(choice: BaseModel) -> str:
    """Any other choice, through its model."""
    return choice.model_dump_json()
