"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and Q5_0/Q5_1 served from their blocks: each type's blocks
de-quantize bit for bit as the `gguf` package's own de-quantization (an independent reader of
the format); fused layers whose parts have different types join exactly; a tiny random llama
written as a Q4_K_M-like file (Q4_K with Q6_K for attn_v, ffn_down and the output head, mixed
types inside fused q/k/v and gate/up), served in float32, gives transformers' greedy tokens on
the de-quantized weights, with an untied Q6_K head or a tied Q4_K one. Then files that cannot be
read: a K-quant tensor cut short, block types still unsupported."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.loading.default_model import gguf_path
from engine.loading.gguf_blocks import BLOCK_TYPES, decode
from engine.loading.gguf_checkpoint import read_tensors
from engine.loading.gguf_metadata import metadata_dir
from engine.loading.quantized_linears import join_rows
from engine.models.base import DecoderModel
from engine.models.layers.linear import PackableLinear
from kernels.cpu.quant_layout import QuantizedWeight
from tests.support.models import greedy_of

# Byte offsets of each type's float16 fields and the magnitude they get in the tests (random
# bytes elsewhere): weights of about 0.02-0.05, finite, as a real file's are.
HEADERS: dict[str, list[tuple[int, float]]] = {
    "Q8_0": [(0, 3e-4)],
    "Q4_0": [(0, 5e-3)],
    "Q4_1": [(0, 5e-3), (2, -0.04)],
    "Q5_0": [(0, 3e-3)],
    "Q5_1": [(0, 3e-3), (2, -0.05)],
    "Q4_K": [(0, 1e-4), (2, 7e-4)],
    "Q5_K": [(0, 5e-5), (2, 7e-4)],
    "Q6_K": [(208, 2e-5)],
}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of `kind` blocks: random bytes, each float16 field a finite value."""
    block = BLOCK_TYPES[kind]
    count = cols // block.values
    raw = rng.integers(0, 256, (rows, count, block.nbytes), dtype=np.uint8)
    for offset, size in HEADERS[kind]:
        value = (size * rng.uniform(0.5, 1.5, (rows, count))).astype(np.float16)
        raw[..., offset : offset + 2] = value.view(np.uint8).reshape(rows, count, 2)
    return raw.reshape(rows, -1)


def gguf_values(kind: str, raw: np.ndarray, cols: int) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(-1, cols)


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_blocks_dequantize_bit_for_bit_as_gguf_does(kind: str) -> None:
    import gguf

    block = BLOCK_TYPES[kind]
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]] == (block.values, block.nbytes)
    rng = np.random.default_rng(len(kind) + block.nbytes)
    raw = random_blocks(kind, 24, 512, rng)
    weight = decode(kind, raw)
    want = gguf_values(kind, raw, 512)
    assert np.isfinite(want).all()
    assert np.array_equal(weight.dequantize().numpy(), want)
    expected = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q6_K": (8, 16)}
    assert (weight.bits, weight.group) == expected.get(kind, (8, 32))
    assert (weight.mins is not None) == (kind in ("Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K"))


@pytest.mark.parametrize(
    "kinds",
    [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q5_K"), ("Q6_K", "Q8_0", "Q4_0"), ("Q5_0", "Q4_1")],
)
def test_fused_parts_of_different_types_join_exactly(kinds: tuple[str, ...]) -> None:
    rng = np.random.default_rng(5)
    raws = [random_blocks(kind, 16 * (i + 1), 256, rng) for i, kind in enumerate(kinds)]
    parts = [decode(kind, raw) for kind, raw in zip(kinds, raws)]
    joined = join_rows(parts, "qkv")
    want = np.concatenate([gguf_values(k, raw, 256) for k, raw in zip(kinds, raws)])
    assert np.array_equal(joined.dequantize().numpy(), want)
    assert joined.group == min(p.group for p in parts)
    assert joined.bits == (4 if all(p.bits == 4 for p in parts) else 8)
    assert (joined.mins is None) == all(p.mins is None for p in parts)


def test_groups_of_any_even_sizes_meet_on_their_largest_common_size() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (2, 36), generator=gen).to(torch.int8)
    parts = [
        QuantizedWeight(q, torch.rand(2, 3, generator=gen), torch.rand(2, 3, generator=gen)),
        QuantizedWeight(q, torch.rand(2, 2, generator=gen)),
    ]
    joined = join_rows(parts, "qkv")
    assert joined.group == 6
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_parts_with_different_input_features_are_refused() -> None:
    parts = [
        QuantizedWeight(torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 2)),
        QuantizedWeight(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1)),
    ]
    with pytest.raises(ModelLoadError, match=r"qkv: its parts have \[32, 64\] input features"):
        join_rows(parts, "qkv")


# ---------------------------------------------------------------- a tiny K-quant llama

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
VOCAB = 1024  # the default model's tokenizer, cut to its first tokens (a small embedding)
# A Q4_K_M-like mix: Q4_K, with Q6_K for the head, layer 0's attn_v and ffn_down, Q5_K inside
# layer 0's gate/up, and layer 1 with the 32-value types (fused with the K-quants there).
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
     "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "Q5_K",
     "ffn_gate": "Q6_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K"},
]  # fmt: skip
HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PROMPTS = [[1, 504, 345, 282, 649, 314], [969, 314, 253, 1023, 150, 282, 284]]
MAX_TOKENS = 6


def _converter_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter stores each q (k) head's two rotary halves interleaved row by row:
    file row 2i + j of a head is Hugging Face's row j * half + i."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, 2, half).transpose(0, 2, 1).reshape(-1)


@dataclass(frozen=True)
class KQuantModel:
    path: Path
    weights: dict[str, torch.Tensor]  # Hugging Face names: what transformers gets


Tokenizer = dict[str, tuple[Any, tuple[Any, Any]]]  # GGUF key -> (value, (type, item type))


def small_tokenizer() -> Tokenizer:
    """The default model's tokenizer fields, cut to its first VOCAB tokens and the merges that
    make them (its token k + 252 is its merge k joined, checked here): a whole byte-level BPE."""
    import gguf

    source = gguf.GGUFReader(gguf_path())
    cut = {
        "tokenizer.ggml.tokens": VOCAB,
        "tokenizer.ggml.token_type": VOCAB,
        "tokenizer.ggml.merges": VOCAB - 252,
    }
    fields: Tokenizer = {}
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents(slice(0, cut[key])) if key in cut else field.contents()
            fields[key] = (
                value,
                (field.types[0], field.types[1] if len(field.types) > 1 else None),
            )
    last_merge = fields["tokenizer.ggml.merges"][0][-1]
    assert last_merge.replace(" ", "") == fields["tokenizer.ggml.tokens"][0][-1]
    return fields


def write_model(path: Path, tied: bool, tokenizer: Tokenizer) -> KQuantModel:
    """A random llama GGUF file: its metadata and tokenizer, then its tensors' blocks; and the
    weights they de-quantize to."""
    import gguf

    vocab = VOCAB
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    for key, (value, value_types) in tokenizer.items():
        writer.add_key_value(key, value, *value_types)
    rng = np.random.default_rng(11 if tied else 12)
    weights: dict[str, torch.Tensor] = {}

    def add(name: str, hf: str, kind: str, rows: int, cols: int, heads: int = 0) -> None:
        raw = random_blocks(kind, rows, cols, rng)
        weights[hf] = torch.from_numpy(gguf_values(kind, raw, cols).copy())
        stored = raw[_converter_order(rows, heads)] if heads else raw
        writer.add_tensor(name, stored, raw_dtype=gguf.GGMLQuantizationType[kind])

    def norm(name: str, hf: str) -> None:
        value = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        weights[hf] = torch.from_numpy(value)
        writer.add_tensor(name, value)

    add("token_embd.weight", "model.embed_tokens.weight", "Q4_K", vocab, HIDDEN)
    norm("output_norm.weight", "model.norm.weight")
    if not tied:
        add("output.weight", "lm_head.weight", "Q6_K", vocab, HIDDEN)
    head_dim = HIDDEN // HEADS
    shapes: dict[str, tuple[int, int, int]] = {
        "attn_q": (HIDDEN, HIDDEN, HEADS),
        "attn_k": (KV_HEADS * head_dim, HIDDEN, KV_HEADS),
        "attn_v": (KV_HEADS * head_dim, HIDDEN, 0),
        "attn_output": (HIDDEN, HIDDEN, 0),
        "ffn_gate": (FFN, HIDDEN, 0),
        "ffn_up": (FFN, HIDDEN, 0),
        "ffn_down": (HIDDEN, FFN, 0),
    }
    for layer, types in enumerate(LAYER_TYPES):
        prefix = f"model.layers.{layer}"
        norm(f"blk.{layer}.attn_norm.weight", f"{prefix}.input_layernorm.weight")
        norm(f"blk.{layer}.ffn_norm.weight", f"{prefix}.post_attention_layernorm.weight")
        for short, kind in types.items():
            rows, cols, heads = shapes[short]
            add(f"blk.{layer}.{short}.weight", f"{prefix}.{HF_NAMES[short]}.weight", kind, rows,
                cols, heads)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return KQuantModel(path, weights)


def transformers_greedy(model: KQuantModel, cache: Path) -> list[list[int]]:
    """transformers' tokens on the de-quantized weights, under the config it reads from the
    file (the one the engine serves)."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(metadata_dir(model.path, cache))
    hf = LlamaForCausalLM(config).float()
    missing, unexpected = hf.load_state_dict(model.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert (not missing) or config.tie_word_embeddings
    return greedy_of(hf, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return small_tokenizer()


@pytest.fixture(scope="module", params=["untied", "tied"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer
) -> Iterator[tuple[KQuantModel, LLM, Path]]:
    folder = tmp_path_factory.mktemp(f"kquants-{request.param}")
    model = write_model(folder / "tiny-q4_k_m.gguf", request.param == "tied", tokenizer)
    cache = folder / "cache"
    with LLM(
        str(model.path),
        dtype="float32",
        num_kv_blocks=32,
        max_model_len=64,
        model_cache_dir=str(cache),
    ) as llm:
        yield model, llm, cache


def test_a_k_quant_mix_is_served_from_its_blocks(served: tuple[KQuantModel, LLM, Path]) -> None:
    model, llm, _ = served
    net = llm.engine.executor.runner.model
    assert isinstance(net, DecoderModel)
    linears = {n: m for n, m in net.named_modules() if isinstance(m, PackableLinear)}
    tied = "lm_head.weight" not in model.weights
    assert len(linears) == LAYERS * 4 + (0 if tied else 1)
    assert all(m.weight is None and m.quantized is not None for m in linears.values())

    def form(module: PackableLinear) -> tuple[int, int, bool]:
        packed = module.quantized
        assert packed is not None
        return packed.bits, packed.k // packed.scales.shape[1], packed.mins is not None

    # Layer 0: q/k Q4_K with v Q6_K -> 8-bit, groups of 16, mins; gate Q4_K, up Q5_K -> 8-bit,
    # groups of 32, mins; o Q4_K as stored; down Q6_K as stored.
    assert form(linears["layers.0.self_attn.qkv_proj"]) == (8, 16, True)
    assert form(linears["layers.0.mlp.gate_up_proj"]) == (8, 32, True)
    assert form(linears["layers.0.self_attn.o_proj"]) == (4, 32, True)
    assert form(linears["layers.0.mlp.down_proj"]) == (8, 16, False)
    assert form(linears["layers.1.self_attn.o_proj"]) == (8, 32, True)  # Q5_K
    if tied:
        assert net.lm_head_quantized is not None
        assert (net.lm_head_quantized.bits, net.lm_head_quantized.mins is not None) == (4, True)
    else:
        assert net.lm_head_quantized is None and form(linears["lm_head"]) == (8, 16, False)


def test_float32_greedy_equals_transformers_on_the_dequantized_blocks(
    served: tuple[KQuantModel, LLM, Path],
) -> None:
    model, llm, cache = served
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == transformers_greedy(model, cache)


# ---------------------------------------------------------------- files that cannot be read


def _one_tensor_file(path: Path, kind: str, rows: int = 32, cols: int = 256) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    raw = random_blocks(kind, rows, cols, np.random.default_rng(0)) if kind in HEADERS else None
    if raw is None:  # a type these tests do not fill: random bytes of its size
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), np.uint8)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(cols, np.float32))
    writer.add_tensor("blk.0.attn_v.weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_k_quant_tensor_cut_short_is_refused_naming_file_and_tensor(
    tmp_path: Path, kind: str
) -> None:
    whole = _one_tensor_file(tmp_path / "whole.gguf", kind)
    assert [t.type for t in read_tensors(whole)] == ["F32", kind]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-100])
    needed = 32 * BLOCK_TYPES[kind].nbytes
    with pytest.raises(
        ModelLoadError,
        match=rf"cut\.gguf: tensor blk\.0\.attn_v\.weight \({kind}\) needs {needed} bytes, "
        rf"the file holds {needed - 100}",
    ):
        list(read_tensors(cut))


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "IQ4_XS", "BF16"])
def test_block_types_still_unsupported_are_refused_naming_file_tensor_and_type(
    tmp_path: Path, kind: str
) -> None:
    path = _one_tensor_file(tmp_path / f"{kind}.gguf", kind)
    with pytest.raises(
        ModelLoadError, match=rf"{kind}\.gguf: tensor blk\.0\.attn_v\.weight is {kind}, which"
    ):
        list(read_tensors(path))
