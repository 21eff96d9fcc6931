"""Embeddings from the engine's pooling mode against transformers on the same weights: the
bundled all-MiniLM-L6-v2 (BERT encoder, mean pooling, normalized), and decoder pooling on a
random-weight Llama. Batched or alone, chunk budget or not, every input's blocks go back."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, InvalidRequestError, ModelLoadError, PoolingParams
from tests.support.embedding import cosines, hf_embed, minilm_tokenizer, mixed_texts

TEXTS = ["hello world", "A paged KV cache keeps blocks of keys and values.", "x"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(runner="pooling", dtype="float32", max_num_seqs=64)


def _vectors(outputs) -> torch.Tensor:
    return torch.stack([o.outputs.data for o in outputs])


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.requests and not engine.scheduler.has_unfinished()
    assert engine.kv.pool.num_free == engine.info.num_kv_blocks


def test_single_inputs_match_transformers(llm: LLM) -> None:
    for text in TEXTS:
        (out,) = llm.embed(text)
        assert out.outputs is not None and len(out.outputs.embedding) == 384
        assert out.prompt_token_ids == minilm_tokenizer()(text).input_ids
        assert cosines(out.outputs.data, hf_embed([text])[0]) >= 0.99999
        assert abs(float(out.outputs.data.norm()) - 1.0) < 1e-5
    _assert_idle(llm)


def test_64_mixed_lengths_in_one_step_match_transformers(llm: LLM) -> None:
    texts = mixed_texts(64)
    outs = llm.embed(texts)
    steps = llm.last_run_stats.iteration_tokens  # 2048 a step: whole inputs in a few steps
    assert sum(steps) == sum(len(o.prompt_token_ids) for o in outs) and 1 < len(steps) < 8
    got = _vectors(outs)
    assert cosines(got, hf_embed(texts)).min() >= 0.99999
    alone = _vectors([llm.embed(t)[0] for t in texts[:8]])
    assert cosines(got[:8], alone).min() >= 0.99999  # batching changes nothing
    _assert_idle(llm)


def test_equals_sentence_transformers_encode(llm: LLM) -> None:
    """sentence-transformers' own pipeline (its tokenizer settings, Pooling and Normalize
    modules read from the same files), batched as it batches."""
    from sentence_transformers import SentenceTransformer

    from tests.support.embedding import minilm_dir

    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    texts = mixed_texts(64)
    expected = torch.from_numpy(st.encode(texts, batch_size=16))
    assert cosines(_vectors(llm.embed(texts)), expected).min() >= 0.99999


def test_token_id_inputs(llm: LLM) -> None:
    ids = minilm_tokenizer()("token ids given directly").input_ids
    (out,) = llm.embed(ids)
    assert cosines(out.outputs.data, hf_embed([ids])[0]) >= 0.99999


def test_small_budget_schedules_each_input_whole() -> None:
    """A budget of 64 tokens: inputs of 30-60 tokens are never split across steps (a split
    would pool half an input); each step holds only whole inputs."""
    llm = LLM(runner="pooling", dtype="float32", max_num_batched_tokens=64, max_model_len=64)
    tok = minilm_tokenizer()
    texts = [t for t in mixed_texts(40) if 30 <= len(tok(t).input_ids) <= 60][:6]
    assert len(texts) == 6
    outs = llm.embed(texts)
    lengths = [len(o.prompt_token_ids) for o in outs]
    steps = llm.last_run_stats.iteration_tokens
    assert sum(steps) == sum(lengths) and len(steps) >= 4
    assert all(step in _subset_sums(lengths) for step in steps)
    assert cosines(_vectors(outs), hf_embed(texts)).min() >= 0.99999
    _assert_idle(llm)
    with pytest.raises(InvalidRequestError, match="max_model_len") as info:
        llm.embed(" ".join(["word"] * 80))
    assert info.value.param == "prompts"


def _subset_sums(values: list[int]) -> set[int]:
    sums = {0}
    for v in values:
        sums |= {s + v for s in sums}
    return sums


def test_truncate_prompt_tokens(llm: LLM) -> None:
    long = " ".join(str(i) for i in range(400))  # every token different
    with pytest.raises(InvalidRequestError, match="256"):
        llm.embed(long)
    (out,) = llm.embed(long, truncate_prompt_tokens=-1)
    tokenizer = minilm_tokenizer()
    content = tokenizer(long, add_special_tokens=False).input_ids
    # vLLM's rule: the last tokens, here between [CLS] and [SEP].
    ids = [tokenizer.cls_token_id, *content[-254:], tokenizer.sep_token_id]
    assert out.prompt_token_ids == ids and len(ids) == 256
    assert cosines(out.outputs.data, hf_embed([ids])[0]) >= 0.99999
    (short,) = llm.embed(list(range(1000, 1020)), truncate_prompt_tokens=5)
    assert short.prompt_token_ids == list(range(1015, 1020))


def test_bad_inputs(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.embed([[]])
    assert info.value.param == "prompts"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.embed([[101, 30522, 102]])
    with pytest.raises(InvalidRequestError) as info:
        llm.embed("a", PoolingParams(dimensions=128))
    assert info.value.param == "dimensions"
    with pytest.raises(InvalidRequestError, match="embeds") as info:
        llm.generate("hello")
    assert info.value.param == "model"
    _assert_idle(llm)


def test_bf16_close_to_float32_oracle() -> None:
    llm = LLM(runner="pooling", dtype="bfloat16")
    texts = mixed_texts(16)
    assert cosines(_vectors(llm.embed(texts)), hf_embed(texts)).min() >= 0.999


def test_encoder_cannot_generate() -> None:
    with pytest.raises(ModelLoadError, match="--runner pooling"):
        LLM(runner="generate", model=str(_minilm()))


def _minilm():
    from tests.support.embedding import minilm_dir

    return minilm_dir()


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_decoder_pooling_matches_transformers(llama_dir, pooling_type: str) -> None:
    """A causal model pooled: its final-norm hidden states (transformers' last_hidden_state),
    reduced per the pooling type, normalized (no modules.json: the decoder default). Prefix
    caching is asked for and must not serve a pooled input from the cache."""
    from transformers import AutoModel

    llm = LLM(
        model=str(llama_dir),
        runner="pooling",
        pooling_type=pooling_type,
        dtype="float32",
        enable_prefix_caching=True,
        block_size=16,
    )
    hf = AutoModel.from_pretrained(llama_dir, dtype=torch.float32).eval()
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 40)]  # the last two share blocks
    got = _vectors(llm.embed(prompts))
    for row, ids in zip(got, prompts):
        with torch.inference_mode():
            hidden = hf(input_ids=torch.tensor([ids])).last_hidden_state[0]
        pick = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type]
        assert cosines(row, torch.nn.functional.normalize(pick, dim=0)) >= 0.99999
        assert abs(float(row.norm()) - 1.0) < 1e-5
    _assert_idle(llm)


def test_matryoshka_dimensions(llama_dir, tmp_path) -> None:
    """A checkpoint that declares Matryoshka dimensions: `dimensions` keeps a prefix of the
    embedding, normalized again; beyond the model's size it is refused."""
    import json

    folder = tmp_path / "matryoshka"
    folder.mkdir()
    for item in llama_dir.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"matryoshka_dimensions": [64, 16]})
    )
    llm = LLM(model=str(folder), runner="pooling", dtype="float32")
    prompt = list(range(7, 40))
    (full,) = llm.embed(prompt)
    (cut,) = llm.embed(prompt, PoolingParams(dimensions=16))
    assert cut.outputs is not None and full.outputs is not None
    expected = torch.nn.functional.normalize(full.outputs.data[:16], dim=0)
    assert torch.allclose(cut.outputs.data, expected, atol=1e-6)
    with pytest.raises(InvalidRequestError) as info:
        llm.embed(prompt, PoolingParams(dimensions=65))
    assert info.value.param == "dimensions"
