"""Writes a random llama GGUF file shaped as bench/models/random_llama.py's 124.7M model (hidden 768,
12 layers, 12 query / 4 KV heads of 64, MLP 2048, vocabulary 32,000, untied head) in one of
GGUF's block-type mixes, for timing them against each other (bench/models/quantized.py --gguf). The
blocks are random bytes with finite float16 scales (the gguf package cannot write K-quants):
a decode step's time does not depend on the weights' values. The tokenizer is the default
model's, cut to the first 32,000 tokens and the merges that make them.

    python bench/models/random_gguf.py MIX [FILE]   # q4_k_m, q5_k_m, q4_k, q6_k, q4_1 or q8_0

FILE defaults to ~/.cache/pagedserve/random-llama-124m-MIX.gguf.

q4_k_m (q5_k_m) follows llama.cpp's rule for those file types: Q4_K (Q5_K) everywhere but the
head, which is Q6_K, and attn_v and ffn_down of the first and last eighth of the layers and of
every third layer between, which are Q6_K too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.loading.default_model import gguf_path
from engine.loading.gguf_blocks import BLOCK_TYPES

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 768, 12, 12, 4, 2048, 32000
# Each type's float16 fields: (byte offset, magnitude) giving weights of about 0.02-0.05.
HEADERS: dict[str, list[tuple[int, float]]] = {
    "Q8_0": [(0, 3e-4)],
    "Q4_1": [(0, 5e-3), (2, -0.04)],
    "Q4_K": [(0, 1e-4), (2, 7e-4)],
    "Q5_K": [(0, 5e-5), (2, 7e-4)],
    "Q6_K": [(208, 2e-5)],
}
MIXES = {
    "q4_k_m": "Q4_K",
    "q5_k_m": "Q5_K",
    "q4_k": "Q4_K",
    "q6_k": "Q6_K",
    "q4_1": "Q4_1",
    "q8_0": "Q8_0",
}


def tensor_type(mix: str, name: str, layer: int) -> str:
    base = MIXES[mix]
    if mix not in ("q4_k_m", "q5_k_m"):
        return base
    if name == "output":
        return "Q6_K"
    eighth = LAYERS // 8
    more_bits = layer < eighth or layer >= LAYERS - eighth or (layer - eighth) % 3 == 2
    return "Q6_K" if name in ("attn_v", "ffn_down") and more_bits else base


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block = BLOCK_TYPES[kind]
    count = cols // block.values
    raw = rng.integers(0, 256, (rows, count, block.nbytes), dtype=np.uint8)
    for offset, size in HEADERS[kind]:
        value = (size * rng.uniform(0.5, 1.5, (rows, count))).astype(np.float16)
        raw[..., offset : offset + 2] = value.view(np.uint8).reshape(rows, count, 2)
    return raw.reshape(rows, -1)


def write(mix: str, path: Path) -> None:
    import gguf

    source = gguf.GGUFReader(gguf_path())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    # The default tokenizer's token k + 252 is its merge k joined: the first VOCAB tokens and
    # the merges that make them are a whole byte-level BPE.
    cut = {
        "tokenizer.ggml.tokens": VOCAB,
        "tokenizer.ggml.token_type": VOCAB,
        "tokenizer.ggml.merges": VOCAB - 252,
    }
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents(slice(0, cut[key])) if key in cut else field.contents()
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, value, field.types[0], sub)
    rng = np.random.default_rng(0)

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        raw = random_blocks(kind, rows, cols, rng)
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])

    ones = np.ones(HIDDEN, dtype=np.float32)
    add("token_embd.weight", MIXES[mix], VOCAB, HIDDEN)
    writer.add_tensor("output_norm.weight", ones)
    add("output.weight", tensor_type(mix, "output", -1), VOCAB, HIDDEN)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (kv, HIDDEN),
        "attn_v": (kv, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
        for name, (rows, cols) in shapes.items():
            add(f"blk.{layer}.{name}.weight", tensor_type(mix, name, layer), rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in MIXES:
        sys.exit(f"usage: python bench/models/random_gguf.py {{{','.join(MIXES)}}} [FILE]")
    mix = sys.argv[1]
    default = Path.home() / ".cache" / "pagedserve" / f"random-llama-124m-{mix}.gguf"
    path = Path(sys.argv[2]) if len(sys.argv) > 2 else default
    path.parent.mkdir(parents=True, exist_ok=True)
    write(mix, path)
    print(f"{mix} -> {path} ({path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
