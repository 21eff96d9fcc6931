"""Structured outputs in the engine: a random-weight Qwen3 (whose free output is noise) must
still produce text that its grammar accepts, whatever the sampling settings; the grammar state
survives preemption; logprobs stay those of the raw distribution; the grammar and the other
stop rules (min_tokens, stop strings, ignore_eos) agree; bad constraints are refused."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from config import StructuredOutputsConfig
from engine import LLM, InvalidRequestError, SamplingParams
from engine.structured import GrammarCompiler, StructuredOutputsParams

# Every value is bounded, so a complete object always fits in the token budget below: a random
# model cannot run a string or a number past max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Lima"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"type": "string", "maxLength": 6},
        "sizes": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
    },
    "required": ["city", "ok", "n", "tag", "sizes"],
    "additionalProperties": False,
}
JSON = StructuredOutputsParams.json_schema(SCHEMA)
PROMPTS = [[151644, 872, 198, 9707, 11, 1879, 0], [785, 6722, 315, 9625, 374], [40, 1079] * 20]


@pytest.fixture(scope="module")
def llm(qwen3_dir: Path) -> LLM:
    return LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=256, block_size=16)


def texts(llm: LLM, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list[str]:
    outputs = llm.generate(prompts, params)
    for out in outputs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
    return [c.text for out in outputs for c in out.outputs]


SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "sampled": SamplingParams(temperature=1.0, seed=7, n=3),
    "filtered": SamplingParams(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01, seed=3, n=2),
    "penalized": SamplingParams(
        temperature=0.8, seed=5, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3
    ),
    # A bias towards tokens the grammar forbids: the mask must still win.
    "biased": SamplingParams(temperature=0, logit_bias={"90": 100, "220": 100, "151643": 100}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_json_schema_outputs_validate_under_every_sampling_setting(llm: LLM, setting: str) -> None:
    params = replace(SETTINGS[setting], max_tokens=120, structured_outputs=JSON)
    for text in texts(llm, params):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_unconstrained_output_of_this_model_is_not_json(llm: LLM) -> None:
    """The control: without the grammar, the same model writes noise."""
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for o in out:
        with pytest.raises(ValueError):
            json.loads(o.outputs[0].text)


def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    any_object = SamplingParams(
        temperature=0.7,
        seed=1,
        n=2,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(json_object=True),
    )
    for text in llm.generate(PROMPTS, any_object)[0].outputs:
        if text.finish_reason == "stop":  # any JSON has no bound: a long one may hit max_tokens
            assert isinstance(json.loads(text.text), dict)
        assert text.text.startswith("{")

    regex = r"[A-Z][a-z]{2,5}-\d{3}"
    params = SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=30)
    for text in texts(
        llm, replace(params, structured_outputs=StructuredOutputsParams(regex=regex))
    ):
        assert re.fullmatch(regex, text), text

    choice = ("alpha", 'say "hi"\\', "naïve ☃", "line\nbreak")
    got = texts(llm, replace(params, structured_outputs=StructuredOutputsParams(choice=choice)))
    assert set(got) <= set(choice)

    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    for text in texts(
        llm, replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar))
    ):
        assert re.fullmatch(r"\(\d(\+\d)*\)", text), text


def test_grammar_survives_preemption_with_the_same_tokens(qwen3_dir: Path, llm: LLM) -> None:
    """A pool too small for the batch preempts and recomputes sequences: their grammar state is
    kept with their tokens, so the outputs equal those of a run that never preempts."""
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=JSON)
    prompts = [p + [i] for i in range(6) for p in PROMPTS]
    roomy = llm.generate(prompts, params)
    small = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=24, block_size=16, max_model_len=256)
    tight = small.generate(prompts, params)
    assert small.last_run_stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    for o in tight:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_logprobs_are_the_raw_distribution(llm: LLM) -> None:
    """The chosen tokens' logprobs are the model's, before the mask: the same numbers as the
    prompt logprobs of the prompt followed by those tokens."""
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=2, structured_outputs=JSON)
    out = llm.generate([PROMPTS[1]], params)[0].outputs[0]
    full = PROMPTS[1] + out.token_ids
    echo = llm.generate([full], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.logprobs is not None and echo.prompt_logprobs is not None
    for i, token in enumerate(out.token_ids):
        teacher = echo.prompt_logprobs[len(PROMPTS[1]) + i]
        assert teacher is not None
        assert out.logprobs[i][token] == pytest.approx(teacher[token], abs=1e-4)
    # The top alternatives include tokens the grammar forbade: they are the raw top 2.
    assert any(len(position) > 1 for position in out.logprobs)


def test_grammar_with_min_tokens_stop_strings_and_ignore_eos(llm: LLM) -> None:
    choice = StructuredOutputsParams(choice=("alpha beta", "gamma"))
    base = SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice)
    (plain,) = texts(llm, base, PROMPTS[:1])
    # A complete grammar allows only its end: min_tokens cannot hold it back.
    assert texts(llm, replace(base, min_tokens=15), PROMPTS[:1]) == [plain]
    # ignore_eos: the grammar's end still ends the output.
    assert texts(llm, replace(base, ignore_eos=True), PROMPTS[:1]) == [plain]
    out = llm.generate(
        PROMPTS[:1],
        replace(
            base, structured_outputs=StructuredOutputsParams(choice=("alpha beta",)), stop=[" beta"]
        ),
    )
    c = out[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("alpha", "stop", " beta")


@pytest.mark.parametrize(
    "constraint",
    [
        lambda: StructuredOutputsParams.json_schema({"type": "frobnicate"}),
        lambda: StructuredOutputsParams.json_schema("{not json"),
        lambda: StructuredOutputsParams(regex="(ab"),
        lambda: StructuredOutputsParams(grammar="root ::= undefined_rule"),
        lambda: StructuredOutputsParams(choice=()),
        lambda: StructuredOutputsParams(regex="a", grammar='root ::= "a"'),
    ],
)
def test_bad_constraints_are_refused_before_queueing(llm: LLM, constraint) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=constraint()))
    assert err.value.param == "structured_outputs"
    assert "/project/" not in str(err.value)  # the library's log prefix is dropped
    assert not llm.engine.has_unfinished_requests()


def test_compiled_grammars_are_cached_by_source(llm: LLM) -> None:
    grammars = llm.engine.grammars
    first = grammars.compile(StructuredOutputsParams.json_schema(SCHEMA))
    again = grammars.compile(StructuredOutputsParams.json_schema(json.dumps(SCHEMA)))
    assert again is first
    assert grammars.compile(StructuredOutputsParams(regex="a+")) is not first


def nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def optional_properties(count: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(count)}}


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (lambda: StructuredOutputsParams.json_schema(nested_arrays(900)), "--max-schema-depth"),
        (
            lambda: StructuredOutputsParams.json_schema(optional_properties(5000)),
            "--max-schema-properties",
        ),
        (
            lambda: StructuredOutputsParams(
                grammar="root ::= r0\n"
                + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(20_000))
                + 'r20000 ::= "y"'
            ),
            "--max-grammar-rules",
        ),
        (lambda: StructuredOutputsParams(regex="a" * (2**20 + 1)), "--max-grammar-bytes"),
    ],
)
def test_compile_bombs_are_refused_by_their_size_before_compiling(
    llm: LLM, constraint, words: str
) -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.grammars.compile(constraint())
    assert err.value.param == "structured_outputs" and words in str(err.value)
    assert time.perf_counter() - started < 1.0  # measured, not compiled


@pytest.mark.parametrize(
    "constraint",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        r"[^\s\S]",
    ],
)
def test_a_constraint_no_output_satisfies_is_refused(llm: LLM, constraint: Any) -> None:
    """Before, each compiled and every answer was "" with finish_reason stop."""
    params = (
        StructuredOutputsParams(regex=constraint)
        if isinstance(constraint, str)
        else StructuredOutputsParams.json_schema(constraint)
    )
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=params))
    assert err.value.param == "structured_outputs" and "admits no output" in str(err.value)


def test_large_constraints_within_the_limits_still_compile(llm: LLM) -> None:
    """What real clients send stays accepted: a 20,000-value enum, a 50,000-character regex."""
    grammars = llm.engine.grammars
    enum = {"enum": [f"value-{i}" for i in range(20_000)]}
    grammars.compile(StructuredOutputsParams.json_schema(enum))
    grammars.compile(StructuredOutputsParams(regex="(" + "|".join(["ab"] * 16_000) + ")"))
    grammars.compile(StructuredOutputsParams.json_schema(nested_arrays(20)))


def test_the_grammar_cache_is_bounded_by_memory(qwen3_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)

    def compiler(mib: int) -> GrammarCompiler:
        limits = StructuredOutputsConfig(grammar_cache_mib=mib)
        return GrammarCompiler(lambda: tokenizer, len(tokenizer), tokenizer.eos_token_id, limits)

    params = StructuredOutputsParams.json_schema(SCHEMA)
    kept = compiler(256)
    assert kept.compile(params) is kept.compile(params)
    assert kept._cached_bytes > 0
    none_kept = compiler(0)  # every grammar outweighs a cache of 0 bytes
    assert none_kept.compile(params) is not none_kept.compile(params)
    assert none_kept._cached_bytes == 0 and not none_kept._cache


def accepts(grammar: Any, tokenizer: Any, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_json_allows_bounded_whitespace_or_none(qwen3_dir: Path) -> None:
    """By default a JSON constraint admits compact JSON only; with --json-whitespace 4, the
    pretty-printed JSON too, at most 4 whitespace characters at a time; with -1, any run."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    schema = StructuredOutputsParams.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}}
    )

    def grammar(whitespace: int) -> Any:
        limits = StructuredOutputsConfig(json_whitespace=whitespace)  # 0: the default
        compiler = GrammarCompiler(
            lambda: tokenizer, len(tokenizer), tokenizer.eos_token_id, limits
        )
        return compiler.compile(schema)

    pretty, compact, unbounded = grammar(4), grammar(0), grammar(-1)
    assert accepts(pretty, tokenizer, '{\n  "a": 1\n}') and accepts(pretty, tokenizer, '{"a": 1}')
    assert not accepts(pretty, tokenizer, "{" + " " * 12 + '"a": 1}')
    assert accepts(unbounded, tokenizer, "{" + " " * 12 + '"a": 1}')
    assert accepts(unbounded, tokenizer, '{\n  "a": 1\n}')
    assert accepts(compact, tokenizer, '{"a": 1}')
    assert not accepts(compact, tokenizer, '{\n  "a": 1\n}')


