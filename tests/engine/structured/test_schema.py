"""Which JSON-schema keywords the compiled grammar enforces, measured: each accepted keyword is
compiled (as the server compiles it) and its grammar must reject a value violating it; each
refused keyword is shown compiling to a grammar that lets a violating value through. An
xgrammar upgrade that changes either fails here, and the lists in engine/structured/schema.py
are then revisited. Then: the refusals themselves (the keyword's JSON pointer named),
unsatisfiable bounds, and $ref cycles with and without a base case."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine import InvalidRequestError
from engine.structured import (
    GrammarCompiler,
    SchemaError,
    StructuredOutputsParams,
    check_json_schema,
)
from engine.structured.schema import ANNOTATIONS, ENFORCED, FORMATS, REFUSED
from tests.support.models import tokenizer_dir
from tests.support.readme import section


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir("qwen"))
    return GrammarCompiler(lambda: tokenizer, len(tokenizer), tokenizer.eos_token_id)


def matches(grammar: Any, text: str) -> bool:
    """Whether the grammar takes the whole of `text` and may end there."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def unchecked(grammars: GrammarCompiler, schema: dict[str, Any]) -> Any:
    """The grammar the server would compile for `schema`, with the keyword check skipped."""
    return grammars._xgrammar().compile_json_schema(json.dumps(schema), **grammars._whitespace())


INT = {"type": "integer"}
OBJ_AB = {"type": "object", "properties": {"a": INT, "b": INT}}

