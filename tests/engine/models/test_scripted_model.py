"""The scripted Qwen3 model: our engine and transformers both follow its script, token for token,
on prompts rendered with the real Qwen3 chat template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.llm import LLM, Message
from engine.processing.tokenization import encode_chat
from engine.sampling_params import SamplingParams
from tests.support.models import hf_greedy, tokenizer_dir
from tests.support.scripted_model import (
    ScriptConflict,
    build_scripted_model,
    merge_scripts,
    script_for,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REASON_AND_CALL = "<think>\nI should call a tool.\n</think>\n\n" + CALL

ASK: list[Message] = [{"role": "user", "content": "What is the weather in Paris?"}]
# A longer conversation with the same tail: only the last three prompt tokens steer the model.
ASK_AGAIN: list[Message] = [
    {"role": "system", "content": "You are a weather bot. Answer with a tool call, always."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hello! Which city?"},
    {"role": "user", "content": "Paris, please."},
]

GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen"))


def no_thinking_prompt(tok: PreTrainedTokenizerBase) -> list[int]:
    text = tok.apply_chat_template(
        cast(list[dict[str, str]], ASK),
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    return list(tok.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory: pytest.TempPathFactory, tok: PreTrainedTokenizerBase) -> Path:
    """Reasons then calls the tool after a thinking prompt; calls it at once after a prompt that
    closed the think block (`enable_thinking=False`)."""
    eos = tok.eos_token_id
    script = merge_scripts(
        script_for(tok, encode_chat(tok, ASK), REASON_AND_CALL, eos),
        script_for(tok, no_thinking_prompt(tok), CALL, eos),
    )
    return build_scripted_model(tmp_path_factory.mktemp("scripted"), script)


@pytest.fixture(scope="module")
def llm(scripted_dir: Path) -> Iterator[LLM]:
    with LLM(str(scripted_dir), num_kv_blocks=64, block_size=16, max_model_len=512) as llm:
        yield llm


def test_the_chat_template_tails_and_the_special_tokens(tok: PreTrainedTokenizerBase) -> None:
    assert encode_chat(tok, ASK)[-3:] == tok.convert_tokens_to_ids(
        ["<|im_start|>", "assistant", "Ċ"]
    )
    assert no_thinking_prompt(tok)[-4:] == tok.convert_tokens_to_ids(
        ["<think>", "ĊĊ", "</think>", "ĊĊ"]
    )
    for special in ["<think>", "</think>", "<tool_call>", "</tool_call>"]:
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_the_engine_follows_the_script_on_chat_prompts(
    llm: LLM, tok: PreTrainedTokenizerBase
) -> None:
    expected = tok.encode(REASON_AND_CALL, add_special_tokens=False)
    outputs = llm.chat([ASK, ASK_AGAIN], GREEDY)
    for out in outputs:
        (sample,) = out.outputs
        assert sample.text == REASON_AND_CALL
        assert sample.token_ids == [*expected, tok.eos_token_id]
        assert sample.finish_reason == "stop"


def test_a_closed_think_block_leads_straight_to_the_call(
    llm: LLM, tok: PreTrainedTokenizerBase
) -> None:
    (out,) = llm.generate(no_thinking_prompt(tok), GREEDY)
    assert out.outputs[0].text == CALL
    assert out.outputs[0].finish_reason == "stop"


def test_transformers_agrees_with_the_engine(
    llm: LLM, tok: PreTrainedTokenizerBase, scripted_dir: Path
) -> None:
    prompts = [encode_chat(tok, ASK), encode_chat(tok, ASK_AGAIN), no_thinking_prompt(tok)]
    ours = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    theirs = hf_greedy(scripted_dir, prompts, max(map(len, ours)))
    assert [t[: len(o)] for t, o in zip(theirs, ours)] == ours
    assert all(o[-1] == tok.eos_token_id for o in ours)


def test_conflicting_scripts_are_refused(tok: PreTrainedTokenizerBase) -> None:
    prompt = encode_chat(tok, ASK)
    # '":' is followed by ' "' after "name" but by ' {"' after "arguments".
    with pytest.raises(ScriptConflict, match="continues as both"):
        script_for(tok, prompt, CALL, tok.eos_token_id, order=1)
    with pytest.raises(ScriptConflict, match="continues as both"):
        merge_scripts(
            script_for(tok, prompt, "Sunny.", tok.eos_token_id),
            script_for(tok, prompt, "Rainy.", tok.eos_token_id),
        )
