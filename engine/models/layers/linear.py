"""Linear layers and embeddings split across tensor-parallel ranks, each loading its own slice
of a checkpoint tensor.

Column-parallel layers split output features (no communication); row-parallel layers split
input features and all-reduce the partial sums; the vocabulary is split into equal padded
blocks. A column-parallel layer may fuse several checkpoint tensors (q/k/v, gate/up): each is a
`Part` that says which of its rows this rank keeps and where they go. With one rank every
slice is the whole tensor and every collective is the identity.

Every layer that loads more than a whole tensor has `load(param, source, part)`, and a layer
fused from several checkpoint tensors also `parts(param)`; `engine.models.weights` finds them
by parameter name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.shard import Shard, all_reduce
from engine.errors import ModelLoadError
from engine.models.layers.lora import LoRALayer
from kernels.cpu import weight_only
from kernels.cpu.packed_linear import linear
from kernels.cpu.quant_layout import PackedWeight
from kernels.gpu_quant.weights import GpuWeight, gpu_linear


class CheckpointTensor(Protocol):
    """A tensor, or safetensors' lazy slice of one: indexing reads only the indexed part."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ModelLoadError(f"{what}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class PackableLinear(nn.Module):
    """A linear layer that runs on its prepacked CPU weight once the CPU path made one
    (engine/worker/cpu/), or on its quantized weight (--quantization, a GGUF file): on the CPU
    `quantized`, on a GPU `gpu_quantized` (engine/worker/gpu_quantize.py)."""

    packed: torch.Tensor | None = None
    packed_own: bool = False  # `packed` is in kernels/cpu/bf16_linear's layout (else oneDNN's)
    # The weight quantized (`weight` is then None) and the bias in float32, as the kernel reads it.
    quantized: PackedWeight | None = None
    quantized_bias: torch.Tensor | None = None
    # The weight in a GPU quantized form (FP8, or packed for the Triton kernel); `weight` is None.
    gpu_quantized: GpuWeight | None = None
    # `quantized` multiplied with int8 activations (--quantize-activations int8).
    int8_activations: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.lora: LoRALayer | None = None  # adapters' updates, given by engine/lora when enabled
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, with_bias=True)
        return y if self.lora is None else self.lora.add_(x, y)

    def matmul(self, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
        """x @ weight.T (+ bias) through whichever copy of the weight this layer keeps."""
        if self.gpu_quantized is not None:
            return gpu_linear(x, self.gpu_quantized, self.bias if with_bias else None)
        if self.quantized is not None:
            bias = self.quantized_bias if with_bias else None
            return weight_only.linear(x, self.quantized, bias, self.int8_activations)
        return linear(
            x, self.weight, self.packed, self.bias if with_bias else None, self.packed_own
        )


class ReplicatedLinear(PackableLinear):
    """The whole layer on every rank (a MoE router, a model's head without tensor parallelism)."""


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor fused into a column-parallel layer: this rank keeps `count` of its
    rows from `first`. `total` is the whole tensor's rows over all ranks (what an adapter's B for
    it must have, whichever rank checks it). `offset` is where that tensor starts inside a
    checkpoint tensor that is itself fused (Phi-3's qkv_proj)."""

    name: str
    first: int
    count: int
    total: int
    offset: int = 0


class ColumnParallelLinear(PackableLinear):
    def __init__(self, in_features: int, parts: Sequence[Part], bias: bool) -> None:
        super().__init__(in_features, sum(p.count for p in parts), bias)
        self.part_list = tuple(parts)
        starts = accumulate((p.count for p in parts), initial=0)  # each part's first row here
        self.starts = dict(zip((p.name for p in parts), starts))

    def parts(self, param: str) -> list[str | None]:
        return [p.name for p in self.part_list]

    def load(self, param: str, source: CheckpointTensor, part: str | None) -> list[str | None]:
        """`part` None: a checkpoint tensor that already fuses every part, in order."""
        target = getattr(self, param)
        loaded: list[str | None] = []
        for p in self.part_list:
            if part is not None and p.name != part:
                continue
            first = p.first + (p.offset if part is None else 0)
            rows = source[first : first + p.count]
            start = self.starts[p.name]
            copy_checked(target.data[start : start + p.count], rows, f"{param} ({p.name})")
            loaded.append(p.name)
        if not loaded:
            raise ModelLoadError(f"no part {part!r} in a layer fusing {self.parts(param)}")
        return loaded


class RowParallelLinear(PackableLinear):
    """Input features split across ranks: each rank's product is a partial sum, added up by an
    all-reduce; the bias is added once, after it."""

    def __init__(self, in_first: int, in_count: int, out_features: int, bias: bool, shard: Shard):
        super().__init__(in_count, out_features, bias)
        self.shard, self.in_first = shard, in_first

    def load(self, param: str, source: CheckpointTensor, part: str | None) -> list[str | None]:
        target = getattr(self, param)
        if param == "weight":
            cols = source[:, self.in_first : self.in_first + target.shape[1]]
            copy_checked(target.data, cols, param)
        else:
            copy_checked(target.data, source[:], param)
        return [None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return super().forward(x)
        partial = self.matmul(x, with_bias=False)
        if self.lora is not None:  # (x_rank A_rank^T) B^T summed over ranks is the whole update
            self.lora.add_(x, partial)
        y = all_reduce(partial, self.shard)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous block of vocabulary rows (padded with zero rows so that
    the blocks are equal); a token outside this rank's block contributes zeros to the sum."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard) -> None:
        super().__init__()
        self.shard, self.vocab_size = shard, vocab_size
        self.vocab_start, self.rows = shard.split_padded(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def load(self, param: str, source: CheckpointTensor, part: str | None) -> list[str | None]:
        load_vocab_rows(self.weight, source, self.vocab_start, self.vocab_size)
        return [None]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1).to(
            self.weight.dtype
        )
        return all_reduce(x, self.shard)


class ParallelLMHead(PackableLinear):
    """The output projection, split by vocabulary like the embedding (the model gathers its
    logits on rank 0)."""

    def __init__(self, hidden_size: int, embedding: VocabParallelEmbedding) -> None:
        super().__init__(hidden_size, embedding.rows, bias=False)
        self.vocab_start, self.vocab_size = embedding.vocab_start, embedding.vocab_size

    def load(self, param: str, source: CheckpointTensor, part: str | None) -> list[str | None]:
        assert self.weight is not None
        load_vocab_rows(self.weight, source, self.vocab_start, self.vocab_size)
        return [None]


def load_vocab_rows(
    weight: torch.Tensor, source: CheckpointTensor, vocab_start: int, vocab_size: int
) -> None:
    """This rank's block of vocabulary rows; the last ranks' padding rows are zeros."""
    first = min(vocab_start, vocab_size)
    count = min(weight.shape[0], vocab_size - first)
    with torch.no_grad():
        weight.data[count:].zero_()
    copy_checked(weight.data[:count], source[first : first + count], "vocabulary rows")
