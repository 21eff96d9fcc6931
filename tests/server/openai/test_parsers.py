"""Tool-call and reasoning parsers (server/openai/parsers): whole outputs against expected splits, and
streaming against whole outputs at every split point and in random chunkings.

The Hermes/Qwen texts are rendered by the real Qwen3 chat template (the format the model was
trained to write), so a parse that gets back the rendered calls reads what the model writes.
"""

from __future__ import annotations

import json
import random
import re
from functools import cache
from typing import Any

import pytest

from server.openai.parsers import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    ContentDelta,
    DeepSeekR1ReasoningParser,
    ExtractedToolCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallParser,
    ToolCallStart,
    reasoning_parser_for,
    tool_call_parser_for,
)
from server.openai.parsers.holdback import partial_marker_len
from server.openai.parsers.json_calls import JsonEndScanner
from tests.support.models import tokenizer_dir

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def args(value: dict[str, Any]) -> str:
    """Arguments as OpenAI sends them (and as the parsers must re-serialise them)."""
    return json.dumps(value, ensure_ascii=False)


def calls(*pairs: tuple[str, dict[str, Any]]) -> list[ToolCall]:
    return [ToolCall(name, args(a)) for name, a in pairs]


WEATHER = {"city": "Paris", "unit": "celsius"}
UNICODE = {"city": "Zürich", "note": '東京 → 🌧️ «quoted» "escaped"', "path": "C:\\tmp"}
NESTED = {
    "filter": {"tags": ["a", "b"], "range": {"min": 1, "max": 2.5}, "braces": "} ] { ["},
    "flag": True,
    "nothing": None,
    "list": [[1, [2, {"deep": [3]}]], []],
}


# --- Qwen3 chat template: what the model writes ----------------------------------------------


@cache
def _qwen_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen"))


