"""Rotary position embeddings: the frequency schemes of the Hugging Face configs (default,
linear, dynamic NTK, Llama 3, YaRN, LongRoPE), precomputed as cos/sin tables per position.

Two schemes depend on the sequence length in transformers, which recomputes them per forward
for the batch's longest sequence. A batched server cannot: it fixes them once for the longest
context it serves (`max_positions`). Dynamic NTK then equals the default scheme when the served
context fits the original one (as transformers does for such sequences), and LongRoPE picks its
long factors only when the served context exceeds the original one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PretrainedConfig

from engine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings whichever transformers version wrote them; `layer_type` picks
    one entry where they are given per layer type (Gemma 3's local and global layers)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and layer_type is None:
        params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("max_position_embeddings", getattr(hf_config, "max_position_embeddings", 0))
    return params


def _powers(head_dim: int, base: float) -> torch.Tensor:
    """base^(2i/d) for each rotated pair i."""
    return base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


def _yarn_scale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    base, factor = float(params["rope_theta"]), params.get("factor")
    original = params.get("original_max_position_embeddings") or params["max_position_embeddings"]
    if factor is None:
        factor = params["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (
            _yarn_scale(factor, mscale) / _yarn_scale(factor, mscale_all)
            if mscale and mscale_all
            else _yarn_scale(factor)
        )

    def dim_of(rotations: float) -> float:
        """The rotary dimension that turns `rotations` times over the original context."""
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = _powers(head_dim, base)
    # Fast-turning pairs keep their frequency (extrapolate), slow ones are divided by the factor.
    keep = 1 - ramp
    return (1 / (factor * powers)) * ramp + (1 / powers) * keep, float(attention)


def _longrope(head_dim: int, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    original = params.get("original_max_position_embeddings") or params["max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = max_positions > original
    ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * _powers(head_dim, base)), float(attention)


def inverse_frequencies(
    head_dim: int, params: dict, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequency of each rotated pair, the factor cos and sin are multiplied by)."""
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    inv_freq = 1.0 / _powers(head_dim, base)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "dynamic":
        original = params["max_position_embeddings"]
        longest = max(max_positions or original, original)
        if longest == original:
            return inv_freq, 1.0
        factor = params["factor"]
        scaled = base * ((factor * longest / original) - (factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        return 1.0 / _powers(head_dim, scaled), 1.0
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(head_dim, params)
    if kind == "longrope":
        return _longrope(head_dim, params, max_positions or params["max_position_embeddings"])
    raise ModelLoadError(
        f"unsupported rope_type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding:
    """Precomputed cos/sin per position, in the model's dtype."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        params: dict,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        inv_freq, scaling = inverse_frequencies(head_dim, params, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [T, 1, dim]: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def lookup_multimodal(
        self, positions: torch.Tensor, section: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multimodal rotary (Qwen2-VL's M-RoPE): `positions` [3, T] (time, height, width);
        the rotated pairs are split in `section` sizes, the i-th part turning by axis i's
        position. A text token has equal positions on all three, which is `lookup`'s."""
        sizes = list(section) * 2  # the same split in both halves of the rotate-half layout

        def pick(table: torch.Tensor) -> torch.Tensor:
            parts = table[positions].split(sizes, dim=-1)  # each [3, T, size]
            return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1).unsqueeze(1)

        return pick(self.cos), pick(self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, dim], rotate-half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
