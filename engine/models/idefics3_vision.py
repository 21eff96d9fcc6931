"""Idefics3's vision side: a SigLIP-shaped transformer over one image's tiles (patches through
a convolution, learned positions looked up by each patch's fractional place in its tile, no
class token, a final layer norm), then the connector that folds each `scale_factor` x
`scale_factor` block of patches into one vector and projects it into the text model's width.
Modules are named as in transformers' checkpoints, so they load by name."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.models.siglip_vision import SiglipVisionTower


class Idefics3VisionEmbeddings(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size
        )
        self.per_side = cfg.image_size // cfg.patch_size
        self.position_embedding = nn.Embedding(self.per_side**2, cfg.hidden_size)

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """The position of each patch of a `rows` x `cols` grid: its fractional coordinates
        bucketed into the trained `per_side` x `per_side` grid (the identity when the grid is
        the trained one). Computed in float32 as the reference computes it, so that bucket
        edges fall the same way."""
        edges = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=device)

        def buckets(n: int) -> torch.Tensor:
            coords = torch.arange(n, device=device, dtype=torch.float32) * (1.0 / n)
            return torch.bucketize(coords.clamp(max=1.0 - 1e-6), edges, right=True)

        return (buckets(rows)[:, None] * self.per_side + buckets(cols)[None, :]).flatten()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, H, W] -> [tiles, patches, hidden]"""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        rows, cols = patches.shape[-2:]
        x = patches.flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(rows, cols, x.device))


class Idefics3VisionTransformer(SiglipVisionTower):
    """SigLIP's tower with positions bucketed to each tile's size. Every tile is whole (an
    image's tiles share one size), so no patch is masked."""

    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__(cfg)
        self.embeddings = Idefics3VisionEmbeddings(cfg)  # type: ignore[assignment]


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side * side, D] -> [tiles, (side / scale)^2, D * scale^2]: each `scale` x
    `scale` block of patches becomes one row, its patches side by side in row-major order."""
    tiles, seq, dim = x.shape
    side = int(seq**0.5)
    blocks = side // scale
    x = x.view(tiles, blocks, scale, blocks, scale, dim).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(tiles, blocks * blocks, scale * scale * dim)


class Idefics3ModalityProjection(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        width = cfg.vision_config.hidden_size * cfg.scale_factor**2
        self.proj = nn.Linear(width, cfg.text_config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.scale_factor = int(cfg.scale_factor)
        self.modality_projection = Idefics3ModalityProjection(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(x, self.scale_factor))