def qwen_turn(
    content: str, tool_calls: list[tuple[str, dict[str, Any]]], reasoning: str = ""
) -> str:
    """The assistant turn the Qwen3 template renders for this message: what the model, trained
    on the template, writes (its `<think>` block included)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": "a tool",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        for name in sorted({name for name, _ in tool_calls} or {"get_weather"})
    ]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": a}}
            for name, a in tool_calls
        ],
    }
    if reasoning:
        message["reasoning_content"] = reasoning
    rendered = _qwen_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is the weather?"}, message],
        tools=tools,
        tokenize=False,
    )
    head = "<|im_start|>assistant\n"
    turn: str = rendered[rendered.rindex(head) + len(head) : rendered.rindex("<|im_end|>")]
    return turn


QWEN_CASES = [
    ("", [("get_weather", WEATHER)]),
    ("Let me check the weather for you.", [("get_weather", WEATHER)]),
    ("Two cities:", [("get_weather", WEATHER), ("get_weather", {"city": "Berlin"})]),
    ("", [("lookup", UNICODE), ("search", NESTED), ("get_time", {})]),
]


@pytest.mark.parametrize("content, tool_calls", QWEN_CASES)
def test_hermes_reads_qwen3_template_calls(content: str, tool_calls: list) -> None:
    turn = qwen_turn(content, tool_calls)
    _, tag, answer = turn.partition("</think>")
    assert tag and "<tool_call>\n{" in answer  # the template's format: what we parse
    result = HermesToolParser.extract(answer)
    assert result.calls == calls(*tool_calls)
    # The newlines the template puts around the text are the model's, kept as vLLM keeps them;
    # whitespace alone (no text before the calls) is no content.
    assert result.content == ("\n\n" + content + "\n" if content else None)
    assert_streams_like_whole(HermesToolParser, answer)


# --- Whole-output tables -----------------------------------------------------------------------

TC = "<tool_call>\n{}\n</tool_call>"


def hermes_block(name: str, a: Any, key: str = "arguments") -> str:
    return TC.format(json.dumps({"name": name, key: a}, ensure_ascii=False))


HERMES_CASES: list[tuple[str, str | None, list[ToolCall]]] = [
    # (text, content, calls)
    ("Just an answer, no tools.", "Just an answer, no tools.", []),
    ("", "", []),
    ("\n\n", "\n\n", []),
    (hermes_block("get_weather", WEATHER), None, calls(("get_weather", WEATHER))),
    (
        "Let me check.\n" + hermes_block("a", {"x": 1}) + "\n" + hermes_block("b", {"y": [2]}),
        "Let me check.\n",
        calls(("a", {"x": 1}), ("b", {"y": [2]})),
    ),
    # Whitespace alone around calls is dropped; text after the calls is content, kept.
    ("\n\n" + hermes_block("a", {}) + "\n\n", None, calls(("a", {}))),
    (
        hermes_block("a", {}) + "\nI called it.",
        "\nI called it.",
        calls(("a", {})),
    ),
    (hermes_block("lookup", UNICODE), None, calls(("lookup", UNICODE))),
    (hermes_block("search", NESTED), None, calls(("search", NESTED))),
    # \u escapes come back as the characters, as OpenAI sends them.
    (
        '<tool_call>{"name": "f", "arguments": {"city": "Z\\u00fcrich"}}</tool_call>',
        None,
        calls(("f", {"city": "Zürich"})),
    ),
    # Compact, on one line, no newlines inside the tags.
    ('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', None, calls(("f", {"a": 1}))),
    # The output ended before </tool_call> (a stop string, max_tokens): the JSON is whole.
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, calls(("f", {"a": 1}))),
    # Malformed: stays content, word for word, and later good calls still count.
    (
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
        [],
    ),
    (
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>\n'
        + hermes_block("g", {"b": 2}),
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>\n',
        calls(("g", {"b": 2})),
    ),
    (
        hermes_block("g", {"b": 2}) + "\n<tool_call>\n{not json}\n</tool_call>",
        "\n<tool_call>\n{not json}\n</tool_call>",
        calls(("g", {"b": 2})),
    ),
    # JSON that is not a call: no name, arguments not an object, a list, NaN.
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
        [],
    ),
    ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    (
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        [],
    ),
    # Cut off inside the JSON, or inside the tag, or talking about the tag: content.
    ('Sure. <tool_call>\n{"name": "f", "argu', 'Sure. <tool_call>\n{"name": "f", "argu', []),
    ("Sure. <tool_ca", "Sure. <tool_ca", []),
    ("Wrap calls in <tool_call> tags.", "Wrap calls in <tool_call> tags.", []),
    ("a < b and <tool> <tool_x>", "a < b and <tool> <tool_x>", []),
]


@pytest.mark.parametrize("text, content, expected", HERMES_CASES)
def test_hermes_extract(text: str, content: str | None, expected: list[ToolCall]) -> None:
    assert HermesToolParser.extract(text) == ExtractedToolCalls(content, expected)
    assert_streams_like_whole(HermesToolParser, text)


def llama_call(name: str, a: Any, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: a}, ensure_ascii=False)


LLAMA_CASES: list[tuple[str, str | None, list[ToolCall]]] = [
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("", "", []),
    (llama_call("get_weather", WEATHER), None, calls(("get_weather", WEATHER))),
    ("<|python_tag|>" + llama_call("get_weather", WEATHER), None, calls(("get_weather", WEATHER))),
    # "arguments" as well as Llama's "parameters"; leading and trailing whitespace.
    ("\n " + llama_call("f", {"a": 1}, "arguments") + "\n", None, calls(("f", {"a": 1}))),
    (
        llama_call("a", {"x": 1}) + "; " + llama_call("b", UNICODE) + ";" + llama_call("c", NESTED),
        None,
        calls(("a", {"x": 1}), ("b", UNICODE), ("c", NESTED)),
    ),
    (
        "<|python_tag|>" + llama_call("a", {}) + " ;\n" + llama_call("b", {}),
        None,
        calls(("a", {}), ("b", {})),
    ),
    # Text after the calls is content; so is everything from an object that is not a call.
    (llama_call("a", {}) + "\n\nDone.", "\n\nDone.", calls(("a", {}))),
    (
        llama_call("a", {}) + '; {"name": "b", "parameters": {"x": }}',
        '; {"name": "b", "parameters": {"x": }}',
        calls(("a", {})),
    ),
    (llama_call("a", {}) + "; ", "; ", calls(("a", {}))),
    # Only ";" separates calls.
    (
        llama_call("a", {}) + ", " + llama_call("b", {}),
        ", " + llama_call("b", {}),
        calls(("a", {})),
    ),
    # Prose that shows JSON, JSON that is no call, malformed or cut-off JSON: all content.
    ('Use this: {"name": "f", "parameters": {}}', 'Use this: {"name": "f", "parameters": {}}', []),
    ('{"name": "Bob", "age": 42}', '{"name": "Bob", "age": 42}', []),
    ('{"name": "f", "parameters": {"a": }}', '{"name": "f", "parameters": {"a": }}', []),
    ('{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),
    ("<|python_tag|>import math\nmath.pi", "<|python_tag|>import math\nmath.pi", []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ("<|python_ta", "<|python_ta", []),
    ("  <|pyt hon", "  <|pyt hon", []),
]


@pytest.mark.parametrize("text, content, expected", LLAMA_CASES)
def test_llama3_json_extract(text: str, content: str | None, expected: list[ToolCall]) -> None:
    assert Llama3JsonToolParser.extract(text) == ExtractedToolCalls(content, expected)
    assert_streams_like_whole(Llama3JsonToolParser, text)


def mistral_calls(*pairs: tuple[str, dict[str, Any]]) -> str:
    return json.dumps([{"name": n, "arguments": a} for n, a in pairs], ensure_ascii=False)


MISTRAL_CASES: list[tuple[str, str | None, list[ToolCall]]] = [
    ("Paris is the capital.", "Paris is the capital.", []),
    # Mistral 7B v0.3 writes a space after the marker.
    (
        "[TOOL_CALLS] " + mistral_calls(("get_weather", WEATHER)),
        None,
        calls(("get_weather", WEATHER)),
    ),
    (
        "[TOOL_CALLS]" + mistral_calls(("a", UNICODE), ("b", NESTED)),
        None,
        calls(("a", UNICODE), ("b", NESTED)),
    ),
    (
        "I'll look that up.[TOOL_CALLS] " + mistral_calls(("a", {})),
        "I'll look that up.",
        calls(("a", {})),
    ),
    # A single object instead of an array.
    ('[TOOL_CALLS] {"name": "a", "arguments": {"q": 1}}', None, calls(("a", {"q": 1}))),
    # Brackets and quotes inside strings do not end the array.
    (
        '[TOOL_CALLS] [{"name": "a", "arguments": {"q": "x ] } \\" [ {"}}]',
        None,
        calls(("a", {"q": 'x ] } " [ {'})),
    ),
    ("[TOOL_CALLS] " + mistral_calls(("a", {})) + "\nDone.", "\nDone.", calls(("a", {}))),
    # Malformed, not all calls, empty, not JSON, cut off: content, word for word.
    (
        '[TOOL_CALLS] [{"name": "a", "arguments": {"q": }}]',
        '[TOOL_CALLS] [{"name": "a", "arguments": {"q": }}]',
        [],
    ),
    (
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"title": "no call"}]',
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"title": "no call"}]',
        [],
    ),
    ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    ("[TOOL_CALLS] sorry, no.", "[TOOL_CALLS] sorry, no.", []),
    ('[TOOL_CALLS] [{"name": "a", "argu', '[TOOL_CALLS] [{"name": "a", "argu', []),
    ("Text [TOOL_CA", "Text [TOOL_CA", []),
    # A stray marker, then a real one.
    (
        "[TOOL_CALLS]oops [TOOL_CALLS]" + mistral_calls(("a", {})),
        "[TOOL_CALLS]oops ",
        calls(("a", {})),
    ),
]


@pytest.mark.parametrize("text, content, expected", MISTRAL_CASES)
def test_mistral_extract(text: str, content: str | None, expected: list[ToolCall]) -> None:
    assert MistralToolParser.extract(text) == ExtractedToolCalls(content, expected)
    assert_streams_like_whole(MistralToolParser, text)


ALL_TOOL_CASES = (
    [(HermesToolParser, text) for text, _, _ in HERMES_CASES]
    + [(Llama3JsonToolParser, t) for t, _, _ in LLAMA_CASES]
    + [(MistralToolParser, t) for t, _, _ in MISTRAL_CASES]
)


@pytest.mark.parametrize("parser, text", ALL_TOOL_CASES)
def test_without_calls_the_content_is_the_text(parser: type[ToolCallParser], text: str) -> None:
    result = parser.extract(text)
    if not result.calls:
        assert result.content == text


# --- Streaming equals whole output ----------------------------------------------------------


def stream_tool(parser_cls: type[ToolCallParser], pieces: list[str]) -> ExtractedToolCalls:
    """Feed the pieces; check the events' shape; what a client would assemble from them."""
    parser = parser_cls()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    names: dict[int, str] = {}
    ids: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index == len(names), "calls are numbered 0, 1, ... in order"
            assert CALL_ID.fullmatch(event.id)
            names[event.index], ids[event.index], arguments[event.index] = event.name, event.id, ""
        elif isinstance(event, ToolCallArgumentsDelta):
            assert event.index in names, "a call's arguments come after its name"
            arguments[event.index] += event.arguments
        else:
            assert isinstance(event, ContentDelta) and event.text
    assert len(set(ids.values())) == len(ids), "ids are unique"
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    found = [ToolCall(names[i], arguments[i], ids[i]) for i in range(len(names))]
    return ExtractedToolCalls(content if content or not found else None, found)


