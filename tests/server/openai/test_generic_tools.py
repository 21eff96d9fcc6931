"""The generic tool format (server/openai/chat/generic_tools.py, parsers/generic.py): the grammar
on the default model's vocabulary accepts exactly a calls object of the request's tools or plain
text, the parser reads both back (whole and streamed at every split), and the conversation is
rewritten with our system message for a template that knows no tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.structured.compiler import GrammarCompiler
from server.openai.chat.generic_tools import calls_or_answer, generic_messages, tools_prompt
from server.openai.chat.protocol import ChatTool
from server.openai.inputs import chat_messages, render_chat
from server.openai.parsers import (
    ContentDelta,
    GenericToolParser,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
)
from server.openai.protocol import ChatMessage

TIME = {
    "type": "object",
    "properties": {"timezone": {"enum": ["UTC", "CET"]}},
    "required": ["timezone"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    ChatTool.model_validate(
        {"type": "function", "function": {"name": "get_time", "parameters": TIME}}
    ),
    ChatTool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER,
            },
        }
    ),
]


def calls_text(*calls: tuple[str, dict[str, Any]]) -> str:
    """A calls object as the grammar spells it (json.dumps' separators)."""
    return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def accepts(tokenizer: Any) -> Any:
    import xgrammar as xgr

    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), tokenizer.eos_token_id)

    def accepts(text: str, parallel: bool = True) -> bool:
        """Whether `text`, then the end of the output, is a whole output of the grammar."""
        matcher = xgr.GrammarMatcher(compiler.compile(calls_or_answer(TOOLS, parallel)))
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)

    return accepts


def test_the_grammar_accepts_a_calls_object_or_text(accepts: Any) -> None:
    one = calls_text(("get_time", {"timezone": "UTC"}))
    two = calls_text(("get_time", {"timezone": "CET"}), ("get_weather", {"city": "Paris"}))
    assert accepts(one) and accepts(two)
    assert accepts("It is sunny.") and accepts("Sure: {not json} and more\n")
    assert not accepts(two, parallel=False) and accepts(one, parallel=False)
    # At most one call per tool, so that a list of calls ends.
    three = calls_text(*[("get_time", {"timezone": "UTC"})] * 3)
    assert not accepts(three)


@pytest.mark.parametrize(
    "text",
    [
        "",  # no output at all
        json.dumps({"content": "hello"}),  # a JSON answer is not a shape of this format
        calls_text(("get_date", {})),  # not a tool of the request
        calls_text(("get_time", {"timezone": "PST"})),  # arguments outside the tool's schema
        calls_text(("get_weather", {"town": "Paris"})),
        json.dumps({"tool_calls": []}),  # a calls object with no call
        " " + calls_text(("get_time", {"timezone": "UTC"})),  # whitespace hides the branch
        "\nHello",
        calls_text(("get_time", {"timezone": "UTC"})) + " and text",  # the object ends it
    ],
)
def test_the_grammar_refuses_every_other_shape(accepts: Any, text: str) -> None:
    assert not accepts(text)


def test_a_json_answer_takes_the_place_of_text(tokenizer: Any) -> None:
    """With a response_format, the answer branch is that JSON (its $defs kept at the root,
    where its references point) and free text is no longer an output."""
    import xgrammar as xgr

    from engine.structured import StructuredOutputsParams

    city = {
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/Name"}},
        "required": ["city"],
        "$defs": {"Name": {"type": "string", "maxLength": 10}},
    }
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), tokenizer.eos_token_id)
    for answer, good, bad in (
        (StructuredOutputsParams.json_schema(city), '{"city": "Paris"}', '{"town": "Paris"}'),
        (StructuredOutputsParams(json_object=True), '{"any": [1]}', "[1]"),
    ):
        grammar = compiler.compile(calls_or_answer(TOOLS, True, answer))

        def accepts(text: str, grammar: Any = grammar) -> bool:
            matcher = xgr.GrammarMatcher(grammar)
            return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)

        assert accepts(calls_text(("get_time", {"timezone": "UTC"})))
        assert accepts(good) and not accepts(bad)
        assert not accepts("Plain text.")
    content, calls = extract('{"city": "Paris"}')
    assert (content, calls) == ('{"city": "Paris"}', [])  # an answer, not a call


def extract(text: str) -> tuple[str | None, list[ToolCall]]:
    result = GenericToolParser.extract(text)
    return result.content, result.calls