# (keywords proved, schema, values it must accept, values violating it that it must reject).
# Values are written as the grammar writes JSON: ", " and ": " between members.
ENFORCED_CASES: list[tuple[set[str], dict[str, Any], list[str], list[str]]] = [
    ({"type"}, {"type": ["integer", "null"]}, ["1", "null"], ['"1"', "1.5", "true"]),
    ({"enum"}, {"enum": [1, "a"]}, ["1", '"a"'], ["2", '"b"']),
    ({"enum", "type"}, {"type": "integer", "enum": [1, 2]}, ["2"], ["3"]),
    ({"const"}, {"const": "x"}, ['"x"'], ['"y"']),
    ({"properties"}, OBJ_AB, ['{"a": 1}', "{}"], ['{"a": "s"}']),
    ({"required"}, {**OBJ_AB, "required": ["a"]}, ['{"a": 1, "b": 2}'], ["{}", '{"b": 1}']),
    (
        {"additionalProperties"},
        {"type": "object", "additionalProperties": INT},
        ['{"x": 1}'],
        ['{"x": "s"}'],
    ),
    (
        {"additionalProperties"},
        {**OBJ_AB, "additionalProperties": False},
        ['{"a": 1}'],
        ['{"c": 1}', '{"a": 1, "c": 1}'],
    ),
    (
        {"patternProperties"},
        {"type": "object", "patternProperties": {"^x.*$": INT}},
        ['{"xa": 1}'],
        ['{"xa": "s"}'],
    ),
    (
        {"propertyNames"},
        {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": INT},
        ['{"ab": 1}'],
        ['{"abc": 1}'],
    ),
    (
        {"unevaluatedProperties"},
        {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": INT},
        ['{"a": 1, "b": 2}'],
        ['{"b": "s"}'],
    ),
    ({"minProperties"}, {**OBJ_AB, "minProperties": 1}, ['{"a": 1}'], ["{}"]),
    ({"maxProperties"}, {**OBJ_AB, "maxProperties": 1}, ['{"a": 1}'], ['{"a": 1, "b": 2}']),
    ({"items"}, {"type": "array", "items": INT}, ["[1, 2]", "[]"], ['["a"]']),
    (
        {"prefixItems"},
        {"type": "array", "prefixItems": [INT, {"type": "string"}]},
        ['[1, "a"]'],
        ['["a", 1]'],
    ),
    (
        {"unevaluatedItems"},
        {"type": "array", "prefixItems": [INT], "unevaluatedItems": False},
        ["[1]"],
        ["[1, 2]"],
    ),
    ({"minItems"}, {"type": "array", "items": INT, "minItems": 2}, ["[1, 2]"], ["[1]", "[]"]),
    ({"maxItems"}, {"type": "array", "items": INT, "maxItems": 1}, ["[1]"], ["[1, 2]"]),
    ({"minLength"}, {"type": "string", "minLength": 2}, ['"ab"'], ['"a"']),
    ({"maxLength"}, {"type": "string", "maxLength": 2}, ['"ab"'], ['"abc"']),
    ({"pattern"}, {"type": "string", "pattern": "^a+$"}, ['"aa"'], ['"b"', '"ab"']),
    ({"minimum"}, {"type": "number", "minimum": 1.5}, ["1.5", "2"], ["1.4"]),
    ({"maximum"}, {"type": "integer", "maximum": 3}, ["3"], ["4"]),
    ({"exclusiveMinimum"}, {"type": "number", "exclusiveMinimum": 1.5}, ["1.6"], ["1.5"]),
    ({"exclusiveMaximum"}, {"type": "integer", "exclusiveMaximum": 3}, ["2"], ["3"]),
    ({"multipleOf"}, {"type": "integer", "multipleOf": 3}, ["6"], ["4"]),
    ({"anyOf"}, {"anyOf": [INT, {"type": "string"}]}, ["1", '"a"'], ["true"]),
    ({"oneOf"}, {"oneOf": [INT, {"type": "null"}]}, ["1", "null"], ['"a"']),
    ({"allOf"}, {"allOf": [INT]}, ["1"], ['"a"']),
    (
        {"$ref", "$defs"},
        {"$defs": {"n": INT}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
        ['{"a": 1}'],
        ['{"a": "s"}'],
    ),
    (
        {"$ref", "definitions"},
        {"definitions": {"n": INT}, "$ref": "#/definitions/n"},
        ["1"],
        ['"a"'],
    ),
    ({"format"}, {"type": "string", "format": "date"}, ['"2024-02-29"'], ['"2024-13-01"']),
]

# One well-formed and one malformed string per enforced format.
FORMAT_CASES = {
    "date": ("2024-01-31", "2024-01-32"),
    "time": ("12:00:00Z", "noon"),
    "date-time": ("2024-01-31T12:00:00Z", "2024-01-31"),
    "duration": ("P1D", "1 day"),
    "email": ("ab@example.com", "ab@"),
    "hostname": ("example.com", "-x-"),
    "ipv4": ("1.2.3.4", "256.1.1.1"),
    "ipv6": ("::1", "1.2.3.4"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000"),
    "uri": ("https://a.b/c", "x y"),
    "uri-reference": ("/a", "x y"),
    "uri-template": ("/a/{b}", "{"),
    "json-pointer": ("/a/b", "a"),
    "relative-json-pointer": ("0/a", "/a"),
}


def case_id(case: tuple[set[str], Any, Any, Any]) -> str:
    return "+".join(sorted(case[0]))


@pytest.mark.parametrize("case", ENFORCED_CASES, ids=case_id)
def test_each_accepted_keyword_is_enforced_by_the_grammar(
    grammars: GrammarCompiler, case: tuple[set[str], dict[str, Any], list[str], list[str]]
) -> None:
    _, schema, valid, violating = case
    check_json_schema(schema)  # accepted
    grammar = grammars.compile(StructuredOutputsParams.json_schema(schema))
    for text in valid:
        assert matches(grammar, text), text
    for text in violating:
        assert not matches(grammar, text), text


@pytest.mark.parametrize("fmt", sorted(FORMAT_CASES))
def test_each_accepted_format_is_enforced_by_the_grammar(
    grammars: GrammarCompiler, fmt: str
) -> None:
    good, bad = FORMAT_CASES[fmt]
    grammar = grammars.compile(
        StructuredOutputsParams.json_schema({"type": "string", "format": fmt})
    )
    assert matches(grammar, json.dumps(good)) and not matches(grammar, json.dumps(bad))


def test_every_accepted_keyword_and_format_has_its_measurement() -> None:
    proved = set().union(*(keywords for keywords, *_ in ENFORCED_CASES))
    assert ENFORCED | {"$defs", "definitions"} == proved
    assert set(FORMAT_CASES) == FORMATS
    assert not (ENFORCED | ANNOTATIONS) & set(REFUSED)


# (keyword refused, schema using it, a value violating it that the grammar nonetheless takes).
# The refused keyword comes first in its schema: the first refused keyword is the one named.
REFUSED_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("not", {"not": INT}, "1"),
    ("if", {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 10}}, "11"),
    ("dependentRequired", {**OBJ_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ("dependentSchemas", {**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    ("dependencies", {**OBJ_AB, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    ("contains", {"type": "array", "contains": INT}, "[]"),
    (
        "minContains",
        {"type": "array", "items": INT, "minContains": 2, "contains": {"const": 1}},
        "[1, 2]",
    ),
    (
        "maxContains",
        {"type": "array", "items": INT, "maxContains": 1, "contains": {"const": 1}},
        "[1, 1]",
    ),
    (
        "$dynamicRef",
        {"$defs": {"n": {"$dynamicAnchor": "n", **INT}}, "$dynamicRef": "#n"},
        '"a"',
    ),
    (
        "$recursiveRef",
        {"$recursiveAnchor": True, "type": "object", "properties": {"a": {"$recursiveRef": "#"}}},
        '{"a": 1}',
    ),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, '"!!"'),
    ("contentMediaType", {"type": "string", "contentMediaType": "application/json"}, '"{"'),
]


@pytest.mark.parametrize("case", REFUSED_CASES, ids=lambda case: case[0])
def test_each_refused_keyword_is_not_enforced_and_is_refused(
    grammars: GrammarCompiler, case: tuple[str, dict[str, Any], str]
) -> None:
    keyword, schema, violating = case
    assert matches(unchecked(grammars, schema), violating)  # why it is refused
    with pytest.raises(SchemaError) as err:
        check_json_schema(schema)
    assert err.value.pointer.endswith(f"/{keyword}") and keyword in str(err.value)
    assert err.value.param == "structured_outputs"


def test_every_refused_keyword_has_its_measurement() -> None:
    assert {keyword for keyword, *_ in REFUSED_CASES} == set(REFUSED)


# Keywords enforced only in some uses: (schema, pointer refused, a violating value the grammar
# takes). Each shows the use that is refused, and why.
CONDITIONAL_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"minimum": 3}, "#/minimum", "2"),  # no type: any JSON value
    ({"minLength": 2}, "#/minLength", '"a"'),
    ({"minItems": 2}, "#/minItems", "[1]"),
    ({"format": "date"}, "#/format", '"x"'),
    ({"type": "number", "multipleOf": 0.5}, "#/multipleOf", "1.2"),
    ({"type": "number", "multipleOf": 2}, "#/multipleOf", "3"),
    ({"type": "integer", "multipleOf": 1.5}, "#/multipleOf", "2"),
    ({"type": "array", "items": INT, "uniqueItems": True}, "#/uniqueItems", "[1, 1]"),
    (
        {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
        "#/allOf",
        "11",
    ),
    (
        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
        "#/oneOf",
        "5",
    ),
    ({"type": "integer", "anyOf": [{"minimum": 3}, {"maximum": -3}]}, "#/type", "0"),
    ({"type": "string", "enum": ["a", 1]}, "#/enum/1", "1"),
    ({"type": "integer", "const": 3, "minimum": 5}, "#/minimum", "3"),
    ({"$defs": {"n": INT}, "$ref": "#/$defs/n", "minimum": 3}, "#/minimum", "1"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "#/maxLength", '"aaa"'),
    ({"type": "string", "format": "date", "pattern": "^2024"}, "#/format", '"2023-01-01"'),
    ({**OBJ_AB, "required": ["c"]}, "#/required/0", '{"a": 1}'),
    ({"type": "object", "required": ["c"], "additionalProperties": INT}, "#/required/0", "{}"),
    ({"type": "string", "format": "iri"}, "#/format", '"x y"'),
    ({"$id": "https://x/s", "$defs": {"n": INT}, "$ref": "https://x/s#/$defs/n"}, "#/$ref", '"a"'),
]


@pytest.mark.parametrize("case", CONDITIONAL_CASES, ids=lambda case: json.dumps(case[0]))
def test_keywords_are_refused_where_the_grammar_ignores_them(
    grammars: GrammarCompiler, case: tuple[dict[str, Any], str, str]
) -> None:
    schema, pointer, violating = case
    assert matches(unchecked(grammars, schema), violating)
    with pytest.raises(SchemaError) as err:
        check_json_schema(schema)
    assert err.value.pointer == pointer, str(err.value)


def test_annotations_and_unknown_keywords_are_accepted() -> None:
    """What pydantic and SDKs write beside the assertions: nothing that constrains."""
    annotated = dict.fromkeys(ANNOTATIONS - {"deprecated", "readOnly", "writeOnly"}, "x")
    check_json_schema(
        {
            **annotated,
            "type": "object",
            "properties": {
                "when": {"type": "string", "format": "date-time", "title": "When"},
                "maybe": {"anyOf": [INT, {"type": "null"}], "default": None, "deprecated": True},
                "kind": {"type": "string", "enum": ["a", "b"], "x-order": 1},
            },
            "required": ["when"],
            "additionalProperties": False,
        }
    )


def test_the_pointer_names_nested_keywords_escaped() -> None:
    schema = {
        "type": "object",
        "properties": {"a/b~c": {"type": "array", "items": {"not": {"type": "string"}}}},
    }
    with pytest.raises(SchemaError) as err:
        check_json_schema(schema)
    assert err.value.pointer == "#/properties/a~1b~0c/items/not"
    assert "#/properties/a~1b~0c/items/not" in str(err.value)


def test_a_keyword_hidden_where_only_a_ref_reaches_is_found() -> None:
    schema = {"x-library": {"n": {"not": INT}}, "$ref": "#/x-library/n"}
    with pytest.raises(SchemaError) as err:
        check_json_schema(schema)
    assert err.value.pointer == "#/x-library/n/not"


@pytest.mark.parametrize(
    ("schema", "pointer", "words"),
    [
        ({"type": "integer", "minimum": 5, "maximum": 1}, "#/minimum", "no integer"),
        (
            {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
            "#/exclusiveMinimum",
            "no integer",
        ),
        ({"type": "integer", "minimum": 1.5, "maximum": 1.9}, "#/minimum", "no integer"),
        ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, "#/minimum", "no number"),
        ({"type": "string", "minLength": 5, "maxLength": 1}, "#/minLength", "above maxLength"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "#/minItems", "above maxItems"),
        ({"type": "object", "minProperties": 2, "maxProperties": 1}, "#/minProperties", "above"),
        ({"type": "string", "maxLength": -1}, "#/maxLength", "0 or more"),
        ({"enum": []}, "#/enum", "empty enum"),
        ({"type": []}, "#/type", "empty type"),
        ({"anyOf": []}, "#/anyOf", "non-empty"),
        (
            {**OBJ_AB, "required": ["a", "c"], "additionalProperties": False},
            "#/required/1",
            "never allows",
        ),
        ({**OBJ_AB, "required": ["a", "b"], "maxProperties": 1}, "#/maxProperties", "at most 1"),
        (
            {"type": "array", "prefixItems": [INT], "items": False, "minItems": 2},
            "#/minItems",
            "only the 1",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
            "#/properties/a/$ref",
            "nothing",
        ),
    ],
)
def test_unsatisfiable_bounds_are_refused_naming_the_keyword(
    schema: dict[str, Any], pointer: str, words: str
) -> None:
    with pytest.raises(SchemaError) as err:
        check_json_schema(schema)
    assert err.value.pointer == pointer and words in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 3, "maximum": 3},
        {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.5},
        {"type": "string", "minLength": 2, "maxLength": 2},
        {"type": "array", "minItems": 0, "maxItems": 0},
        {**OBJ_AB, "required": ["a", "b"], "additionalProperties": False, "maxProperties": 2},
    ],
)
def test_tight_but_satisfiable_bounds_are_accepted(
    grammars: GrammarCompiler, schema: dict[str, Any]
) -> None:
    check_json_schema(schema)
    grammars.compile(StructuredOutputsParams.json_schema(schema))


TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": INT,
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["v", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
LINKED = {
    "type": "object",
    "properties": {"v": INT, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"],
}


@pytest.mark.parametrize(
    ("schema", "finite", "violating"),
    [
        (
            TREE,
            '{"v": 1, "children": [{"v": 2, "children": []}]}',
            '{"v": 1, "children": [{"v": 2}',
        ),
        (LINKED, '{"v": 1, "next": {"v": 2, "next": null}}', '{"v": 1}'),
        ({"type": "object", "properties": {"next": {"$ref": "#"}}}, '{"next": {}}', '{"next": 1}'),
        ({"type": "array", "items": {"$ref": "#"}}, "[[], [[]]]", "[1]"),
    ],
)
def test_recursive_schemas_with_a_base_case_keep_working(
    grammars: GrammarCompiler, schema: dict[str, Any], finite: str, violating: str
) -> None:
    check_json_schema(schema)
    grammar = grammars.compile(StructuredOutputsParams.json_schema(schema))
    assert matches(grammar, finite) and not matches(grammar, violating)


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"$ref": "#"}, "#/$ref"),
        (
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            "#/properties/a/$ref",
        ),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
            "#/$ref",
        ),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#/items/$ref"),
        (
            {
                "$defs": {
                    "p": {
                        "type": "object",
                        "properties": {"q": {"$ref": "#/$defs/q"}},
                        "required": ["q"],
                    },
                    "q": {"type": "array", "prefixItems": [{"$ref": "#/$defs/p"}], "minItems": 1},
                },
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/p"}},
            },
            "#/$defs/p/properties/q/$ref",
        ),
        ({"anyOf": [{"$ref": "#"}, {"$ref": "#/anyOf/0"}]}, "#/anyOf/0/$ref"),
    ],
)
def test_ref_cycles_with_no_base_case_are_refused(
    grammars: GrammarCompiler, schema: dict[str, Any], pointer: str
) -> None:
    """Each compiles to a grammar that lets the model start a value and never finish it (or
    that admits nothing); refused before compiling, naming a $ref on the cycle."""
    with pytest.raises(SchemaError) as err:
        grammars.compile(StructuredOutputsParams.json_schema(schema))
    assert err.value.pointer == pointer, str(err.value)
    assert "no base case" in str(err.value) and "admits no output" in str(err.value)


def test_the_compiler_refuses_before_compiling_and_caches_nothing(
    grammars: GrammarCompiler,
) -> None:
    """The check runs where every constraint compiles, so LLM and the server both get it."""
    params = StructuredOutputsParams.json_schema(
        {"type": "object", "properties": {"a": {"not": INT}}}
    )
    with pytest.raises(InvalidRequestError) as err:
        grammars.compile(params)
    assert err.value.param == "structured_outputs"
    assert str(err.value).startswith("the JSON schema uses not")
    assert "#/properties/a/not" in str(err.value)
    assert params.key not in grammars._cache


def test_the_docs_list_what_is_enforced_and_what_is_refused() -> None:
    page = section("Structured outputs, tools and reasoning", page="structured-outputs.md")
    for keyword in ENFORCED | set(REFUSED) | FORMATS | ANNOTATIONS | {"uniqueItems: true"}:
        assert f"`{keyword}`" in page, keyword
