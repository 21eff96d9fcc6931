from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import build_random_model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """Llama: GQA 4:1, untied embeddings, Llama-3 RoPE, sharded checkpoint, Llama-3.2 tokenizer."""
    return build_random_model(tmp_path_factory.mktemp("llama"), "llama", "llama", shard=True)


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory) -> Path:
    """Mistral: GQA 2:1, untied, Llama-2 tokenizer family (here the Llama-3.2 one)."""
    return build_random_model(tmp_path_factory.mktemp("mistral"), "mistral", "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2: q/k/v bias, tied embeddings, Qwen tokenizer."""
    return build_random_model(tmp_path_factory.mktemp("qwen2"), "qwen2", "qwen")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3: per-head q/k RMSNorm, head_dim != hidden / heads, Qwen tokenizer."""
    return build_random_model(tmp_path_factory.mktemp("qwen3"), "qwen3", "qwen")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once into the cache directory."""
    from config.engine_config import default_cache_dir
    from engine.default_model import default_model_dir as convert

    return convert(default_cache_dir())