def test_the_parser_reads_calls_and_text() -> None:
    text = calls_text(("get_time", {"timezone": "UTC"}), ("get_weather", {"city": "Zürich"}))
    content, calls = extract(text)
    assert content is None
    assert calls == [
        ToolCall("get_time", '{"timezone": "UTC"}'),
        ToolCall("get_weather", '{"city": "Zürich"}'),
    ]
    assert extract("It is {sunny}.") == ("It is {sunny}.", [])
    cut = text[:30]  # max_tokens ended it inside the object: what was written, as content
    assert extract(cut) == (cut, [])
    assert extract('{"content": "hi"}') == ('{"content": "hi"}', [])
    twice = calls_text(("get_time", {"timezone": "UTC"}), ("get_time", {"timezone": "UTC"}))
    assert extract(twice) == (None, [ToolCall("get_time", '{"timezone": "UTC"}')])


@pytest.mark.parametrize(
    "text",
    [
        calls_text(("get_time", {"timezone": "UTC"}), ("get_weather", {"city": "a } ] {"})),
        "Plain words, then { braces }.",
        "  \n",
    ],
)
def test_streaming_at_every_split_equals_whole(text: str) -> None:
    whole = GenericToolParser.extract(text)
    for cut in range(len(text) + 1):
        parser = GenericToolParser()
        events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        starts = [e for e in events if isinstance(e, ToolCallStart)]
        arguments = [e.arguments for e in events if isinstance(e, ToolCallArgumentsDelta)]
        assert [s.name for s in starts] == [c.name for c in whole.calls]
        assert arguments == [c.arguments for c in whole.calls]
        assert content == (whole.content or "")


def test_text_streams_from_its_first_character() -> None:
    parser = GenericToolParser()
    assert parser.feed("The") == [ContentDelta("The")]
    assert parser.feed(" answer") == [ContentDelta(" answer")]
    calls = GenericToolParser()
    assert calls.feed('{"tool_calls": [') == []  # held: a call is whole only at the end


def test_the_prompt_tells_tools_and_format() -> None:
    prompt = tools_prompt(TOOLS, parallel=True)
    for tool in TOOLS:
        described = json.loads(
            next(line for line in prompt.splitlines() if tool.function.name in line)
        )
        assert described["parameters"] == tool.function.parameters
    assert '"description": "Weather in a city"' in prompt
    assert '{"tool_calls": [{"name": "TOOL_NAME", "arguments": {...}}]}' in prompt
    assert "up to 2 calls" in prompt and "plain text" in prompt
    assert "exactly one call" in tools_prompt(TOOLS, parallel=False)


def messages(*raw: dict[str, Any]) -> list[dict[str, Any]]:
    return chat_messages([ChatMessage.model_validate(m) for m in raw])


def test_our_system_message_comes_first_or_joins_the_clients() -> None:
    shaped = generic_messages(messages({"role": "user", "content": "Hi"}), TOOLS, True)
    assert [m["role"] for m in shaped] == ["system", "user"]
    assert shaped[0]["content"] == tools_prompt(TOOLS, True)
    own = messages({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    shaped = generic_messages(own, TOOLS, True)
    assert [m["role"] for m in shaped] == ["system", "user"]
    assert shaped[0]["content"] == "Be brief.\n\n" + tools_prompt(TOOLS, True)


def test_earlier_calls_and_results_are_written_in_the_format(tokenizer: Any) -> None:
    call = {
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'},
    }
    history = messages(
        {"role": "user", "content": "Time and weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {**call, "id": "call_1"},
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Sunny"},
    )
    shaped = generic_messages(history, TOOLS, True)
    assert [m["role"] for m in shaped] == ["system", "user", "assistant", "user"]
    assert shaped[2] == {
        "role": "assistant",
        "content": calls_text(
            ("get_time", {"timezone": "UTC"}), ("get_weather", {"city": "Paris"})
        ),
    }
    assert (
        shaped[3]["content"] == "Tool result of get_time: 12:00\nTool result of get_weather: Sunny"
    )
    # The default model's ChatML renders it, calls and results included.
    text = tokenizer.decode(render_chat(tokenizer, shaped, True))
    assert "Tool result of get_weather: Sunny" in text and '"tool_calls"' in text
    assert "You are a helpful AI assistant named SmolLM" not in text  # ours replaces it
