"""The quantized CPU linear alone (kernels/cpu/quant_linear.cpp) against bf16_linear, on the
default model's linear shapes: 30 layers of fused q/k/v [960, 576], o [576, 576], fused gate/up
[3072, 576] and down [576, 1536], random weights (the bytes read, not their values, set the
time). Every format's 120 linears run in one pass; the formats alternate pass by pass in one
process so that a loaded machine slows them alike; the median pass per row count is reported.

    python bench/cpu/quant_kernel.py [--rows 1,4,8,16,32] [--passes 15] [--json out.json]

Formats: bf16 (bf16_linear), torch_bf16 (torch's F.linear: oneDNN, on AMX tiles where the CPU
has them), int8 per-channel, Q8_0 (8-bit, groups of 32), Q4_1 (4-bit, groups of 32 with mins)
and Q4_0 (4-bit, min -8 x scale); int8_i8, q8_0_i8, q4_1_i8 and q4_0_i8: the
same weights with int8 activations (--quantize-activations int8: integer products, AVX512-VNNI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.cpu import bf16_linear, quant_layout, quant_linear
from kernels.cpu.quant_layout import QuantizedWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
FORMATS = [
    "bf16",
    "torch_bf16",
    "int8",
    "q8_0",
    "q4_1",
    "q4_0",
    "int8_i8",
    "q8_0_i8",
    "q4_1_i8",
    "q4_0_i8",
]

Linear = Callable[[torch.Tensor], torch.Tensor]


def _four_bit(n: int, k: int, gen: torch.Generator, with_mins: bool) -> QuantizedWeight:
    q = torch.randint(0, 16, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, k // 32, generator=gen) * 0.01
    mins = -torch.rand(n, k // 32, generator=gen) * 0.08 if with_mins else -8 * scales
    return QuantizedWeight(q, scales, mins, bits=4)


def _linear(fmt: str, n: int, k: int, gen: torch.Generator) -> Linear:
    weight = torch.randn(n, k, generator=gen) * 0.02
    if fmt == "bf16":
        packed = bf16_linear.pack(weight.to(torch.bfloat16))
        return lambda x: bf16_linear.linear(x, packed, None)
    if fmt == "torch_bf16":  # torch's own bf16 linear: oneDNN, on AMX tiles where the CPU has them
        dense = weight.to(torch.bfloat16)
        return lambda x: F.linear(x, dense)
    base = fmt.removesuffix("_i8")
    if base in ("int8", "q8_0"):
        qw = quant_layout.quantize(weight, None if base == "int8" else 32)
    else:
        qw = _four_bit(n, k, gen, with_mins=fmt.startswith("q4_1"))
    pq = quant_layout.pack(qw)
    int8_activations = fmt.endswith("_i8")
    return lambda x: quant_linear.linear(x, pq, None, int8_activations)


def _model(fmt: str) -> list[tuple[int, Linear]]:
    gen = torch.Generator().manual_seed(0)
    return [(k, _linear(fmt, n, k, gen)) for _ in range(LAYERS) for n, k in SHAPES]


def _pass(layers: list[tuple[int, Linear]], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for k, run in layers:
        run(inputs[k])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--json", type=Path, default=None)
    # One thread by default: on a machine shared with other work a 2-thread pass waits for its
    # slower thread, which the scheduler decides, not the kernel.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.formats.split(",")
    models = {fmt: _model(fmt) for fmt in names}
    results: dict[str, dict[str, list[float]]] = {}
    print(
        f"threads {torch.get_num_threads()}, vector path {quant_linear.VECTOR},"
        f" int8-activation path {quant_linear.VNNI}"
    )
    print(f"{'rows':>4} " + " ".join(f"{f:>22}" for f in names))
    print("     (ms: median (bf16's median / its) [min])")
    for rows in (int(r) for r in args.rows.split(",")):
        gen = torch.Generator().manual_seed(rows)
        inputs = {
            k: torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            for k in {k for _, k in SHAPES}
        }
        times: dict[str, list[float]] = {fmt: [] for fmt in names}
        for fmt in names:  # warm-up
            _pass(models[fmt], inputs)
        for _ in range(args.passes):
            for fmt in names:
                times[fmt].append(_pass(models[fmt], inputs) * 1e3)
        results[str(rows)] = times
        medians = {fmt: statistics.median(t) for fmt, t in times.items()}
        cells = [
            f"{medians[f]:6.1f} ({medians['bf16'] / medians[f]:4.2f}x) [{min(times[f]):5.1f}]"
            for f in names
        ]
        print(f"{rows:>4} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
