"""Structured outputs: constraints on what a request may generate (JSON schema, regex, choice,
grammar), compiled and cached by their source, matched token by token, applied to the logits as
one batched mask per step."""

from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams
from engine.structured.schema import SchemaError, check_json_schema
from engine.structured.state import GrammarState, apply_grammar_masks

__all__ = [
    "GrammarCompiler",
    "GrammarState",
    "SchemaError",
    "StructuredOutputsParams",
    "apply_grammar_masks",
    "check_json_schema",
]
