"""What a JSON schema may say here: only keywords the compiled grammar enforces, with bounds
some value can meet and `$ref`s that can end. A schema using anything else would compile and
then let the model write output that violates it, so it is refused (a 400) naming the JSON
pointer of the offending keyword.

The lists follow what xgrammar 0.2.8 was measured to enforce (compile a schema using the
keyword, check that the grammar rejects a value violating it): tests/engine/structured/
test_schema.py repeats those measurements, so an upgrade that changes them fails there."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

from engine.errors import InvalidRequestError

# A keyword's JSON pointer, from its path below the schema being checked.
At = Callable[..., str]

# Say nothing about the value: accepted anywhere (`$id` only at the root, below).
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "$anchor",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)

STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
ARRAY_SIZE_KEYWORDS = frozenset({"minItems", "maxItems"})
OBJECT_SIZE_KEYWORDS = frozenset({"minProperties", "maxProperties"})
# Enforced even without a `type` beside them: the grammar infers an object or an array.
STRUCTURE_KEYWORDS = frozenset(
    {
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "unevaluatedItems",
    }
)
COMBINATORS = frozenset({"anyOf", "oneOf", "allOf"})
ENFORCED = (
    frozenset({"type", "enum", "const", "$ref", "multipleOf"})
    | STRING_KEYWORDS
    | NUMBER_KEYWORDS
    | ARRAY_SIZE_KEYWORDS
    | OBJECT_SIZE_KEYWORDS
    | STRUCTURE_KEYWORDS
    | COMBINATORS
)

# Compiled, and then not enforced: a value violating them passes the grammar.
REFUSED = {
    "not": "is not enforced",
    "if": "is not enforced (nor are its then and else)",
    "dependentRequired": "is not enforced",
    "dependentSchemas": "is not enforced",
    "dependencies": "is not enforced",
    "contains": "is not enforced",
    "minContains": "is not enforced",
    "maxContains": "is not enforced",
    "$dynamicRef": "is not enforced (only local $ref is)",
    "$recursiveRef": "is not enforced (only local $ref is)",
    "contentEncoding": "is not enforced",
    "contentMediaType": "is not enforced",
}

# `format` values whose grammar rejects a malformed string; any other format is refused.
FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})
# Subschemas under these keywords, by shape.
_ONE_SCHEMA = (
    "items",
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_REF_HOPS = 64  # a $ref chain longer than this is not followed to prove oneOf branches apart


class SchemaError(InvalidRequestError):
    """A JSON schema this server cannot enforce honestly; `pointer` locates the keyword."""

    def __init__(self, message: str, pointer: str) -> None:
        super().__init__(f"the JSON schema {message} (at {pointer})", "structured_outputs")
        self.pointer = pointer


def _pointer(tokens: tuple[str, ...]) -> str:
    # RFC 6901, with the leading '#' of a $ref to it.
    return "#" + "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _types(node: dict[str, Any]) -> frozenset[str] | None:
    """The types a node declares; None when it declares none."""
    declared = node.get("type")
    if declared is None:
        return None
    return frozenset([declared] if isinstance(declared, str) else declared)


def _allows(types: frozenset[str], json_type: str) -> bool:
    return json_type in types or (json_type == "integer" and "number" in types)


def check_json_schema(schema: Any) -> None:
    """SchemaError for the first thing in `schema` the grammar would not enforce, or that no
    finite value satisfies."""
    nodes = _walk(schema)
    refs = {tokens: node["$ref"] for tokens, node in nodes.items() if _has_ref(node)}
    _check_cycles(schema, nodes, refs)


def _has_ref(node: Any) -> bool:
    return isinstance(node, dict) and "$ref" in node


def _walk(root: Any) -> dict[tuple[str, ...], Any]:
    """Every subschema, checked, by its location; without recursion (a deep schema is legal
    up to --max-schema-depth). $ref targets outside the usual places are walked too, so that a
    keyword cannot hide in, say, an unknown member that a $ref points into."""
    nodes: dict[tuple[str, ...], Any] = {}
    stack: list[tuple[tuple[str, ...], Any]] = [((), root)]
    while stack:
        tokens, node = stack.pop()
        if tokens in nodes:
            continue
        nodes[tokens] = node
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise SchemaError(
                "has a subschema that is neither an object nor a boolean", _pointer(tokens)
            )
        _check_node(root, tokens, node)
        children = list(_children(tokens, node))
        if "$ref" in node:
            target = _resolve(root, node["$ref"], tokens + ("$ref",))
            children.append(target)
        stack.extend(reversed(children))
    return nodes


def _children(
    tokens: tuple[str, ...], node: dict[str, Any]
) -> Iterator[tuple[tuple[str, ...], Any]]:
    for keyword in _ONE_SCHEMA:
        if keyword in node:
            yield tokens + (keyword,), node[keyword]
    for keyword in _SCHEMA_LISTS:
        value = node.get(keyword)
        if not isinstance(value, list) or (keyword in COMBINATORS and not value):
            if keyword in node:
                raise SchemaError(
                    f"needs a non-empty array for {keyword}", _pointer(tokens + (keyword,))
                )
            continue
        for i, child in enumerate(value):
            yield tokens + (keyword, str(i)), child
    for keyword in _SCHEMA_MAPS:
        value = node.get(keyword)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise SchemaError(f"needs an object for {keyword}", _pointer(tokens + (keyword,)))
        for name, child in value.items():
            yield tokens + (keyword, name), child


def _resolve(root: Any, ref: Any, at: tuple[str, ...]) -> tuple[tuple[str, ...], Any]:
    """A local JSON pointer's target. The grammar resolves '#' and '#/a/b' only, unescaped:
    a remote or anchor $ref compiles to a grammar that accepts anything."""
    where = _pointer(at)
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise SchemaError(
            f"uses $ref {ref!r}: only local references ('#' or '#/...') are enforced", where
        )
    if "~" in ref or "%" in ref:
        raise SchemaError(f"uses $ref {ref!r}: escaped pointers are not resolved", where)
    tokens = tuple(ref[2:].split("/")) if ref != "#" else ()
    node = root
    for token in tokens:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise SchemaError(f"uses $ref {ref!r}, which points at nothing", where)
    return tokens, node


def _check_node(root: Any, tokens: tuple[str, ...], node: dict[str, Any]) -> None:
    def at(*more: str) -> str:
        return _pointer(tokens + more)

    for keyword in node:
        if keyword in REFUSED:
            raise SchemaError(f"uses {keyword}, which {REFUSED[keyword]} here", at(keyword))
    if "$id" in node and tokens:
        raise SchemaError(
            "uses $id below the root, which would move where $ref resolves", at("$id")
        )
    _check_types(node, at)
    _check_siblings(node, at)
    # A property name is a string: the grammar applies string keywords there untyped.
    implied = frozenset({"string"}) if tokens[-1:] == ("propertyNames",) else frozenset()
    _check_typed_keywords(node, _types(node) or implied, at)
    _check_strings(node, at)
    _check_numbers(node, at)
    _check_sizes(node, at)
    _check_object(node, at)
    _check_array(node, at)
    _check_literals(node, at)
    # uniqueItems false asks nothing; true is not enforced.
    if node.get("uniqueItems") not in (None, False):
        raise SchemaError("uses uniqueItems, which is not enforced here", at("uniqueItems"))
    if "allOf" in node and len(node["allOf"]) != 1:
        raise SchemaError(
            "uses allOf with more than one subschema, which is not enforced here", at("allOf")
        )
    if "oneOf" in node:
        _check_one_of(root, node["oneOf"], at)


def _check_types(node: dict[str, Any], at: At) -> None:
    if "type" not in node:
        return
    declared = node["type"]
    listed = [declared] if isinstance(declared, str) else declared
    if not isinstance(listed, list) or not all(isinstance(t, str) and t in TYPES for t in listed):
        raise SchemaError(f"has a type that is not a JSON type: {declared!r}", at("type"))
    if not listed:
        raise SchemaError("has an empty type list, which no value satisfies", at("type"))


def _check_siblings(node: dict[str, Any], at: At) -> None:
    """Beside $ref, a combinator, enum or const the grammar drops every other assertion: it
    compiles only the one."""
    for keyword in ("$ref", "anyOf", "oneOf", "allOf"):
        if keyword in node:
            _only_annotations_beside(node, keyword, frozenset(), at)
    for keyword in ("enum", "const"):
        if keyword in node:
            _only_annotations_beside(node, keyword, frozenset({"type"}), at)


def _only_annotations_beside(
    node: dict[str, Any], keyword: str, also: frozenset[str], at: At
) -> None:
    for other in node:
        if other != keyword and other in ENFORCED and other not in also:
            raise SchemaError(
                f"uses {other} beside {keyword}, which is not enforced here (move it into "
                f"the subschemas)",
                at(other),
            )


def _check_typed_keywords(node: dict[str, Any], types: frozenset[str], at: At) -> None:
    """Length, range, size and format keywords bind only beside a `type` of theirs: without
    one the grammar is any JSON value and ignores them."""
    needs = (
        (STRING_KEYWORDS, ("string",), "string"),
        (NUMBER_KEYWORDS, ("integer", "number"), "integer or number"),
        (ARRAY_SIZE_KEYWORDS, ("array",), "array"),
        (OBJECT_SIZE_KEYWORDS, ("object",), "object"),
    )
    for keywords, wanted, name in needs:
        for keyword in sorted(keywords & node.keys()):
            if not types & set(wanted):
                raise SchemaError(f"uses {keyword} without a type of {name}", at(keyword))
    if "multipleOf" in node:
        step = node["multipleOf"]
        if "integer" not in types or "number" in types:
            raise SchemaError(
                "uses multipleOf, which is enforced only with type integer", at("multipleOf")
            )
        if isinstance(step, bool) or not isinstance(step, int | float) or step <= 0:
            raise SchemaError("needs multipleOf to be a number above 0", at("multipleOf"))
        if not float(step).is_integer():
            raise SchemaError(
                "uses a fractional multipleOf, which is not enforced", at("multipleOf")
            )


def _check_strings(node: dict[str, Any], at: At) -> None:
    """pattern, format and the length bounds each compile to a grammar of its own, and the
    grammar keeps one: together, the others go unenforced."""
    groups = [
        g for g in (("pattern",), ("format",), ("minLength", "maxLength")) if node.keys() & set(g)
    ]
    if len(groups) > 1:
        first, second = (next(k for k in g if k in node) for g in groups[:2])
        raise SchemaError(f"uses {second} beside {first}, which is not enforced here", at(second))
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise SchemaError(
            f"uses format {fmt!r}, which is not enforced here (enforced: "
            f"{', '.join(sorted(FORMATS))})",
            at("format"),
        )
    if "pattern" in node and not isinstance(node["pattern"], str):
        raise SchemaError("needs pattern to be a string", at("pattern"))


def _number(node: dict[str, Any], keyword: str, at: At) -> float | None:
    value = node.get(keyword)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(f"needs {keyword} to be a number, not {value!r}", at(keyword))
    return float(value)


def _check_numbers(node: dict[str, Any], at: At) -> None:
    """A range no number (or, for type integer alone, no integer) lies in."""
    low, low_open = _tighter(node, "minimum", "exclusiveMinimum", max, at)
    high, high_open = _tighter(node, "maximum", "exclusiveMaximum", min, at)
    if low is None or high is None:
        return
    where = at(next(k for k in ("exclusiveMinimum", "minimum") if k in node))
    if _types(node) == frozenset({"integer"}):
        first = math.floor(low) + 1 if low_open else math.ceil(low)
        last = math.ceil(high) - 1 if high_open else math.floor(high)
        if first > last:
            raise SchemaError(f"admits no integer between {low:g} and {high:g}", where)
    elif low > high or (low == high and (low_open or high_open)):
        raise SchemaError(f"admits no number between {low:g} and {high:g}", where)


def _tighter(
    node: dict[str, Any],
    inclusive: str,
    exclusive: str,
    pick: Callable[[float, float], float],
    at: At,
) -> tuple[float | None, bool]:
    """One side of a range, (bound, open): the tighter of its inclusive and exclusive bounds,
    the exclusive one when they are equal."""
    closed, opened = _number(node, inclusive, at), _number(node, exclusive, at)
    if opened is None:
        return closed, False
    if closed is None or pick(closed, opened) == opened:
        return opened, True
    return closed, False


def _size(node: dict[str, Any], keyword: str, at: At) -> int | None:
    value = node.get(keyword)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"needs {keyword} to be an integer of 0 or more", at(keyword))
    return value


def _check_sizes(node: dict[str, Any], at: At) -> None:
    for low_key, high_key in (
        ("minLength", "maxLength"),
        ("minItems", "maxItems"),
        ("minProperties", "maxProperties"),
    ):
        low, high = _size(node, low_key, at), _size(node, high_key, at)
        if low is not None and high is not None and low > high:
            raise SchemaError(f"has {low_key} {low} above {high_key} {high}", at(low_key))


def _check_object(node: dict[str, Any], at: At) -> None:
    """`required` binds only names declared in `properties`: any other required name is
    dropped by the grammar, or can never appear when additional properties are closed."""
    required = node.get("required")
    if required is None:
        return
    if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
        raise SchemaError("needs required to be an array of names", at("required"))
    declared = node.get("properties") or {}
    closed = node.get("additionalProperties", True) is False
    for i, name in enumerate(required):
        if name in declared:
            continue
        if closed:
            raise SchemaError(
                f"requires {name!r}, which additionalProperties false never allows",
                at("required", str(i)),
            )
        raise SchemaError(
            f"requires {name!r} without declaring it in properties, which is not enforced",
            at("required", str(i)),
        )
    most = _size(node, "maxProperties", at)
    if most is not None and len(set(required)) > most:
        raise SchemaError(
            f"requires {len(set(required))} properties but allows at most {most}",
            at("maxProperties"),
        )


def _check_array(node: dict[str, Any], at: At) -> None:
    items = node.get("items")
    if isinstance(items, list):
        raise SchemaError(
            "gives items as an array, which is not supported (use prefixItems)", at("items")
        )
    fewest = _size(node, "minItems", at)
    prefix = node.get("prefixItems") or []
    if items is False and fewest is not None and fewest > len(prefix):
        raise SchemaError(
            f"needs {fewest} items but allows only the {len(prefix)} of prefixItems", at("minItems")
        )


def _check_literals(node: dict[str, Any], at: At) -> None:
    """Beside enum or const the grammar drops `type`: each value must already be of it."""
    if "enum" in node:
        values = node["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError("has an empty enum, which no value satisfies", at("enum"))
        pointers = [at("enum", str(i)) for i in range(len(values))]
    elif "const" in node:
        values, pointers = [node["const"]], [at("const")]
    else:
        return
    types = _types(node)
    if types is None:
        return
    for value, where in zip(values, pointers, strict=True):
        if not _allows(types, _json_type(value)):
            raise SchemaError(
                f"lists {json.dumps(value)}, which is not of its type {sorted(types)}", where
            )


# ----------------------------------------------------------------- oneOf


def _check_one_of(root: Any, branches: list[Any], at: At) -> None:
    """The grammar enforces oneOf as anyOf: a value matching two branches passes. Honest only
    when no value can match two, which is proved here by types, by literals, or by a required
    property whose literals differ (a tagged union)."""
    resolved = [_follow(root, b) for b in branches]
    for i, first in enumerate(resolved):
        for j in range(i + 1, len(resolved)):
            if not _apart(root, first, resolved[j]):
                raise SchemaError(
                    f"uses oneOf whose branches {i} and {j} can match the same value, which "
                    "is not enforced here (use anyOf, or branches apart by type, enum/const "
                    "or a required property's const)",
                    at("oneOf"),
                )


def _follow(root: Any, node: Any) -> Any:
    """Through a chain of $refs to a schema; None for a $ref the walk refuses by itself."""
    for _ in range(_REF_HOPS):
        if not _has_ref(node):
            return node
        try:
            node = _resolve(root, node["$ref"], ())[1]
        except SchemaError:
            return None
    return node


def _literals(node: Any) -> set[str] | None:
    if not isinstance(node, dict):
        return None
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = node["enum"]
    else:
        return None
    # 1 and 1.0 are the same JSON number.
    return {
        json.dumps(float(v) if _json_type(v) in ("integer", "number") else v, sort_keys=True)
        for v in values
    }


def _value_types(node: Any) -> frozenset[str] | None:
    if not isinstance(node, dict):
        return None
    if "const" in node or isinstance(node.get("enum"), list):
        values = [node["const"]] if "const" in node else node["enum"]
        return frozenset(_json_type(v) for v in values)
    types = _types(node)
    if types is not None and "number" in types:
        types = types | {"integer"}
    return types


def _apart(root: Any, a: Any, b: Any) -> bool:
    types_a, types_b = _value_types(a), _value_types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    literals_a, literals_b = _literals(a), _literals(b)
    if literals_a is not None and literals_b is not None:
        return not literals_a & literals_b
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    shared = set(a.get("required") or []) & set(b.get("required") or [])
    for name in shared:
        tag_a = _literals(_follow(root, (a.get("properties") or {}).get(name)))
        tag_b = _literals(_follow(root, (b.get("properties") or {}).get(name)))
        if tag_a is not None and tag_b is not None and not tag_a & tag_b:
            return True
    return False


# ----------------------------------------------------------------- $ref cycles


def _check_cycles(
    root: Any, nodes: dict[tuple[str, ...], Any], refs: dict[tuple[str, ...], str]
) -> None:
    """A $ref whose target admits no finite value (every way through it recurses forever) is
    a trap: the grammar lets the model begin it and never lets it end. Which schemas admit a
    finite value is a least fixed point: leaves do, and a schema does once what it needs does."""
    finite: set[tuple[str, ...]] = set()
    changed = True
    while changed:
        changed = False
        # Children before their parents (the walk's order reversed): most settle in one pass.
        for tokens, node in reversed(nodes.items()):
            if tokens not in finite and _ends(root, tokens, node, finite):
                finite.add(tokens)
                changed = True
    for tokens, ref in sorted(refs.items()):
        target = _resolve(root, ref, tokens + ("$ref",))[0]
        if target not in finite:
            raise SchemaError(
                f"admits no output that ends: $ref {ref!r} recurses with no base case "
                "(every value it allows is infinitely deep)",
                _pointer(tokens + ("$ref",)),
            )


def _ends(root: Any, tokens: tuple[str, ...], node: Any, finite: set[tuple[str, ...]]) -> bool:
    """Whether `node` admits a finite value, given the schemas known to (`finite`). Bounds
    are not weighed: those no value meets are refused before this runs."""
    if isinstance(node, bool):
        return node
    if "$ref" in node:
        return _resolve(root, node["$ref"], tokens)[0] in finite
    if "enum" in node or "const" in node:
        return True
    for keyword in ("anyOf", "oneOf", "allOf"):
        if keyword in node:
            return any(tokens + (keyword, str(i)) in finite for i in range(len(node[keyword])))
    types = _types(node)
    if types is None:
        object_like = node.keys() & {"properties", "required", "additionalProperties"}
        array_like = node.keys() & {"items", "prefixItems"}
        # As the grammar infers it; with neither, any value, and null is one that ends.
        types = frozenset({"object"} if object_like else {"array"} if array_like else {"null"})
    if types - {"object", "array"}:
        return True
    if "object" in types and all(
        tokens + ("properties", name) in finite for name in node.get("required") or []
    ):
        return True
    if "array" in types:
        fewest = node.get("minItems") or 0
        prefix = node.get("prefixItems") or []
        needed = [tokens + ("prefixItems", str(i)) for i in range(min(fewest, len(prefix)))]
        if fewest > len(prefix) and "items" in node:
            needed.append(tokens + ("items",))
        return all(t in finite for t in needed)
    return False
