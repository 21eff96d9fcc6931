"""A response's output items built from one choice's deltas (server/openai/chat/output.py), and the
streaming events that tell each step of the building, as OpenAI sends them: an item is added,
its text or arguments grow by deltas, then it is done."""

from __future__ import annotations

from typing import Any

from server.openai.chat.protocol import Delta
from server.openai.responses.inputs import item_id
from server.openai.responses.protocol import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
)

Event = dict[str, Any]


class OutputBuilder:
    """`feed` the deltas of the one choice; each call returns the events it caused (without
    sequence numbers: the stream numbers them). `output` holds the items so far."""

    def __init__(self) -> None:
        self.output: list[OutputItem] = []
        self._open: OutputItem | None = None  # the item still growing

    def feed(self, deltas: list[Delta]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if delta.reasoning_content:
                events += self._grow("reasoning", delta.reasoning_content)
            if delta.content:
                events += self._grow("message", delta.content)
            for call in delta.tool_calls or []:
                if call.id is not None:
                    events += self._close()
                    events += self._add(
                        FunctionCallItem(
                            id=item_id("fc"),
                            call_id=call.id,
                            name=call.function.name or "",
                            arguments="",
                        )
                    )
                events += self._grow("function_call", call.function.arguments)
        return events

    def close(self) -> list[Event]:
        return self._close()

    @property
    def text(self) -> str:
        return "".join(
            part.text
            for item in self.output
            if isinstance(item, MessageItem)
            for part in item.content
        )

    # ------------------------------------------------------------------ items

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.output) - 1}

    def _add(self, item: OutputItem) -> list[Event]:
        self.output.append(item)
        self._open = item
        events = [
            {
                "type": "response.output_item.added",
                "output_index": len(self.output) - 1,
                "item": item.model_dump(),
            }
        ]
        if isinstance(item, MessageItem):
            part = OutputText(text="")
            item.content.append(part)
            events.append(
                {
                    "type": "response.content_part.added",
                    **self._where(),
                    "content_index": 0,
                    "part": part.model_dump(),
                }
            )
        return events

    def _grow(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.type != kind:
            events += self._close()
            if kind == "message":
                events += self._add(MessageItem(id=item_id("msg")))
            else:  # reasoning; function_call items are added by their start
                events += self._add(
                    ReasoningItem(id=item_id("rs"), content=[ReasoningText(text="")])
                )
        item = self._open
        assert item is not None
        if isinstance(item, (MessageItem, ReasoningItem)):  # both grow their one text part
            item.content[0].text += text
            name = "output_text" if kind == "message" else "reasoning_text"
            event = {"type": f"response.{name}.delta", **self._where(), "content_index": 0}
            event["delta"] = text
            if kind == "message":
                event["logprobs"] = []
            events.append(event)
        else:
            item.arguments += text
            events.append(
                {"type": "response.function_call_arguments.delta", **self._where(), "delta": text}
            )
        return events

    def _close(self) -> list[Event]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        events: list[Event] = []
        if isinstance(item, MessageItem):
            part = item.content[0]
            events.append(
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": part.text,
                    "logprobs": [],
                }
            )
            events.append(
                {
                    "type": "response.content_part.done",
                    **where,
                    "content_index": 0,
                    "part": part.model_dump(),
                }
            )
        elif isinstance(item, ReasoningItem):
            text = item.content[0].text
            events.append(
                {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}
            )
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "arguments": item.arguments,
                }
            )
        if not isinstance(item, ReasoningItem):  # which has no status
            item.status = "completed"
        events.append(
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": item.model_dump(),
            }
        )
        self._open = None
        return events
