"""A response's output items built from one choice's deltas (server/openai/chat/output.py), and the
streaming events that tell each step of the building, as OpenAI sends them: an item is added,
its text or arguments grow by deltas, then it is done."""

from __future__ import annotations

from server.openai.chat.protocol import Delta
from server.openai.responses.inputs import item_id
from server.openai.responses.protocol import (
    ContentPartEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseEvent,
)


class OutputBuilder:
    """`feed` the deltas of the one choice; each call returns the events it caused (without
    sequence numbers: the stream numbers them). `output` holds the items so far."""

    def __init__(self) -> None:
        self.output: list[OutputItem] = []
        self._open: OutputItem | None = None  # the item still growing

    def feed(self, deltas: list[Delta]) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
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

    def close(self) -> list[ResponseEvent]:
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

    def _where(self) -> tuple[str, int]:
        """The open item's id and place in the output."""
        assert self._open is not None
        return self._open.id, len(self.output) - 1

    def _add(self, item: OutputItem) -> list[ResponseEvent]:
        self.output.append(item)
        self._open = item
        events: list[ResponseEvent] = [
            OutputItemEvent(
                type="response.output_item.added",
                output_index=len(self.output) - 1,
                item=item.model_copy(deep=True),
            )
        ]
        if isinstance(item, MessageItem):
            part = OutputText(text="")
            item.content.append(part)
            open_id, index = self._where()
            events.append(
                ContentPartEvent(
                    type="response.content_part.added",
                    item_id=open_id,
                    output_index=index,
                    content_index=0,
                    part=part.model_copy(deep=True),
                )
            )
        return events

    def _grow(self, kind: str, text: str) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
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
        open_id, index = self._where()
        if isinstance(item, MessageItem):
            item.content[0].text += text
            events.append(
                OutputTextDelta(item_id=open_id, output_index=index, content_index=0, delta=text)
            )
        elif isinstance(item, ReasoningItem):
            item.content[0].text += text
            events.append(
                ReasoningTextDelta(item_id=open_id, output_index=index, content_index=0, delta=text)
            )
        else:
            item.arguments += text
            events.append(
                FunctionCallArgumentsDelta(item_id=open_id, output_index=index, delta=text)
            )
        return events

    def _close(self) -> list[ResponseEvent]:
        item = self._open
        if item is None:
            return []
        open_id, index = self._where()
        events: list[ResponseEvent] = []
        if isinstance(item, MessageItem):
            part = item.content[0]
            events.append(
                OutputTextDone(item_id=open_id, output_index=index, content_index=0, text=part.text)
            )
            events.append(
                ContentPartEvent(
                    type="response.content_part.done",
                    item_id=open_id,
                    output_index=index,
                    content_index=0,
                    part=part.model_copy(deep=True),
                )
            )
        elif isinstance(item, ReasoningItem):
            events.append(
                ReasoningTextDone(
                    item_id=open_id, output_index=index, content_index=0, text=item.content[0].text
                )
            )
        else:
            events.append(
                FunctionCallArgumentsDone(
                    item_id=open_id, output_index=index, arguments=item.arguments
                )
            )
        if not isinstance(item, ReasoningItem):  # which has no status
            item.status = "completed"
        events.append(
            OutputItemEvent(
                type="response.output_item.done",
                output_index=index,
                item=item.model_copy(deep=True),
            )
        )
        self._open = None
        return events
