"""`--tool-call-parser auto` (server/openai/parsers/choose.py): the format chosen from the real
Qwen3 template, the default model's ChatML, Llama 3 and Mistral style templates and tokens;
a configured name wins over what the template says."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from server.openai.parsers import TOOL_CALL_PARSERS
from server.openai.parsers.choose import choose_tool_call_parser
from tests.support.models import tokenizer_dir

# The shape of Llama 3.1's template: tools as JSON in the user turn, results in the ipython
# role, no <|python_tag|> written by the template itself.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'ipython' or message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' "
    "+ message.content + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
)
MISTRAL_TEMPLATE = (
    "{%- for message in messages %}{%- if message.tool_calls %}[TOOL_CALLS]"
    "{{ message.tool_calls | tojson }}</s>{%- else %}[INST] {{ message.content }} [/INST]"
    "{%- endif %}{%- endfor %}"
)


@dataclass
class FakeTokenizer:
    chat_template: Any
    vocab: dict[str, int] = field(default_factory=dict)

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


@pytest.fixture(scope="module")
def qwen3_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen"))


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model_dir)


def test_qwen3_template_is_hermes(qwen3_tokenizer: Any) -> None:
    choice = choose_tool_call_parser("auto", qwen3_tokenizer)
    assert choice.name == "hermes"
    assert "<tool_call>" in choice.reason


def test_default_models_chatml_is_generic(default_tokenizer: Any) -> None:
    assert "tools" not in default_tokenizer.chat_template  # it ignores them
    choice = choose_tool_call_parser("auto", default_tokenizer)
    assert choice.name == "generic"
    assert "no tool format" in choice.reason


def test_llama3_template_is_llama3_json() -> None:
    choice = choose_tool_call_parser("auto", FakeTokenizer(LLAMA3_TEMPLATE))
    assert choice.name == "llama3_json" and "ipython" in choice.reason
    tagged = FakeTokenizer("{{ '<|python_tag|>' + message.content }}")
    assert choose_tool_call_parser("auto", tagged).name == "llama3_json"


def test_mistral_template_is_mistral() -> None:
    assert choose_tool_call_parser("auto", FakeTokenizer(MISTRAL_TEMPLATE)).name == "mistral"


def test_tokens_decide_when_the_template_is_silent() -> None:
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert choose_tool_call_parser("auto", FakeTokenizer(plain, {"[TOOL_CALLS]": 5})).name == (
        "mistral"
    )
    with_tag = FakeTokenizer(plain, {"<|python_tag|>": 9})
    choice = choose_tool_call_parser("auto", with_tag)
    assert choice.name == "llama3_json" and "token" in choice.reason
    assert choose_tool_call_parser("auto", FakeTokenizer(plain, {"hello": 1})).name == "generic"


def test_named_templates_are_all_read() -> None:
    # A tokenizer may carry several templates by name; the tool one decides.
    named = {"default": "{{ messages }}", "tool_use": "<tool_call>{{ tools }}</tool_call>"}
    assert choose_tool_call_parser("auto", FakeTokenizer(named)).name == "hermes"
    assert choose_tool_call_parser("auto", FakeTokenizer(None)).name == "generic"


@pytest.mark.parametrize("name", ["generic", "hermes", "llama3_json", "mistral"])
def test_a_configured_parser_wins(qwen3_tokenizer: Any, name: str) -> None:
    choice = choose_tool_call_parser(name, qwen3_tokenizer)
    assert (choice.name, choice.reason) == (name, "set by --tool-call-parser")


def test_every_choice_has_a_parser(qwen3_tokenizer: Any, default_tokenizer: Any) -> None:
    for tokenizer in (qwen3_tokenizer, default_tokenizer, FakeTokenizer(LLAMA3_TEMPLATE)):
        assert choose_tool_call_parser("auto", tokenizer).name in TOOL_CALL_PARSERS
