"""The vision towers of Qwen2-VL and Qwen2.5-VL: an image's patches in, one embedding per
merged 2x2 patch block out, in the text model's width.

Both towers are a ViT over 14-pixel patches (two frames deep, for videos; an image is its own
frame twice) with a 2D rotary embedding over each patch's (row, column), and a merger that
concatenates each 2x2 block of neighbouring patches into one token. The image processor already
lays the patches out block by block (the four patches of a block are consecutive), so merging is
a reshape. They differ in the block:
- Qwen2-VL: LayerNorm, a fc1/fc2 MLP (QuickGELU), full attention over each image.
- Qwen2.5-VL: RMSNorm, a gated MLP (SiLU), and attention inside windows of
  `window_size` pixels except in `fullatt_block_indexes`. The tokens are reordered window by
  window (whole merge blocks at a time) before the first block, so that each window is one
  contiguous run, and the merged tokens are put back into row order at the end.

Images attend only to themselves: attention runs per segment of `cu_seqlens` (an image, or a
window), with SDPA on each.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.errors import ModelLoadError
from engine.models.layers.linear import CheckpointTensor, copy_checked
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import apply_rotary
from engine.models.weights import load_checkpoint


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# The blocks' activations: Qwen2-VL's QuickGELU, Qwen2.5-VL's SiLU.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported vision activation {name!r}; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


@dataclass(frozen=True)
class VisionShape:
    """What both towers read from their Hugging Face vision config."""

    width: int  # the tower's hidden size
    out_width: int  # the text model's hidden size: what the merger gives
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge_size: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_values(self) -> int:
        """Pixel values per patch: one row of the processor's `pixel_values`."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _rope_theta(cfg: PretrainedConfig) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


class PatchEmbedding(nn.Module):
    """The checkpoint's Conv3d, whose stride equals its kernel: on one flattened patch it is a
    matrix product, so the weight is kept flattened and applied as a linear layer."""

    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape.width, shape.patch_values))

    def load(self, param: str, source: CheckpointTensor, part: str | None) -> list[str | None]:
        tensor = source[:]
        copy_checked(self.weight.data, tensor.reshape(tensor.shape[0], -1), f"patch {param}")
        return [None]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.weight.dtype), self.weight)


