"""GGUF files served from their blocks: the default model's Q4_1 layers and Q8_0 embedding read
into the quantized kernel's layout (never bf16), de-quantizing bit for bit to the weights
transformers converts the same file into; served in float32, the default model's greedy tokens
equal transformers' on those weights; in bfloat16, its agreement with the bf16 model and its
largest logprob error, within stated bounds. Then files that cannot be read: truncated, an
unsupported block type, a shape that lies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from config import ConfigError
from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.loading.default_model import gguf_path
from engine.loading.gguf_checkpoint import (
    dense,
    quantized,
    read_tensors,
    unpermute_dense,
    unpermute_rows,
)
from engine.models.layers.linear import PackableLinear
from tests.support.models import hf_greedy

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [9690, 314, 253, 1345, 1500, 282, 284, 1345, 30]]
MAX_TOKENS = 6


def test_blocks_dequantize_to_what_transformers_converts_the_file_into(
    default_model_dir: Path,
) -> None:
    converted = load_file(str(default_model_dir / "model.safetensors"))
    heads = {"q_proj": 9, "k_proj": 3}
    types: dict[str, int] = {}
    for tensor in read_tensors(gguf_path()):
        types[tensor.type] = types.get(tensor.type, 0) + 1
        permute = next((h for key, h in heads.items() if key in tensor.hf_name), None)
        if tensor.type in ("F32", "F16"):
            value = dense(tensor).float()
            value = value if permute is None else unpermute_dense(value, permute)
        else:
            weight = quantized(tensor)
            weight = weight if permute is None else unpermute_rows(weight, permute)
            value = weight.dequantize()
        assert torch.equal(value, converted[tensor.hf_name]), tensor.name
    assert types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}


@pytest.fixture(scope="module")
def gguf_float32() -> Iterator[LLM]:
    # The file itself, as `pagedserve serve file.gguf` names it: the format is detected.
    with LLM(str(gguf_path()), dtype="float32", num_kv_blocks=64, max_model_len=256) as llm:
        yield llm


def test_the_file_is_served_from_its_blocks(gguf_float32: LLM) -> None:
    model = gguf_float32.engine.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    assert len(linears) == 30 * 4  # qkv, o, gate_up, down
    assert all(
        m.weight is None and m.quantized is not None and m.quantized.bits == 4 for m in linears
    )
    assert model.lm_head_quantized is not None and model.lm_head_quantized.bits == 8


def test_float32_greedy_equals_transformers_on_the_dequantized_file(
    gguf_float32: LLM, default_model_dir: Path
) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in gguf_float32.generate(PROMPTS, params)]
    assert got == hf_greedy(default_model_dir, PROMPTS, MAX_TOKENS)


def test_a_truncated_file_is_refused_naming_the_file_and_tensor(tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with gguf_path().open("rb") as f:  # the header and metadata whole, the tensors' data cut
        cut.write_bytes(f.read(3 << 20))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        list(read_tensors(cut))


def _tiny_gguf(path: Path, kind: str, rows: int, cols: int) -> Path:
    """A llama GGUF holding one q projection of `kind` blocks (random bytes)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 255, (rows, cols // block * size), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_block_type_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "q2.gguf", "Q2_K", 64, 256)
    with pytest.raises(ModelLoadError, match=r"q2\.gguf: tensor blk\.0\.attn_q\.weight is Q2_K"):
        list(read_tensors(path))


def test_a_quantized_vector_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "norm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType.Q8_0
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros(256 // block * size, dtype=np.uint8)  # one row of blocks, a 1-D tensor
    writer.add_tensor("blk.0.attn_norm.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match=r"norm\.gguf: tensor blk\.0\.attn_norm\.weight is Q8_0"
    ):
        list(read_tensors(path))


def test_q4_0_and_q8_0_blocks_read_as_their_values(tmp_path: Path) -> None:
    import gguf

    for kind in ("Q4_0", "Q8_0"):
        path = _tiny_gguf(tmp_path / f"{kind}.gguf", kind, 32, 64)
        (tensor,) = list(read_tensors(path))
        qtype = gguf.GGMLQuantizationType[kind]
        want = gguf.quants.dequantize(np.asarray(tensor.data), qtype).reshape(32, 64)
        got = quantized(tensor).dequantize().numpy()
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=0)


def test_int8_quantization_of_a_gguf_file_is_refused() -> None:
    with pytest.raises(ConfigError, match="--quantization"):
        LLM(str(gguf_path()), quantization="int8")


def test_a_gguf_file_is_not_served_batch_invariant() -> None:
    # Quantized without the flag: the refusal must come from the file, not from --quantization.
    with pytest.raises(ConfigError) as info:
        LLM(str(gguf_path()), dtype="bfloat16", batch_invariant=True)
    assert str(info.value).startswith(
        f"{gguf_path()}: a GGUF file (its blocks are the weights): not with --batch-invariant"
    )


# Fixed prompts (the default tokenizer's ids of "The capital of France is", "def fibonacci(n):",
# "Water boils at a temperature of", "Once upon a time, there was a").
BF16_PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1604, 3987, 46477, 24, 94, 727],
    [12615, 36411, 418, 253, 2779, 282],
    [6403, 1980, 253, 655, 28, 665, 436, 253],
]
# Measured on AVX512-BF16 (2026-11-26): all 16 greedy tokens of every prompt agree with the bf16
# model (the file de-quantized, then rounded to bf16), the largest logprob difference 0.118; the
# bounds leave room for other CPUs' kernels and their sums' order.
AGREED_TOKENS, LOGPROB_BOUND = 8, 0.3


def test_bf16_agrees_with_the_bf16_model_within_stated_bounds() -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    traces = []
    for quantization in (None, "gguf"):
        with LLM(
            None, dtype="bfloat16", quantization=quantization, num_kv_blocks=64, max_model_len=128
        ) as llm:
            traces.append(
                [
                    [
                        (t, float(next(iter(lp.values()))))
                        for t, lp in zip(s.token_ids, s.logprobs or [])
                    ]
                    for s in (o.outputs[0] for o in llm.generate(BF16_PROMPTS, params))
                ]
            )
    for bf16, gguf in zip(*traces):
        agreed = 0
        while agreed < len(bf16) and bf16[agreed][0] == gguf[agreed][0]:
            agreed += 1
        assert agreed >= AGREED_TOKENS, (bf16, gguf)
        worst = max(abs(a[1] - b[1]) for a, b in zip(bf16[:agreed], gguf[:agreed]))
        assert worst <= LOGPROB_BOUND


def test_gguf_quantization_of_a_model_folder_is_refused(default_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"--quantization gguf: serves a \.gguf file"):
        LLM(str(default_model_dir), quantization="gguf")


def test_an_engine_on_a_truncated_file_stops_at_start_up_naming_it(tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with gguf_path().open("rb") as f:
        cut.write_bytes(f.read(3 << 20))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        LLM(str(cut), dtype="float32", model_cache_dir=str(tmp_path / "cache"))
