"""--quantize-activations auto: int8 activations where this CPU runs the model's quantized linears
clearly faster with them, measured at start-up on the loaded weights.

Which path wins depends on the CPU more than on the format: the int8 path trades the 4-bit
widening for integer dot products (VNNI), a win at every row count on some machines and a wash at
one row on others. A table per CPU model would go stale with every kernel change, so the engine
times the model's own linears (one of each shape, weighted by how many the model has) exact and
with int8 activations, alternating, at one row and at a batch's rows, and keeps the faster. Since
int8 activations are not the exact numbers, they are taken only when they are at least
`MARGIN` faster at every row count timed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.models.base import DecoderModel
from engine.models.interface import CausalLM
from engine.models.layers.linear import PackableLinear
from engine.worker.cpu.activation_quant import takes_int8_activations
from kernels.cpu.quant_layout import PackedWeight

MARGIN = 0.9  # int8 activations' time over the exact path's, at most, to take them
PASSES = 5


@dataclass(frozen=True)
class ActivationTiming:
    """The model's quantized linears, one step's worth, timed each way (best of PASSES)."""

    linears: int  # the model's linears that can take int8 activations
    rows: tuple[int, ...]
    exact_ms: tuple[float, ...]  # per row count
    int8_ms: tuple[float, ...]

    @property
    def int8(self) -> bool:
        return all(i <= MARGIN * e for i, e in zip(self.int8_ms, self.exact_ms))

    def describe(self) -> str:
        times = ", ".join(
            f"{r} row{'s' * (r > 1)}: {e:.2f} ms exact, {i:.2f} ms int8 ({e / i:.2f}x)"
            for r, e, i in zip(self.rows, self.exact_ms, self.int8_ms)
        )
        verdict = (
            "int8 activations (rounded per block of 32 inputs, integer products)"
            if self.int8
            else f"16-bit activations (int8 ones are not {1 / MARGIN:.2f}x faster at every row count)"
        )
        return f"--quantize-activations auto: {verdict}; the {self.linears} linears took {times}"


def _shapes(model: DecoderModel) -> dict[tuple, tuple[PackedWeight, int]]:
    """One weight of each layout (shape, bits, groups, mins) and how many the model has."""
    weights = [
        m.quantized
        for m in model.modules()
        if isinstance(m, PackableLinear) and m.quantized is not None
    ]
    if model.lm_head_quantized is not None:
        weights.append(model.lm_head_quantized)
    shapes: dict[tuple, tuple[PackedWeight, int]] = {}
    for w in weights:
        if not takes_int8_activations(w):
            continue
        key = (w.n, w.k, w.bits, w.scales.shape[1], w.mins is not None)
        first, count = shapes.get(key, (w, 0))
        shapes[key] = (first, count + 1)
    return shapes


def _time_ms(weight: PackedWeight, x: torch.Tensor, int8: bool) -> float:
    from kernels.cpu import quant_linear  # loads: auto reaches here only where int8 can run

    start = time.perf_counter()
    quant_linear.linear(x, weight, None, int8)
    return (time.perf_counter() - start) * 1e3


def time_activations(
    model: CausalLM, dtype: torch.dtype, rows: tuple[int, ...]
) -> ActivationTiming | None:
    """Both paths timed on the model's own weights; None where no linear takes int8 activations."""
    shapes = _shapes(model) if isinstance(model, DecoderModel) else {}
    if not shapes:
        return None
    exact, int8 = [], []
    gen = torch.Generator().manual_seed(0)
    for r in rows:
        totals = {False: 0.0, True: 0.0}
        for weight, count in shapes.values():
            x = torch.randn(r, weight.k, generator=gen).to(dtype)
            best = {False: float("inf"), True: float("inf")}
            for flag in (False, True):  # warm each path once (first calls allocate)
                _time_ms(weight, x, flag)
            for _ in range(PASSES):  # alternated, so that a busy moment slows both alike
                for flag in (False, True):
                    best[flag] = min(best[flag], _time_ms(weight, x, flag))
            for flag in (False, True):
                totals[flag] += count * best[flag]
        exact.append(totals[False])
        int8.append(totals[True])
    linears = sum(count for _, count in shapes.values())
    return ActivationTiming(linears, rows, tuple(exact), tuple(int8))