@pytest.mark.parametrize("whitespace", [0, 4, -1])
def test_bounded_strings_admit_no_raw_control_character(qwen3_dir: Path, whitespace: int) -> None:
    """xgrammar's own rule for a string with maxLength lets a raw tab in, which JSON forbids
    (the random model wrote one): the bounds hold and control characters stay out."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    limits = StructuredOutputsConfig(json_whitespace=whitespace)
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), tokenizer.eos_token_id, limits)
    properties = {"tag": {"type": "string", "minLength": 1, "maxLength": 4}}
    # A property named like the keyword is a property, not a bound.
    schema = {"type": "object", "properties": {**properties, "maxLength": {"type": "string"}}}
    grammar = compiler.compile(StructuredOutputsParams.json_schema(schema))

    def admits(tag: str) -> bool:
        # The raw characters, unescaped (json.dumps would escape a tab); the object left open.
        return accepts(grammar, tokenizer, '{"tag": "' + tag + '", "maxLength": "xxxxxxxxx"')

    assert admits("ab蛟") and admits("a") and admits("a b")
    assert not admits("a\tb") and not admits("\x01") and not admits("a\nb")
    assert not admits("") and not admits("abcde")


def test_the_cpu_mask_equals_xgrammars_apply() -> None:
    """The CPU path adds per-byte penalties instead of xgrammar's masked fill: same logits, for
    every row or a subset, a vocabulary that is not a multiple of 32, and bfloat16."""
    import torch
    import xgrammar as xgr

    from engine.structured.state import _apply_on_cpu

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(6, 1000, dtype=dtype)
        for rows in ([0, 1, 2, 3, 4, 5], [1, 4]):
            bitmask = xgr.allocate_token_bitmask(len(rows), 1000)
            bitmask.random_(-(2**31), 2**31 - 1)
            ours = logits.clone()
            _apply_on_cpu(ours, bitmask, rows)
            full = xgr.allocate_token_bitmask(6, 1000)  # all allowed
            full[rows] = bitmask
            theirs = logits.clone()
            xgr.apply_token_bitmask_inplace(theirs, full)
            assert torch.equal(ours, theirs)
            assert (ours.isinf().sum(-1)[rows] > 0).all()
