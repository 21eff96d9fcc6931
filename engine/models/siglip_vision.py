"""The SigLIP vision transformer (Gemma 3's tower): patches through a convolution with a bias,
one learned position per patch (no class token), CLIP's pre-norm encoder layers, a final
LayerNorm; the pooling head is not used. Modules are named as in transformers' checkpoints."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.models.clip_vision import ClipEncoder


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size
        )
        num_positions = (cfg.image_size // cfg.patch_size) ** 2
        self.position_embedding = nn.Embedding(num_positions, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, patches, hidden]"""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = ClipEncoder(cfg)  # the same layers, under the same names
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """The last hidden state, [images, patches, hidden]."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
