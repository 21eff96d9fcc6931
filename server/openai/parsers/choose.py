"""`--tool-call-parser auto`: the format a model writes tool calls in, read from its chat
template and its tokenizer's special tokens at start-up, so that tool_choice "auto" works with
no flag. A template that renders tools teaches the model their format; the markers it writes
them with are what tell the formats apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# In order: the first rule that matches wins. A marker is looked for in the template first (it
# says how the model was taught to call), then among the tokenizer's tokens (a model trained
# to call may ship a template that does not show it).
_MARKERS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "hermes"),  # Qwen 2.5/3, Hermes: <tool_call>{json}</tool_call>
    ("[TOOL_CALLS]", "mistral"),  # Mistral: [TOOL_CALLS][{json}, ...]
    ("<|python_tag|>", "llama3_json"),  # Llama 3.x: <|python_tag|> or a bare JSON call
)
# Llama 3.x templates name the role tool results come back in; some never write the tag.
_LLAMA3_ROLE = "ipython"


@dataclass(frozen=True)
class ParserChoice:
    name: str  # a tool-call parser's name (server/openai/parsers/)
    reason: str  # why, for the start-up log


def _template_text(tokenizer: Any) -> str:
    """The chat template(s) as one text: some tokenizers carry several, by name (a separate
    `tool_use` template among them)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):  # the older on-disk shape: [{"name", "template"}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template or ""


def _tokens(tokenizer: Any) -> set[str]:
    try:
        return set(tokenizer.get_vocab())
    except (AttributeError, NotImplementedError):
        return set()


def choose_tool_call_parser(configured: str, tokenizer: Any) -> ParserChoice:
    """The parser to read tool calls with: the configured one, or for "auto" the one the
    template and tokens point to, and `generic` when nothing does."""
    if configured != "auto":
        return ParserChoice(configured, "set by --tool-call-parser")
    template = _template_text(tokenizer)
    for marker, name in _MARKERS:
        if marker in template:
            return ParserChoice(name, f"the chat template writes {marker}")
    if f"'{_LLAMA3_ROLE}'" in template or f'"{_LLAMA3_ROLE}"' in template:
        return ParserChoice("llama3_json", f"the chat template has Llama 3's {_LLAMA3_ROLE} role")
    tokens = _tokens(tokenizer)
    for marker, name in _MARKERS:
        if marker in tokens:
            return ParserChoice(name, f"the tokenizer has the token {marker}")
    return ParserChoice(
        "generic",
        "the chat template has no tool format: tools are described in a system message and "
        "calls constrained to JSON",
    )
