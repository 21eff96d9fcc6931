"""The GPU check of quantized linears, one command on a CUDA machine (no network):

    python bench/gpu/gpu_quantized.py [--out bench/out] [--tokens 32] [--batches 1,16] [--steps 32]

1. Kernels on the GPU against float32 references: the Triton W4A16/W8A16 linear
   (kernels/triton/quant_linear.py) at the default model's and a 7B Llama's shapes, at 1 and
   256 rows, in its formats; the FP8 linear (kernels/gpu_quant/fp8.py, torch._scaled_mm).
   Reported: the largest error relative to the reference's largest magnitude.
2. Greedy tokens of the default model (4 fixed prompts, --tokens each) as bf16, fp8 (quantized
   at load), gguf (its own file's Q4_1 blocks on the W4A16 kernel), int8 (W8A16) and an FP8
   checkpoint of it (compressed-tensors FP8_DYNAMIC, written once into the temp folder by
   compressed-tensors' own compressor, as bench/models/quantized_checkpoints.py writes them; served as
   stored: its e4m3 bytes through torch._scaled_mm): how many tokens equal bf16's, and each
   prompt's first differing position.
3. Decode speed side by side: for each batch size, B random prompts of 128 tokens prefilled,
   then --steps decode steps timed (the engine's step: schedule, model, sample), the best of
   3 rounds, as tok/s; and each format's weight bytes on the GPU.

Writes gpu_quantized.json into --out and prints a markdown table. Exits 1 when a kernel check
exceeds its bound (W4A16/W8A16: the rounding bound of the CPU tests; FP8: 2^-7 of the
product of its de-quantized operands, 0.1 of the unquantized one), a format cannot start, or
the FP8 checkpoint's linears are not FP8 on the GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams
from engine.models.layers.linear import PackableLinear, ParallelLMHead
from kernels.cpu.quant_layout import QuantizedWeight
from kernels.gpu_quant.fp8 import Fp8Weight, fp8_linear, quantize_activations
from kernels.gpu_quant.fp8 import quantize_weight as quantize_fp8
from kernels.triton.quant_layout import PackedQuantWeight, pack
from kernels.triton.quant_linear import quant_linear

FORMATS = {"bf16": None, "fp8": "fp8", "gguf": "gguf", "int8": "int8"}
# Checkpoints of the default model saved quantized (compressed-tensors preset and format),
# served without a flag.
CHECKPOINTS = {"fp8-checkpoint": ("FP8_DYNAMIC", "float-quantized")}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Three reasons to learn a second language are",
]
SHAPES = {"SmolLM2-135M down": (576, 1536), "Llama-3.1-8B down": (4096, 14336)}
KERNEL_FORMATS = {
    "int4-g32-mins": (4, 32, True),
    "int4-g128": (4, 128, False),
    "int8-row": (8, 0, False),
}


def kernel_checks(device: str = "cuda") -> list[dict[str, object]]:
    rows_out: list[dict[str, object]] = []
    gen = torch.Generator().manual_seed(0)
    for shape_name, (n, k) in SHAPES.items():
        for fmt, (bits, group, mins) in KERNEL_FORMATS.items():
            group = group or k
            low, high = (0, 16) if bits == 4 else (-127, 128)
            q = torch.randint(low, high, (n, k), generator=gen).to(torch.int8)
            scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
            offsets = torch.randn(n, k // group, generator=gen) * 0.05 if mins else None
            weight = QuantizedWeight(q, scales, offsets, bits)
            packed = pack(weight).to(device)
            w = weight.dequantize().to(device)
            for m in (1, 256):
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                want = x.float() @ w.t()
                got = quant_linear(x, packed, None).float()
                # The tests' bound (tests/kernels/gpu_quant): each weight rounded to bf16, float32
                # sums, the output rounded to bf16.
                terms = x.float().abs() @ w.abs().t()
                bound = terms * (2**-7 + k * 2**-24) + want.abs() * 2**-7 + 1e-6
                rel = ((got - want).abs().max() / want.abs().max()).item()
                worst = ((got - want).abs() / bound).max().item()
                rows_out.append(
                    {
                        "kernel": "quant_linear",
                        "shape": shape_name,
                        "format": fmt,
                        "rows": m,
                        "relative_error": rel,
                        "error_over_bound": worst,
                        "ok": worst <= 1.0,
                    }
                )
        weight_f = torch.randn(n, k, device=device) * 0.02
        fp8: Fp8Weight = quantize_fp8(weight_f.to(torch.bfloat16))
        for m in (1, 256):
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            xq, xs = quantize_activations(x, "token")
            exact = (xq.float() * xs) @ fp8.dequantize().t()
            got = fp8_linear(x, fp8, None).float()
            rel_exact = ((got - exact).abs().max() / exact.abs().max()).item()
            plain = x.float() @ weight_f.to(torch.bfloat16).float().t()
            rel = ((got - plain).abs().max() / plain.abs().max()).item()
            rows_out.append(
                {
                    "kernel": "fp8_linear",
                    "shape": shape_name,
                    "format": "fp8-channel-token",
                    "rows": m,
                    "relative_error": rel,
                    "relative_to_dequantized": rel_exact,
                    "ok": rel <= 0.1 and rel_exact <= 2**-7,
                }
            )
    return rows_out


def checkpoint(name: str) -> Path:
    """The default model saved as `name` (CHECKPOINTS), written once into the temp folder:
    compressed-tensors' own compressor, round-to-nearest scales in bf16, the head dense."""
    from config.engine_config import default_cache_dir
    from engine.loading.default_model import default_model_dir
    from tests.support.quantized_checkpoints import compress

    preset, fmt = CHECKPOINTS[name]
    folder = Path(tempfile.gettempdir()) / f"pagedserve-smollm2-135m-{name}"
    if not (folder / "config.json").is_file():
        compress(default_model_dir(default_cache_dir()), folder, preset, fmt)
    return folder


