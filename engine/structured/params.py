"""What a request constrains its output to: one JSON schema, any JSON, a regex, a choice of
strings, a grammar (vLLM's `StructuredOutputsParams`), or a JSON schema with free text as the
other branch. Pure data: it travels inside SamplingParams, and its `key` names the compiled
grammar in the cache."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema, serialized
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF dialect)
    # A JSON value of this schema (serialized), or free text that begins with neither "{" nor
    # whitespace: the first character says which branch the output took (generic tool calls).
    json_or_text: str | None = None
    # A token id after which the constraint begins (the end of a reasoning block); None: at once.
    starts_after: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_or_text", self.json_or_text),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "give exactly one structured output constraint (json, json_object, regex, "
                f"choice, grammar or json_or_text), got {len(given)}",
                "structured_outputs",
            )
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise InvalidRequestError(
                "a choice must list at least one non-empty string", "structured_outputs"
            )

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputsParams:
        """From a schema object or its JSON text. Key order is kept: it is the order in which
        the properties are generated."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"the JSON schema is not valid JSON: {exc}", "structured_outputs"
                ) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("a JSON schema must be an object", "structured_outputs")
        return cls(json=json.dumps(schema, ensure_ascii=False))

    @property
    def key(self) -> tuple[str, str]:
        """The grammar's source: what the compile cache is keyed by."""
        if self.json is not None:
            return ("json", self.json)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice, ensure_ascii=False))
        if self.json_or_text is not None:
            return ("json_or_text", self.json_or_text)
        assert self.grammar is not None
        return ("grammar", self.grammar)
