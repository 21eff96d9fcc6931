"""xgrammar 0.2.8 compiles a string with `minLength`/`maxLength` to characters `[^"\\\r\n]`,
which lets a raw tab or any other control character (U+0000-U+001F) into the string, where JSON
forbids it: the output then fails to parse. Such a string is rewritten, before it compiles, as
the same bounds over a pattern without them. Its bounded strings admit no escape either way;
the unbounded ones already exclude control characters."""

from __future__ import annotations

from typing import Any

# A string character JSON takes unescaped: not a control character, a quote or a backslash.
PLAIN_CHARACTER = '[^\\x00-\\x1f"\\\\]'
# Values that are data, not schemas: never rewritten.
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords that already say what the characters are.
CHARACTER_KEYWORDS = frozenset({"pattern", "format", "enum", "const"})


def without_raw_controls(schema: Any) -> Any:
    """A copy of a (checked) schema in which every bounded string, at any depth, is a pattern."""
    if isinstance(schema, list):
        return [without_raw_controls(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    node = {
        key: value if key in DATA_KEYWORDS else without_raw_controls(value)
        for key, value in schema.items()
    }
    low, high = node.get("minLength"), node.get("maxLength")
    bounded = isinstance(low, int) or isinstance(high, int)
    if node.get("type") == "string" and bounded and not CHARACTER_KEYWORDS & node.keys():
        node.pop("minLength", None)
        node.pop("maxLength", None)
        node["pattern"] = f"^{PLAIN_CHARACTER}{{{low or 0},{'' if high is None else high}}}$"
    return node
