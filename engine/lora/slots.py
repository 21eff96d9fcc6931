"""The adapters' slots on one rank's model: the LoRA layers given to its linears, what each
slot holds, and the per-step row mask. A checkpoint is placed by the loader's own rules: a
checkpoint module name is located as a weight would be (q/k/v and gate/up into their fused
layers, by part), and each rank keeps its slice: B's rows of a column-parallel layer (the
output features it computes), A's columns of a row-parallel one (the input features it sees).

Checkpoints read are kept on the host, up to `max_cpu_loras`, so that an adapter evicted from
its slot comes back without reading its files again. Reading and slicing (`prepare`) touch only
the files and the layers' shapes, fixed at start-up, so they may run on any thread; keeping
(`keep`) and loading into a slot belong to the thread that runs the model.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.lora.checkpoint import LoRACheckpoint, LoRALoadError, read_checkpoint
from engine.lora.request import LoRARequest
from engine.models.base import DecoderModel
from engine.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.models.layers.lora import LoRALayer, LoRAStep

# safetensors' widest dtype (F64, I64, U64), and what its header may spend on one tensor's
# entry (name, dtype, shape, offsets) and on the whole file beyond its entries: generous for
# PEFT's names (about 60 characters) and its metadata.
MAX_ITEM_BYTES = 8
HEADER_BYTES_PER_TENSOR = 1024
HEADER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Placement:
    """One part of one layer's weights for this rank: A [r, in_rank], B [out_rank, r]."""

    layer: str
    part: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class PlacedAdapter:
    scaling: float
    placements: list[Placement]


