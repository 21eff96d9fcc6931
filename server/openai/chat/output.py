"""One chat choice's output text turned into what OpenAI returns: reasoning split off, tool
calls parsed (auto) or read from the forced JSON (required, named), the rest content. The same
path serves a whole answer and a stream, so the two cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import CompletionOutput
from server.openai.chat.protocol import (
    AssistantMessage,
    Delta,
    ToolCallDelta,
    ToolCallFunction,
    ToolCallFunctionDelta,
    ToolCallOut,
)
from server.openai.chat.tool_choice import ToolPlan, forced_calls
from server.openai.parsers import (
    ContentDelta,
    ReasoningDelta,
    ReasoningParser,
    ToolCallArgumentsDelta,
    ToolCallParser,
    ToolCallStart,
    new_call_id,
    reasoning_parser_for,
    tool_call_parser_for,
)


def _start(index: int, call_id: str, name: str) -> Delta:
    function = ToolCallFunctionDelta(name=name, arguments="")
    return Delta(tool_calls=[ToolCallDelta(index=index, id=call_id, function=function)])


def _arguments(index: int, fragment: str) -> Delta:
    function = ToolCallFunctionDelta(arguments=fragment)
    return Delta(tool_calls=[ToolCallDelta(index=index, function=function)])


@dataclass
class ChoiceShaper:
    plan: ToolPlan
    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None
    num_calls: int = field(default=0, init=False)
    _forced_text: str = field(default="", init=False)  # required: the JSON, read at the end

    @classmethod
    def build(cls, plan: ToolPlan, reasoning_parser: str | None) -> ChoiceShaper:
        reasoning = reasoning_parser_for(reasoning_parser)() if reasoning_parser else None
        tools = tool_call_parser_for(plan.parser)() if plan.mode == "auto" and plan.parser else None
        return cls(plan, reasoning, tools)

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        if self.reasoning is None:
            return self._content(text)
        return self._split(self.reasoning.feed(text))

    def finish(self, complete: bool) -> list[Delta]:
        """What was held back; `complete`: the output ended by itself (not cut by max_tokens
        or a stop string), so forced JSON can be read as calls."""
        deltas = self._split(self.reasoning.finish()) if self.reasoning is not None else []
        if self.tools is not None:
            deltas += self._tool_events(self.tools.finish())
        if self.plan.mode == "required" and self._forced_text:
            calls = forced_calls(self.plan, self._forced_text) if complete else None
            if calls is None:
                deltas.append(Delta(content=self._forced_text))
            for index, (name, arguments) in enumerate(calls or []):
                deltas += [_start(index, new_call_id(), name), _arguments(index, arguments)]
                self.num_calls += 1
        return deltas

    def _split(self, events: list[ReasoningDelta | ContentDelta]) -> list[Delta]:
        deltas: list[Delta] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                deltas.append(Delta(reasoning_content=event.text))
            else:
                deltas += self._content(event.text)
        return deltas

    def _content(self, text: str) -> list[Delta]:
        mode = self.plan.mode
        if self.tools is not None:
            return self._tool_events(self.tools.feed(text))
        if mode == "required":
            self._forced_text += text
            return []
        if mode == "named":
            assert self.plan.function is not None
            deltas = []
            if self.num_calls == 0:  # the name is known before the arguments begin
                self.num_calls = 1
                deltas.append(_start(0, new_call_id(), self.plan.function))
            return deltas + [_arguments(0, text)]
        return [Delta(content=text)]

    def _tool_events(
        self, events: list[ContentDelta | ToolCallStart | ToolCallArgumentsDelta]
    ) -> list[Delta]:
        deltas = []
        for event in events:
            if isinstance(event, ContentDelta):
                deltas.append(Delta(content=event.text))
            elif isinstance(event, ToolCallStart):
                self.num_calls += 1
                deltas.append(_start(event.index, event.id, event.name))
            else:
                deltas.append(_arguments(event.index, event.arguments))
        return deltas


def ended_by_itself(c: CompletionOutput) -> bool:
    """The model ended the output (EOS, or its grammar was complete): not max_tokens, not a
    stop string or stop token id of the request's. Only such an output is parsed as complete."""
    return c.finish_reason == "stop" and c.stop_reason is None


def whole_message(shaper: ChoiceShaper, text: str, complete: bool) -> AssistantMessage:
    """The message of a finished choice: the stream's deltas, gathered."""
    content, reasoning = [], []
    calls: list[ToolCallOut] = []
    for delta in shaper.feed(text) + shaper.finish(complete):
        if delta.content is not None:
            content.append(delta.content)
        if delta.reasoning_content is not None:
            reasoning.append(delta.reasoning_content)
        for call in delta.tool_calls or []:
            if call.id is not None:
                name = call.function.name or ""
                calls.append(
                    ToolCallOut(id=call.id, function=ToolCallFunction(name=name, arguments=""))
                )
            calls[call.index].function.arguments += call.function.arguments
    joined = "".join(content)
    return AssistantMessage(
        content=joined if joined or not calls else None,
        tool_calls=calls,
        reasoning_content="".join(reasoning) or None,
    )
