"""A sparse mixture of experts (Mixtral, Qwen3-MoE): a router picks `top_k` experts per token,
each expert a gated MLP; the outputs are summed with the routing weights.

Experts are computed batched per expert (the tokens routed to an expert gathered into one
matrix product), not per token. Under tensor parallelism the experts are sharded whole: each
rank holds `num_experts / size` of them, computes the tokens routed to its own, and an
all-reduce adds the ranks' sums. Routing reads per-expert token counts on the host, so a model
with this layer is not captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.shard import Shard, all_reduce
from engine.models.layers.linear import CheckpointTensor, ReplicatedLinear, copy_checked
from engine.models.layers.mlp import activation


class Experts(nn.Module):
    """The experts of one layer as two stacked weights: gate and up fused `[E, 2 * I, H]`, down
    `[E, H, I]`; checkpoint tensors are named per expert and part (`"3.gate"`)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate: int, act: str, shard: Shard
    ) -> None:
        super().__init__()
        self.first, self.count = shard.split(num_experts)
        self.intermediate, self.act = intermediate, activation(act)
        self.gate_up = nn.Parameter(torch.empty(self.count, 2 * intermediate, hidden_size))
        self.down = nn.Parameter(torch.empty(self.count, hidden_size, intermediate))

    def parts(self, param: str) -> list[str | None]:
        names = ("gate", "up") if param == "gate_up" else ("down",)
        return [f"{e}.{n}" for e in range(self.first, self.first + self.count) for n in names]

    def load(self, param: str, source: CheckpointTensor, part: str | None) -> list[str | None]:
        assert part is not None
        expert, name = part.split(".")
        local = int(expert) - self.first
        if not 0 <= local < self.count:
            return []  # another rank's expert
        rows = {"gate": slice(0, self.intermediate), "up": slice(self.intermediate, None)}
        target = getattr(self, param).data[local]
        copy_checked(target[rows.get(name, slice(None))], source[:], f"expert {part}")
        return [part]

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; experts, weights [T, top_k]: this rank's share of the weighted sum."""
        out = torch.zeros_like(x)
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # token slots grouped by expert
        counts = torch.bincount(flat, minlength=self.first + self.count).tolist()
        start = sum(counts[: self.first])
        for local in range(self.count):
            n = counts[self.first + local]
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            tokens = slots // top_k
            gate, up = F.linear(x[tokens], self.gate_up[local]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[local])
            out.index_add_(0, tokens, y * weights.flatten()[slots].unsqueeze(-1))
        return out


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        normalize: bool,
        act: str,
        shard: Shard,
    ) -> None:
        super().__init__()
        self.top_k, self.normalize, self.shard = top_k, normalize, shard
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate, act, shard)

    def forward(self, x: torch.Tensor, fused: object = None) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, experts, weights.to(x.dtype))
        return all_reduce(out, self.shard)