def chunkings(text: str, seed: int = 0, random_ones: int = 12) -> list[list[str]]:
    """Every split in two, one character at a time, and random chunkings (fixed seed)."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(seed)
    for _ in range(random_ones):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def assert_streams_like_whole(parser_cls: type[ToolCallParser], text: str) -> None:
    whole = parser_cls.extract(text)
    for pieces in chunkings(text):
        assert stream_tool(parser_cls, pieces) == whole, pieces


def test_ids_are_unique_and_unguessable() -> None:
    text = hermes_block("a", {}) + hermes_block("b", {})
    seen = set()
    for _ in range(50):
        result = HermesToolParser.extract(text)
        assert all(CALL_ID.fullmatch(c.id) for c in result.calls)
        seen.update(c.id for c in result.calls)
    assert len(seen) == 100


# --- Holding back a partial marker ------------------------------------------------------------


def content_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def test_hermes_holds_back_only_a_possible_marker() -> None:
    p = HermesToolParser()
    assert content_of(p.feed("Hello <tool")) == "Hello "  # "<tool" may start <tool_call>
    assert content_of(p.feed("box> and <")) == "<toolbox> and "  # it did not
    assert p.feed("tool_call>\n") == []  # it did: the block is held until it closes
    assert p.feed('{"name": "f", "arguments": {"a": 1}}\n') == []
    events = p.feed("</tool_call>")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta]
    assert events[1] == ToolCallArgumentsDelta(0, '{"a": 1}')
    assert p.feed("\n") == []  # whitespace after a call: held, dropped at the end
    assert p.finish() == []


def test_mistral_holds_back_only_a_possible_marker() -> None:
    p = MistralToolParser()
    assert content_of(p.feed("See [TOOL")) == "See "
    assert content_of(p.feed("S] x")) == "[TOOLS] x"
    assert content_of(p.finish()) == ""


def test_llama3_json_decides_at_the_first_character() -> None:
    p = Llama3JsonToolParser()
    assert p.feed(" ") == []
    assert content_of(p.feed("The")) == " The"  # prose: streamed from then on
    assert content_of(p.feed(' {"name"')) == ' {"name"'
    p = Llama3JsonToolParser()
    assert p.feed("<|python") == []
    assert p.feed('_tag|>{"name": "f", "parameters": {}') == []
    assert [type(e) for e in p.feed("}")] == [ToolCallStart, ToolCallArgumentsDelta]


def test_content_events_are_text_before_calls() -> None:
    """Text before a call reaches the client before the call, not after."""
    events = stream_events(HermesToolParser, ["Checking.\n", hermes_block("a", {})])
    assert isinstance(events[0], ContentDelta) and events[0].text == "Checking.\n"


def stream_events(parser_cls: type[ToolCallParser], pieces: list[str]) -> list:
    parser = parser_cls()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def test_feed_after_finish_is_an_error() -> None:
    p = HermesToolParser()
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")
    with pytest.raises(RuntimeError):
        p.finish()


def test_partial_marker_len() -> None:
    assert partial_marker_len("abc <tool_c", "<tool_call>") == len("<tool_c")
    assert partial_marker_len("abc <", "<tool_call>") == 1
    assert partial_marker_len("abc", "<tool_call>") == 0
    assert partial_marker_len("<tool_call>", "<tool_call>") == 0  # whole: not partial
    assert partial_marker_len("[[", "[[x") == 2


def test_json_end_scanner_fed_piecewise() -> None:
    text = '{"a": "}\\"{", "b": [1, {"c": "]"}]} tail'
    scanner = JsonEndScanner()
    ends = [scanner.end(text[:i]) for i in range(1, len(text) + 1)]
    close = text.index("} tail") + 1
    assert ends[: close - 1] == [None] * (close - 1)
    assert ends[close - 1] == close


def test_deeply_nested_json_is_content_not_a_crash() -> None:
    text = (
        '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    )
    assert HermesToolParser.extract(text) == ExtractedToolCalls(text, [])


# --- Registry --------------------------------------------------------------------------------


def test_registry() -> None:
    assert TOOL_CALL_PARSER_NAMES == ("generic", "hermes", "llama3_json", "mistral")
    for name in TOOL_CALL_PARSER_NAMES:
        assert tool_call_parser_for(name).name == name
    assert tool_call_parser_for("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="generic, hermes, llama3_json, mistral"):
        tool_call_parser_for("pythonic")


def test_parsers_do_not_share_state() -> None:
    a, b = HermesToolParser(), HermesToolParser()
    a.feed("<tool_call>")
    assert content_of(b.feed("plain") + b.finish()) == "plain"


# --- Reasoning ------------------------------------------------------------------------------

REASONING_CASES: list[tuple[str, tuple[str | None, str | None], tuple[str | None, str | None]]] = [
    # (text, qwen3 (reasoning, content), deepseek_r1 (reasoning, content))
    (
        "<think>\nThe user asks 2+2.\n</think>\n\nThe answer is 4.",
        ("\nThe user asks 2+2.\n", "\n\nThe answer is 4."),
        ("\nThe user asks 2+2.\n", "\n\nThe answer is 4."),
    ),
    # <think> was in the prompt (DeepSeek-R1's template): only </think> in the output.
    (
        "The user asks 2+2.\n</think>\n\n4",
        (None, "The user asks 2+2.\n</think>\n\n4"),
        ("The user asks 2+2.\n", "\n\n4"),
    ),
    # Cut off while thinking.
    ("<think>\nHmm, let me", ("\nHmm, let me", None), ("\nHmm, let me", None)),
    ("<think>\nHmm </thi", ("\nHmm </thi", None), ("\nHmm </thi", None)),
    # No tags: thinking disabled (qwen3) or cut off while thinking (deepseek_r1).
    ("Just the answer.", (None, "Just the answer."), ("Just the answer.", None)),
    ("", (None, None), (None, None)),
    ("<think>\n\n</think>\n\nHi", ("\n\n", "\n\nHi"), ("\n\n", "\n\nHi")),
    ("<think></think>Hi", (None, "Hi"), (None, "Hi")),
    ("<think>why</think>", ("why", None), ("why", None)),
    # Only the first </think> ends the reasoning; only a leading <think> opens it.
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("About <think> tags.", (None, "About <think> tags."), ("About <think> tags.", None)),
    ("a</think>b", (None, "a</think>b"), ("a", "b")),
    ("<thi", (None, "<thi"), ("<thi", None)),
    ("<thinking>x", (None, "<thinking>x"), ("<thinking>x", None)),
    ("<think><think>x</think>", ("<think>x", None), ("<think>x", None)),
    ("<think>Zürich 東京 🌧️</think>天気", ("Zürich 東京 🌧️", "天気"), ("Zürich 東京 🌧️", "天気")),
]


@pytest.mark.parametrize("text, qwen3, deepseek_r1", REASONING_CASES)
def test_reasoning_extract(text: str, qwen3: tuple, deepseek_r1: tuple) -> None:
    assert Qwen3ReasoningParser.extract(text) == qwen3
    assert DeepSeekR1ReasoningParser.extract(text) == deepseek_r1
    for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser):
        assert_reasoning_streams_like_whole(parser, text)


def stream_reasoning(parser_cls: type[ReasoningParser], pieces: list[str]) -> tuple:
    parser = parser_cls()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    kinds = [type(e) for e in events]
    assert all(e.text for e in events)
    # Reasoning, then content: never back.
    assert kinds == sorted(kinds, key=lambda k: k is ContentDelta)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return reasoning or None, content or None


def assert_reasoning_streams_like_whole(parser_cls: type[ReasoningParser], text: str) -> None:
    whole = parser_cls.extract(text)
    for pieces in chunkings(text):
        assert stream_reasoning(parser_cls, pieces) == whole, pieces


def test_reasoning_holds_back_partial_tags() -> None:
    p = Qwen3ReasoningParser()
    assert p.feed("<thi") == []
    assert p.feed("nk>\nStep one") == [ReasoningDelta("\nStep one")]
    assert p.feed(".</th") == [ReasoningDelta(".")]
    assert p.feed("ink>\n\nAnswer") == [ContentDelta("\n\nAnswer")]
    assert p.finish() == []
    p = Qwen3ReasoningParser()
    assert p.feed("<tho") == [ContentDelta("<tho")]  # not the tag: thinking disabled
    p = DeepSeekR1ReasoningParser()
    assert p.feed("Step </think") == [ReasoningDelta("Step ")]
    assert p.finish() == [ReasoningDelta("</think")]


def test_qwen3_prompt_without_thinking_gives_content() -> None:
    """enable_thinking=False: the template closes an empty think block in the prompt, so the
    model writes no tag and the qwen3 parser reads all of it as content."""
    prompt = _qwen_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert Qwen3ReasoningParser.extract("Hello! How can I help?") == (
        None,
        "Hello! How can I help?",
    )


def test_reasoning_parsers_expose_their_tags() -> None:
    """The server looks the end tag up in the vocabulary to find the end-of-reasoning token."""
    vocab = _qwen_tokenizer().get_vocab()
    for name in REASONING_PARSER_NAMES:
        parser = reasoning_parser_for(name)
        assert (parser.start, parser.end) == ("<think>", "</think>")
        assert parser.start in vocab and parser.end in vocab


def test_reasoning_registry() -> None:
    assert REASONING_PARSER_NAMES == ("deepseek_r1", "qwen3")
    assert reasoning_parser_for("qwen3") is Qwen3ReasoningParser
    assert reasoning_parser_for("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser_for("granite")


def test_reasoning_finish_twice_is_an_error() -> None:
    p = Qwen3ReasoningParser()
    p.finish()
    with pytest.raises(RuntimeError):
        p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


@pytest.mark.parametrize("content, tool_calls", QWEN_CASES)
def test_qwen3_reasoning_then_hermes_on_template_output(content: str, tool_calls: list) -> None:
    """The chat route's pipeline: the reasoning parser first, the tool parser on its content."""
    turn = qwen_turn(content, tool_calls, reasoning="The user wants the weather.\nCall the tool.")
    reasoning, answer = Qwen3ReasoningParser.extract(turn)
    assert reasoning == "\nThe user wants the weather.\nCall the tool.\n"
    assert answer is not None
    result = HermesToolParser.extract(answer)
    assert result.calls == calls(*tool_calls)
    assert result.content == ("\n\n" + content + "\n" if content else None)
    assert_streams_like_whole(HermesToolParser, answer)
    assert_reasoning_streams_like_whole(Qwen3ReasoningParser, turn)


def test_the_server_flags_offer_exactly_the_registered_parsers() -> None:
    """config/ may not import server/, so its flag choices are literals: they must match (and
    `auto`, which chooses one of them at start-up)."""
    from typing import get_args

    from config.server_config import ReasoningParserName, ToolCallParserName

    assert get_args(ToolCallParserName) == ("auto", *TOOL_CALL_PARSER_NAMES)
    assert get_args(ReasoningParserName) == REASONING_PARSER_NAMES