class VisionRotary(nn.Module):
    """2D rotary: the first half of each head's rotated pairs turn with the patch's row, the
    second half with its column (rotate-half layout, so the table is repeated twice)."""

    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.axis_dim, self.theta = shape.head_dim // 2, shape.rope_theta  # per axis

    def forward(self, rows_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, [N, 1, head_dim], for patches at `rows_cols` [N, 2]."""
        # Computed per call (a few numbers), not at build time: the model is built on the meta
        # device, where a table made then would hold no values.
        steps = torch.arange(0, self.axis_dim, 2, dtype=torch.float32, device=rows_cols.device)
        inv_freq = 1.0 / (self.theta ** (steps / self.axis_dim))
        angles = (rows_cols[..., None].float() * inv_freq).flatten(1)  # [N, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.num_heads, self.head_dim = shape.num_heads, shape.head_dim
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.proj = nn.Linear(shape.width, shape.width)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rope
        # The rotation in float32 whatever the tower's dtype, as the reference does it.
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(cu_seqlens):
            segment = slice(start, end)
            # [heads, n, dim] per segment: SDPA without a mask, as each segment sees only itself.
            out[segment] = F.scaled_dot_product_attention(
                q[segment].transpose(0, 1), k[segment].transpose(0, 1), v[segment].transpose(0, 1)
            ).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class TwoLayerMLP(nn.Module):
    """Qwen2-VL's block MLP: fc2(act(fc1(x)))."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL's block MLP: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden)
        self.up_proj = nn.Linear(width, hidden)
        self.down_proj = nn.Linear(hidden, width)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(
        self, norm: Callable[[], nn.Module], attn: VisionAttention, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(), norm()
        self.attn, self.mlp = attn, mlp

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each block of merge_size^2 consecutive patches, normed, concatenated and projected to
    the text model's width (names as the checkpoint's: `ln_q`, `mlp.0`, `mlp.2`)."""

    def __init__(self, shape: VisionShape, norm: nn.Module) -> None:
        super().__init__()
        self.block_width = shape.width * shape.merge_size**2
        self.ln_q = norm
        self.mlp = nn.Sequential(
            nn.Linear(self.block_width, self.block_width),
            nn.GELU(),
            nn.Linear(self.block_width, shape.out_width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.block_width))


def patch_rows_cols(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """Each patch's (row, column), [N, 2], in the processor's order: frame by frame, merge
    block by merge block (row-major), row-major inside a block."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge_size, merge_size, 1, 1)
        cols = torch.arange(w).view(1, 1, w // merge_size, merge_size)
        blocks = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.expand(blocks).permute(0, 2, 1, 3).flatten()
        cols = cols.expand(blocks).permute(0, 2, 1, 3).flatten()
        out.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_seqlens(grid_thw: torch.Tensor) -> list[int]:
    """Cumulative patch counts, one segment per frame: the full-attention segments."""
    bounds = [0]
    for t, h, w in grid_thw.tolist():
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


@dataclass(frozen=True)
class WindowLayout:
    """The order of merge blocks window by window, and the windows' cumulative patch counts."""

    block_order: torch.Tensor  # [num merge blocks]: the row-order block each position takes
    cu_seqlens: list[int]


def window_layout(grid_thw: torch.Tensor, merge_size: int, window_blocks: int) -> WindowLayout:
    """Windows of `window_blocks` x `window_blocks` merge blocks, tiled from each frame's top
    left corner (those on the right and bottom edges cut short), row-major, frame by frame."""
    order: list[torch.Tensor] = []
    bounds = [0]
    first = 0
    unit = merge_size**2
    for t, h, w in grid_thw.tolist():
        bh, bw = h // merge_size, w // merge_size
        index = torch.arange(t * bh * bw).view(t, bh, bw) + first
        for frame in range(t):
            for top in range(0, bh, window_blocks):
                for left in range(0, bw, window_blocks):
                    window = index[frame, top : top + window_blocks, left : left + window_blocks]
                    order.append(window.flatten())
                    bounds.append(bounds[-1] + window.numel() * unit)
        first += t * bh * bw
    return WindowLayout(torch.cat(order), bounds)


def locate_in_tower(name: str) -> tuple[str, str | None]:
    """Our parameter for a checkpoint name under `visual.`: the same, but for the patch
    embedding's Conv3d (`patch_embed.proj.weight`), which is our flattened `patch_embed.weight`."""
    return name.replace("patch_embed.proj.", "patch_embed."), None


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL's tower; `Qwen25VisionTower` overrides what differs."""

    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.shape = self.read_shape(cfg)
        self.patch_embed = PatchEmbedding(self.shape)
        self.rotary = VisionRotary(self.shape)
        self.blocks = nn.ModuleList(self.build_block(cfg) for _ in range(self.shape.depth))
        self.merger = PatchMerger(self.shape, self.norm())

    @staticmethod
    def read_shape(cfg: PretrainedConfig) -> VisionShape:
        return VisionShape(
            width=cfg.embed_dim,
            out_width=cfg.hidden_size,
            depth=cfg.depth,
            num_heads=cfg.num_heads,
            patch_size=cfg.patch_size,
            temporal_patch_size=cfg.temporal_patch_size,
            in_channels=cfg.in_channels,
            merge_size=cfg.spatial_merge_size,
            rope_theta=_rope_theta(cfg),
        )

    def norm(self) -> nn.Module:
        return nn.LayerNorm(self.shape.width, eps=1e-6)

    def build_block(self, cfg: PretrainedConfig) -> VisionBlock:
        mlp = TwoLayerMLP(self.shape.width, int(self.shape.width * cfg.mlp_ratio), cfg.hidden_act)
        return VisionBlock(self.norm, VisionAttention(self.shape), mlp)

    def num_tokens(self, grid_thw: torch.Tensor) -> int:
        """Image tokens the tower gives for these grids: one per merge block."""
        return int(grid_thw.prod(-1).sum()) // self.shape.merge_size**2

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[image tokens, text hidden] for the processor's `pixel_values` [patches, values] and
        `image_grid_thw` [images, 3] (each image's tokens in turn)."""
        x = self.patch_embed(pixel_values)
        rope = self.rotary(patch_rows_cols(grid_thw, self.shape.merge_size).to(x.device))
        cu_seqlens = frame_seqlens(grid_thw)
        for block in self.blocks:
            x = block(x, rope, cu_seqlens)
        return self.merger(x)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """The tower's tensors by the names under `visual.` (with that prefix removed)."""
        load_checkpoint(self, weights, locate_in_tower)


class Qwen25VisionTower(Qwen2VisionTower):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__(cfg)
        self.full_attention_blocks = frozenset(cfg.fullatt_block_indexes)
        self.window_blocks = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size

    @staticmethod
    def read_shape(cfg: PretrainedConfig) -> VisionShape:
        return VisionShape(
            width=cfg.hidden_size,
            out_width=cfg.out_hidden_size,
            depth=cfg.depth,
            num_heads=cfg.num_heads,
            patch_size=cfg.patch_size,
            temporal_patch_size=cfg.temporal_patch_size,
            in_channels=cfg.in_channels,
            merge_size=cfg.spatial_merge_size,
            rope_theta=_rope_theta(cfg),
        )

    def norm(self) -> nn.Module:
        return RMSNorm(self.shape.width, 1e-6)

    def build_block(self, cfg: PretrainedConfig) -> VisionBlock:
        mlp = VisionGatedMLP(self.shape.width, cfg.intermediate_size, cfg.hidden_act)
        return VisionBlock(self.norm, VisionAttention(self.shape), mlp)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        unit = self.shape.merge_size**2
        windows = window_layout(grid_thw, self.shape.merge_size, self.window_blocks)
        order = windows.block_order.to(pixel_values.device)

        def by_window(t: torch.Tensor) -> torch.Tensor:
            """Rows regrouped window by window, a merge block's rows staying together."""
            return t.reshape(-1, unit, *t.shape[1:])[order].flatten(0, 1)

        x = by_window(self.patch_embed(pixel_values))
        rows_cols = patch_rows_cols(grid_thw, self.shape.merge_size).to(x.device)
        rope = self.rotary(by_window(rows_cols))
        full = frame_seqlens(grid_thw)
        for index, block in enumerate(self.blocks):
            segments = full if index in self.full_attention_blocks else windows.cu_seqlens
            x = block(x, rope, segments)
        return self.merger(x)[torch.argsort(order)]
