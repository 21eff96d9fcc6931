"""`json_or_text` (engine/structured): a JSON value of the schema, or free text that begins with
neither "{" nor whitespace, compiled against a real vocabulary and checked string by string."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputsParams
from engine.structured.compiler import GrammarCompiler
from tests.support.models import tokenizer_dir

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
PARAMS = StructuredOutputsParams(json_or_text=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def accepts() -> Any:
    import xgrammar as xgr

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir("qwen"))
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), tokenizer.eos_token_id)
    grammar = compiler.compile(PARAMS)
    assert compiler.compile(PARAMS) is grammar  # cached by its source

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)

    return accepts


@pytest.mark.parametrize("text", ['{"n": 3}', "Three.", "x{y}", "3 {", "é\n"])
def test_accepts_the_json_or_text(accepts: Any, text: str) -> None:
    assert accepts(text)


@pytest.mark.parametrize("text", ["", '{"n": "3"}', '{"m": 3}', '{"n": 3} ok', " hi", "\n{"])
def test_refuses_anything_else(accepts: Any, text: str) -> None:
    assert not accepts(text)


def test_it_is_one_constraint_with_a_key_of_its_own() -> None:
    assert PARAMS.key == ("json_or_text", json.dumps(SCHEMA))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(json_or_text="{}", regex="a")
