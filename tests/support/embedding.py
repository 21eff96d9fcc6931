"""The bundled embedding model and its oracle: a plain transformers forward in float32 with the
checkpoint's own pooling (mean over the attention mask, then L2 normalization, as its
modules.json and 1_Pooling/config.json say), one input at a time (no padding involved)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.loading.default_model import default_embedding_model_dir


def minilm_dir() -> Path:
    return default_embedding_model_dir()


@functools.lru_cache(maxsize=1)
def _hf_model():
    from transformers import AutoModel

    return AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=1)
def minilm_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir())


@torch.inference_mode()
def hf_embed(inputs: list[str] | list[list[int]]) -> torch.Tensor:
    """[len(inputs), 384]: mean-pooled, normalized sentence embeddings."""
    model = _hf_model()
    rows = []
    for item in inputs:
        ids = minilm_tokenizer()(item).input_ids if isinstance(item, str) else item
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        rows.append(torch.nn.functional.normalize(hidden.mean(0), dim=0))
    return torch.stack(rows)


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def mixed_texts(n: int) -> list[str]:
    """n inputs of lengths from a few tokens to ~200: padding and batching have work to do."""
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "paged",
        "attention",
        "serves",
        "many",
        "requests",
        "in",
        "one",
        "batch",
        "and",
        "embeddings",
        "describe",
        "what",
        "each",
        "sentence",
        "means",
    ]
    return [
        " ".join(words[(i * 7) % len(words) :] + words * (i % 9))[: 20 + 23 * i] for i in range(n)
    ]


def build_random_bert(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """A random-weight BertModel (biases and norms randomized too) with a WordPiece tokenizer
    of its own small vocabulary: no package needed, so it also runs on a bare GPU machine."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(200)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    settings: dict[str, object] = {
        "vocab_size": len(vocab),
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
        "hidden_act": "gelu_new",
        "layer_norm_eps": 1e-7,
        **overrides,
    }
    cfg = BertConfig(**settings)
    cfg.architectures = ["BertModel"]
    torch.manual_seed(seed)
    model = BertModel(cfg, add_pooling_layer=True).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


@torch.inference_mode()
def hf_cls_embed(folder: Path, prompts: list[list[int]], device: str = "cpu") -> torch.Tensor:
    """transformers' BertModel in float32, one prompt at a time: the normalized [CLS] row (the
    pooling an encoder gets without sentence-transformers files)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    rows = []
    for ids in prompts:
        hidden = model(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0]
        rows.append(torch.nn.functional.normalize(hidden[0].float(), dim=0).cpu())
    return torch.stack(rows)