class LoRASlots:
    def __init__(self, model: DecoderModel, num_slots: int, rank: int, max_cpu_loras: int) -> None:
        self.model = model
        self.step = LoRAStep(num_slots, rank)
        self.max_cpu_loras = max_cpu_loras
        self.scales = torch.zeros(num_slots)
        self.cache: OrderedDict[LoRARequest, PlacedAdapter] = OrderedDict()
        self.layers: dict[str, ColumnParallelLinear | RowParallelLinear] = {}
        model.lora_step = self.step
        self.shard_size = model.shard.size
        for name, module in list(model.named_modules()):  # (a LoRA layer joins each)
            if not name.startswith("layers.") or not isinstance(
                module, ColumnParallelLinear | RowParallelLinear
            ):
                continue
            weight = module.weight if module.weight is not None else module.packed
            assert weight is not None
            sizes = (
                [p.count for p in module.part_list]
                if isinstance(module, ColumnParallelLinear)
                else [module.out_features]
            )
            module.lora = LoRALayer(self.step, module.in_features, sizes, self.dtype, weight.device)
            self.layers[name] = module
        self.max_weights_bytes = self._max_weights_bytes(rank)

    def _max_weights_bytes(self, rank: int) -> int:
        """The largest `adapter_model.safetensors` an adapter these slots could serve may be:
        an A and a B of rank `rank` for every module it may target (each projection of every
        layer, whole: not this rank's slice), in the widest dtype, with room for the header. A
        larger file cannot be a servable adapter, so it is refused before it is read."""
        elements, tensors = 0, 0
        for layer in self.layers.values():
            if isinstance(layer, RowParallelLinear):
                shapes = [(layer.in_features * self.shard_size, layer.out_features)]
            else:
                shapes = [(layer.in_features, part.total) for part in layer.part_list]
            elements += sum(rank * (fan_in + fan_out) for fan_in, fan_out in shapes)
            tensors += 2 * len(shapes)
        return elements * MAX_ITEM_BYTES + tensors * HEADER_BYTES_PER_TENSOR + HEADER_BYTES

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ------------------------------------------------------------------ checkpoints

    def read(self, request: LoRARequest) -> PlacedAdapter:
        """The adapter sliced for this rank's layers (read and checked once, then kept)."""
        placed = self.cache.get(request)
        if placed is not None:
            self.cache.move_to_end(request)
            return placed
        return self.keep(request, self.prepare(request))

    def prepare(self, request: LoRARequest) -> PlacedAdapter:
        """The adapter read from its folder, checked and sliced for this rank's layers, and not
        kept: safe on any thread (LoRALoadError if it cannot be served)."""
        checkpoint = read_checkpoint(request.lora_path, self.step.rank, self.max_weights_bytes)
        return self._place(request, checkpoint)

    def keep(self, request: LoRARequest, placed: PlacedAdapter) -> PlacedAdapter:
        """Keep a prepared adapter on the host for its slot, the oldest one beyond
        `max_cpu_loras` dropped."""
        self.cache[request] = placed
        self.cache.move_to_end(request)
        while len(self.cache) > self.max_cpu_loras:
            self.cache.popitem(last=False)
        return placed

    def forget(self, request: LoRARequest) -> None:
        self.cache.pop(request, None)

    def _place(self, request: LoRARequest, ckpt: LoRACheckpoint) -> PlacedAdapter:
        placements: list[Placement] = []
        for module_name, (a, b) in ckpt.modules.items():
            found = self.model.locate(module_name.removeprefix("model.") + ".weight")
            layer_name = None if found is None else found[0].removesuffix(".weight")
            layer = self.layers.get(layer_name) if layer_name is not None else None
            if layer is None:
                raise LoRALoadError(
                    f"LoRA adapter {request.lora_path!r}: the model has no adaptable layer "
                    f"{module_name!r} (an adapter of another base model?)"
                )
            assert layer_name is not None and found is not None
            placements.extend(self._slice(request, layer_name, layer, found[1], a, b))
        return PlacedAdapter(ckpt.scaling, placements)

    def _slice(
        self,
        request: LoRARequest,
        name: str,
        layer: ColumnParallelLinear | RowParallelLinear,
        part: str | None,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> list[Placement]:
        def mismatch(why: str) -> LoRALoadError:
            return LoRALoadError(
                f"LoRA adapter {request.lora_path!r} does not fit this base model: {name}: {why}"
            )

        if isinstance(layer, RowParallelLinear):
            full_in = layer.in_features * self.shard_size
            if a.shape[1] != full_in or b.shape[0] != layer.out_features:
                raise mismatch(
                    f"A {tuple(a.shape)} and B {tuple(b.shape)} for a layer "
                    f"{full_in} -> {layer.out_features}"
                )
            cols = a[:, layer.in_first : layer.in_first + layer.in_features]
            return [Placement(name, 0, cols.contiguous(), b)]
        if a.shape[1] != layer.in_features:
            raise mismatch(f"A {tuple(a.shape)} for {layer.in_features} input features")
        # B's rows are checked against the whole tensor, not this rank's slice: rank 0 checks
        # every adapter for all ranks, so a B that fits rank 0's rows but not another's (or
        # that is too long, giving each rank a wrong slice) must be refused there.
        parts = [p for p in layer.part_list if part is None or p.name == part]
        full = sum(p.total for p in parts)
        if b.shape[0] != full:
            names = "+".join(p.name for p in parts)
            raise mismatch(f"B {tuple(b.shape)} for {full} output features of {names}")
        out = []
        for index, p in enumerate(layer.part_list):
            if part is not None and p.name != part:
                continue
            first = p.first + (p.offset if part is None else 0)
            out.append(Placement(name, index, a, b[first : first + p.count].contiguous()))
        return out

    # ------------------------------------------------------------------ slots

    def load(self, slot: int, request: LoRARequest) -> None:
        """Put the adapter into `slot` (between steps): every layer's part it does not target
        is cleared, so nothing of the slot's previous adapter remains."""
        placed = self.read(request)
        self.clear(slot)
        for placement in placed.placements:
            lora = self.layers[placement.layer].lora
            assert lora is not None
            lora.set_slot(slot, placement.part, placement.a, placement.b)
        self.scales[slot] = placed.scaling

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            lora = layer.lora
            assert lora is not None
            for part in range(len(lora.part_sizes)):
                lora.set_slot(slot, part, None, None)
        self.scales[slot] = 0.0

    def begin_step(
        self, lora_slots: list[int], query_lens: list[int], device: torch.device
    ) -> None:
        """The mask for a step whose request i runs `query_lens[i]` rows under slot
        `lora_slots[i]` (-1: the base model)."""
        if all(s < 0 for s in lora_slots):
            self.step.mask = None
            return
        rank, width = self.step.rank, self.step.num_slots * self.step.rank
        rows = torch.repeat_interleave(torch.tensor(lora_slots), torch.tensor(query_lens))
        own = rows.unsqueeze(1) == (torch.arange(width) // rank).unsqueeze(0)
        mask = own.to(self.scales.dtype) * self.scales[rows.clamp(min=0)].unsqueeze(1)
        self.step.mask = mask.to(device=device, dtype=self.dtype)