def fp8_linears(llm: LLM) -> tuple[int, int]:
    """Linears running on an Fp8Weight, and the linears but the head (an FP8 checkpoint's
    must all be)."""
    model = llm.engine.executor.runner.model
    assert isinstance(model, torch.nn.Module)
    linears = [
        m
        for m in model.modules()
        if isinstance(m, PackableLinear) and not isinstance(m, ParallelLMHead)
    ]
    return sum(isinstance(m.gpu_quantized, Fp8Weight) for m in linears), len(linears)


def engine(quantization: str | None, batch: int, device: str, model: Path | None = None) -> LLM:
    return LLM(
        None if model is None else str(model),
        dtype="bfloat16",
        device=device,
        quantization=quantization,
        max_model_len=512,
        max_num_seqs=max(batch, len(PROMPTS)),
        enable_prefix_caching=False,
        # A pool for the largest batch at the longest length, not --gpu-memory-utilization's
        # share: four engines start one after another in this process.
        block_size=16,
        num_kv_blocks=max(batch, len(PROMPTS)) * (512 // 16) + 8,
    )


def gpu_weight_mib(llm: LLM) -> float:
    model = llm.engine.executor.runner.model
    assert isinstance(model, torch.nn.Module)
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        form = getattr(module, "gpu_quantized", None)
        if isinstance(form, Fp8Weight):
            tensors += [form.q, form.scales]
        elif isinstance(form, PackedQuantWeight):
            tensors += [form.words, form.scales] + ([] if form.mins is None else [form.mins])
    return sum(t.untyped_storage().nbytes() for t in tensors) / 2**20


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_tok_s(llm: LLM, batch: int, steps: int, seed: int) -> float:
    eng = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for _ in range(batch):
        prompt = [rng.randrange(100, 32000) for _ in range(128)]
        eng.add_request(prompt, params, prompt_token_ids=prompt)
    first: set[str] = set()
    while len(first) < batch:
        first |= {o.request_id for o in eng.step()}
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    elapsed = time.perf_counter() - started
    while eng.has_unfinished_requests():
        eng.step()
    return batch * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=32)
    # A dry run of the script's flow on a CPU (fp8 is refused there, kernels skipped).
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    kernels = kernel_checks() if args.device == "cuda" else []
    result["kernels"] = kernels
    failed = [r for r in kernels if not r["ok"]]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    formats: dict[str, dict[str, object]] = {}
    for name in [*FORMATS, *CHECKPOINTS]:
        try:
            if name in CHECKPOINTS:
                llm = engine(None, max(batches), args.device, checkpoint(name))
            else:
                llm = engine(FORMATS[name], max(batches), args.device)
        except Exception as exc:  # noqa: BLE001 - reported, and the other formats still run
            formats[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed.append(formats[name])
            continue
        with llm:
            fp8_count, linear_count = fp8_linears(llm)
            if name in CHECKPOINTS and args.device == "cuda" and fp8_count != linear_count:
                failed.append({name: f"{fp8_count} of its {linear_count} linears are FP8"})
            outs = llm.generate(PROMPTS, params)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            text = outs[0].outputs[0].text
            speed = {
                str(b): max(decode_tok_s(llm, b, args.steps, seed) for seed in range(3))
                for b in batches
            }
            formats[name] = {
                "weights_mib": gpu_weight_mib(llm),
                "fp8_linears": fp8_count,
                "decode_tok_s": speed,
                "text_0": text,  # the first prompt's continuation: does it still read as text
            }
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for name, toks in tokens.items():
        base = tokens.get("bf16")
        if base is None:
            continue
        same = sum(a == b for ours, theirs in zip(toks, base) for a, b in zip(ours, theirs))
        first = [
            next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), None)
            for o, t in zip(toks, base)
        ]
        formats[name]["tokens_equal_bf16"] = f"{same}/{len(PROMPTS) * args.tokens}"
        formats[name]["first_difference"] = first
    result["formats"] = formats
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_quantized.json").write_text(json.dumps(result, indent=1))
    print(f"# Quantized linears on {result['device']} ({result['date']})\n")
    print("| kernel | shape | format | rows | rel. error | ok |\n|---|---|---|---|---|---|")
    for r in kernels:
        print(
            f"| {r['kernel']} | {r['shape']} | {r['format']} | {r['rows']} | {r['relative_error']:.2e} | {r['ok']} |"
        )
    print(
        "\n| format | weights MiB | tokens = bf16 | first difference | "
        + " | ".join(f"tok/s B={b}" for b in batches)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(batches))
    for name, f in formats.items():
        if "error" in f:
            print(f"| {name} | {f['error']} |")
            continue
        rates = f["decode_tok_s"]
        assert isinstance(rates, dict), rates
        print(
            f"| {name} | {f['weights_mib']:.0f} | {f.get('tokens_equal_bf16', '-')} | "
            f"{f.get('first_difference', '-')} | "
            + " | ".join(f"{rates[str(b)]:.0f}" for b in batches)
            + " |"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
