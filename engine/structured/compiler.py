"""Grammars compiled once per source and kept: xgrammar turns a schema, regex or EBNF into a
matcher-ready grammar against this model's vocabulary. Safe to call from any thread, so the
server compiles (and refuses a bad schema with a 400) off the engine thread, before queueing;
the engine's own call then finds the grammar in the cache."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from config import StructuredOutputsConfig
from engine.errors import InvalidRequestError
from engine.structured.bounded_strings import without_raw_controls
from engine.structured.params import StructuredOutputsParams
from engine.structured.schema import check_json_schema

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# xgrammar's errors begin with a log prefix ("[21:50:53] /project/cpp/x.cc:83: "): drop it.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _message(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip()).split("\n")[0]


def choice_grammar(choice: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of the strings. JSON string escapes (\\" \\\\ \\n \\uXXXX)
    are also EBNF's; non-ASCII text stays as it is."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


# The free-text branch of `json_or_text`: any text whose first character is neither "{" (the
# JSON branch's) nor whitespace (which would hide which branch it is).
TEXT_BRANCH = r"root ::= [^{ \t\r\n] [^]*"


def _compilable(schema: str) -> str:
    return json.dumps(without_raw_controls(json.loads(schema)))


def _depth_and_properties(node: Any) -> tuple[int, int]:
    """A JSON document's nesting depth and how many properties its objects declare (the
    entries of every `properties` member), walked without recursion: a bomb is deep."""
    deepest, properties = 0, 0
    stack = [(node, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            declared = node.get("properties")
            if isinstance(declared, dict):
                properties += len(declared)
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in node)
    return deepest, properties


def check_limits(params: StructuredOutputsParams, limits: StructuredOutputsConfig) -> None:
    """Refuse a constraint whose size alone would make its compile too costly: measured with
    xgrammar 0.2.8, arrays nested 900 deep took ~50 s, 5,000 optional properties minutes, an
    EBNF grammar of 20,001 rules 52-86 s and 4.9 GB."""
    kind, source = params.key
    if len(source.encode()) > limits.max_grammar_bytes:
        raise InvalidRequestError(
            f"the {kind} constraint is {len(source.encode())} bytes, over this server's limit "
            f"of {limits.max_grammar_bytes} (--max-grammar-bytes)",
            "structured_outputs",
        )
    if kind in ("json", "json_or_text"):
        depth, properties = _depth_and_properties(json.loads(source))
        if depth > limits.max_schema_depth:
            raise InvalidRequestError(
                f"the JSON schema nests {depth} deep, over this server's limit of "
                f"{limits.max_schema_depth} (--max-schema-depth)",
                "structured_outputs",
            )
        if properties > limits.max_schema_properties:
            raise InvalidRequestError(
                f"the JSON schema declares {properties} properties, over this server's limit of "
                f"{limits.max_schema_properties} (--max-schema-properties)",
                "structured_outputs",
            )
    elif kind == "grammar":
        rules = source.count("::=")
        if rules > limits.max_grammar_rules:
            raise InvalidRequestError(
                f"the grammar has {rules} rules, over this server's limit of "
                f"{limits.max_grammar_rules} (--max-grammar-rules)",
                "structured_outputs",
            )


def _admits_output(grammar: Any, vocab_size: int) -> bool:
    """Whether any token can begin an output under `grammar`: a grammar none can would make
    every answer empty, silently."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


