"""Each rotary scheme's frequencies and cos/sin factor equal transformers' own."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.errors import ModelLoadError
from engine.models.layers.rotary import inverse_frequencies, rope_parameters

HEAD_DIM = 32
ORIGINAL = 256


def _config(rope: dict, cls=LlamaConfig, **extra):
    extra.setdefault("max_position_embeddings", 4 * ORIGINAL)
    return cls(
        hidden_size=128,
        num_attention_heads=4,
        rope_parameters={"rope_theta": 10000.0, **rope},
        **extra,
    )


CASES = {
    "default": ({"rope_type": "default"}, {}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        {},
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
        {"cls": Qwen3Config, "head_dim": HEAD_DIM},
    ),
    "yarn_mscale": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
        },
        {"cls": Qwen3Config, "head_dim": HEAD_DIM},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_static_schemes_equal_transformers(name: str) -> None:
    rope, extra = CASES[name]
    cfg = _config(rope, **extra)
    if name == "default":  # transformers computes it inside the rotary module
        want, want_scale = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)), 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    got, scale = inverse_frequencies(HEAD_DIM, rope_parameters(cfg), 4 * ORIGINAL)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_dynamic_ntk_equals_transformers_at_the_served_length() -> None:
    cfg = _config({"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=ORIGINAL)
    params = rope_parameters(cfg)
    for served in (ORIGINAL, 3 * ORIGINAL):
        want, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=served)
        got, scale = inverse_frequencies(HEAD_DIM, params, served)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert scale == 1.0


def test_longrope_takes_long_factors_past_the_original_context() -> None:
    short = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
    long = [3.0 + 0.2 * i for i in range(HEAD_DIM // 2)]
    cfg = _config(
        {
            "rope_type": "longrope",
            "short_factor": short,
            "long_factor": long,
            "original_max_position_embeddings": ORIGINAL,
        },
        cls=Phi3Config,
        original_max_position_embeddings=ORIGINAL,
        pad_token_id=0,
    )
    params = rope_parameters(cfg)
    want_short, want_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=ORIGINAL)
    want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=2 * ORIGINAL)
    for served, want in ((ORIGINAL, want_short), (2 * ORIGINAL, want_long)):
        got, scale = inverse_frequencies(HEAD_DIM, params, served)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(want_scale) and scale > 1.0
    assert not torch.equal(want_short, want_long)


def test_an_unknown_scheme_names_the_supported_ones() -> None:
    with pytest.raises(ModelLoadError, match=r"unsupported rope_type 'nope'.*yarn, longrope"):
        inverse_frequencies(HEAD_DIM, {"rope_type": "nope", "rope_theta": 1e4}, 16)