class GrammarCompiler:
    def __init__(
        self,
        load_tokenizer: Callable[[], PreTrainedTokenizerBase],
        vocab_size: int,
        eos_token_id: int | None,
        limits: StructuredOutputsConfig | None = None,
    ) -> None:
        self.load_tokenizer = load_tokenizer  # a tokenizer of its own, loaded on first use
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.eos_token_id = eos_token_id
        self.limits = limits or StructuredOutputsConfig()
        self.cache_size = 256
        self.cache_bytes = self.limits.grammar_cache_mib * 2**20
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._compiler: Any = None

    def _xgrammar(self) -> Any:
        """The vocabulary is read on first use (0.1-0.5 s), from a tokenizer of its own: the
        engine's is busy detokenizing on another thread, and most servers never see a grammar."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                started = time.perf_counter()
                tokenizer = self.load_tokenizer()
                stop = [self.eos_token_id] if self.eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                log.info("grammar vocabulary read in %.2f s", time.perf_counter() - started)
            return self._compiler

    def _whitespace(self) -> dict[str, Any]:
        """Compact JSON by default: with free whitespace a small model can spend its tokens on
        spaces and newlines. --json-whitespace N allows runs of up to N, for models that write
        pretty-printed JSON better than compact (a bound, so that no output is only spaces);
        -1 allows runs of any length, as vLLM's default grammar does."""
        limit = self.limits.json_whitespace
        if limit == 0:
            return {"any_whitespace": False}
        if limit < 0:
            return {"any_whitespace": True}
        return {"any_whitespace": True, "max_whitespace_cnt": limit}

    def _json_or_text(self, schema: str) -> Any:
        import xgrammar as xgr

        as_json = xgr.Grammar.from_json_schema(_compilable(schema), **self._whitespace())
        return xgr.Grammar.union(as_json, xgr.Grammar.from_ebnf(TEXT_BRANCH))

    def check(self, params: StructuredOutputsParams) -> None:
        """InvalidRequestError for a constraint past the size limits or with schema keywords the
        grammar would not keep: the checks that need no compile, so that a caller can run them
        before queueing for a compile thread (a bomb then gets its own message at once, not the
        deadline's after waiting behind other compiles). Nothing for a cached constraint."""
        with self._lock:
            if params.key in self._cache:
                return
        check_limits(params, self.limits)
        if params.json is not None:
            # After the size limits, which bound this walk; before compiling, which would
            # accept keywords the grammar then ignores.
            check_json_schema(json.loads(params.json))

    def compile(self, params: StructuredOutputsParams, checked: bool = False) -> Any:
        """The compiled grammar (an `xgrammar.CompiledGrammar`), from the cache when it is there;
        InvalidRequestError for a schema, regex or grammar that does not compile. `checked`:
        `check` has passed already."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        if not checked:
            self.check(params)
        compiler = self._xgrammar()
        started = time.perf_counter()
        try:
            if params.json is not None:
                grammar = compiler.compile_json_schema(
                    _compilable(params.json), **self._whitespace()
                )
            elif params.json_object:
                # Any object (OpenAI's JSON mode), with any members: not strict.
                grammar = compiler.compile_json_schema(
                    '{"type": "object"}', strict_mode=False, **self._whitespace()
                )
            elif params.regex is not None:
                grammar = compiler.compile_regex(params.regex)
            elif params.choice is not None:
                grammar = compiler.compile_grammar(choice_grammar(params.choice))
            elif params.json_or_text is not None:
                grammar = compiler.compile_grammar(self._json_or_text(params.json_or_text))
            else:
                grammar = compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as exc:
            kind = key[0].replace("_", " ")
            raise InvalidRequestError(
                f"the {kind} constraint does not compile: {_message(exc)}", "structured_outputs"
            ) from None
        if not _admits_output(grammar, self.vocab_size):
            # ({"$ref": "#"} compiles to `root ::= root`; a regex like [^\\s\\S] to nothing.)
            raise InvalidRequestError(
                f"the {key[0].replace('_', ' ')} constraint admits no output: no token can begin "
                "one (a $ref cycle with no base case, or a pattern nothing matches)",
                "structured_outputs",
            )
        log.debug("compiled a %s grammar in %.3f s", key[0], time.perf_counter() - started)
        with self._lock:
            if key not in self._cache:  # (another thread may have compiled it meanwhile)
                self._cache[key] = grammar
                self._cached_bytes += grammar.memory_size_bytes
            # Bounded by count and by memory: one large grammar can weigh as much as hundreds.
            while self._cache and (
                len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes
            ):
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.memory_size_bytes
        return grammar
