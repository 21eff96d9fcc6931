"""Peak resident memory of loading quantized models, this checkout against another revision,
side by side in one run (each load in a fresh process).

    python bench/models/load_memory.py --baseline REV [--work /tmp/pagedserve-load-memory]
                                [--models gguf,w4a16,llama-1b] [--rounds 1]

Models (bfloat16, CPU):
- gguf: the default model's own Q4_1 file (SmolLM2-135M-Instruct, tied head).
- w4a16: the default model compressed W4A16 in groups of 64 by compressed-tensors'
  compressor (tests/support/quantized_checkpoints.py; the head and embedding stay dense).
- llama-1b: a random Llama shaped as TinyLlama-1.1B (hidden 2048, 22 layers, 32/4 heads, MLP
  5632) with a vocabulary of 4,096, compressed W4A16 in groups of 128 the same way: its layers
  are 0.97B weights, 1.94 GB in bfloat16.

The baseline is `git archive`d into the work folder with this checkout's compiled CPU kernels
copied beside it. A child process imports the engine from one tree, resolves the model's spec,
then resets its peak (writing 5 to /proc/self/clear_refs) and loads the model: `peak` is
VmHWM after the load, `before` the VmRSS just before it, `growth` the difference, `anon
growth` the same for the anonymous memory alone (RssAnon, sampled: see AnonPeak), `held` the
VmRSS after the load. The checkpoints are written once into the work folder (never into the
repository).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _status() -> dict[str, int]:
    """The process's Vm* and Rss* lines of /proc/self/status, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("Vm", "Rss")):
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) * 1024
    return fields


class AnonPeak(threading.Thread):
    """RssAnon sampled every millisecond: the peak of the process's own memory, without the
    checkpoint's file pages that a mapped read adds to VmHWM (clean page cache the kernel can
    drop). A sampled peak: a spike shorter than a sample may be missed."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _status()["RssAnon"])
            time.sleep(0.001)


def child(tree: Path, model: str) -> None:
    """One load, in this (fresh) process, from `tree`'s engine: a JSON line of its memory."""
    sys.path.insert(0, str(tree))
    import torch

    from config import EngineConfig
    from engine.distributed.shard import Shard
    from engine.loading.model_loader import load_model
    from engine.loading.model_spec import resolve_model_spec

    config = EngineConfig.model_validate({"model": {"model": model, "dtype": "bfloat16"}})
    spec = resolve_model_spec(config)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    before = _status()
    sampler = AnonPeak()
    sampler.start()
    start = time.perf_counter()
    loaded = load_model(spec, Shard(0, 1), torch.device("cpu"))
    seconds = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    after = _status()
    assert isinstance(loaded, torch.nn.Module)
    print(
        json.dumps(
            {
                "before": before["VmRSS"],
                "peak": after["VmHWM"],
                "anon_before": before["RssAnon"],
                "anon_peak": max(sampler.peak, after["RssAnon"]),
                "held": after["VmRSS"],
                "s": seconds,
            }
        )
    )


def _baseline_tree(rev: str, work: Path) -> Path:
    """`rev` exported from git (no worktree), with this checkout's built CPU kernels."""
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    tree = work / f"tree-{sha}"
    if not (tree / "engine").is_dir():
        with tempfile.TemporaryFile() as archive:
            subprocess.run(["git", "-C", str(REPO), "archive", sha], check=True, stdout=archive)
            archive.seek(0)
            with tarfile.open(fileobj=archive) as tar:
                tar.extractall(tree, filter="data")
        for built in (REPO / "kernels" / "cpu").glob("_*"):
            if built.suffix in (".so", ".json"):
                shutil.copy(built, tree / "kernels" / "cpu" / built.name)
    return tree


def _w4a16_default(work: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from config.engine_config import default_cache_dir
    from engine.loading.default_model import default_model_dir
    from tests.support.quantized_checkpoints import compress

    folder = work / "smollm2-135m-w4a16-g64"
    if not (folder / "config.json").is_file():
        compress(default_model_dir(default_cache_dir()), folder, "W4A16", "pack-quantized", 64)
    return folder


def _llama_1b(work: Path) -> Path:
    """The random 1B-shaped Llama, W4A16 g128 (its float32 source deleted once compressed)."""
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.quantized_checkpoints import compress

    folder = work / "random-llama-1b-w4a16-g128"
    if (folder / "config.json").is_file():
        return folder
    cfg = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    src = work / "random-llama-1b-f32"
    model.save_pretrained(src)
    del model
    compress(src, folder, "W4A16", "pack-quantized", 128)
    shutil.rmtree(src)
    return folder


def _models(names: list[str], work: Path) -> dict[str, Path]:
    sys.path.insert(0, str(REPO))
    from engine.loading.default_model import gguf_path

    makers = {"gguf": lambda: gguf_path(), "w4a16": lambda: _w4a16_default(work)}
    makers["llama-1b"] = lambda: _llama_1b(work)
    return {name: makers[name]() for name in names}


def _measure(tree: Path, model: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(tree), str(model)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tree,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare against")
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-load-memory"))
    parser.add_argument("--models", default="gguf,w4a16,llama-1b")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", nargs=2, metavar=("TREE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {args.baseline: _baseline_tree(args.baseline, args.work), "this checkout": REPO}
    models = _models(args.models.split(","), args.work)
    print(f"{'model':<10} {'tree':<14} {'before':>7} {'peak':>7} {'growth':>7} "
          f"{'anon growth':>11} {'held':>7} {'load s':>7}   (MiB)")  # fmt: skip
    for name, path in models.items():
        for _ in range(args.rounds):
            for label, tree in trees.items():  # alternated, each in a fresh process
                r = _measure(tree, path)
                growth, anon = r["peak"] - r["before"], r["anon_peak"] - r["anon_before"]
                print(
                    f"{name:<10} {label:<14} {r['before'] / MIB:>7.0f} {r['peak'] / MIB:>7.0f} "
                    f"{growth / MIB:>7.0f} {anon / MIB:>11.0f} {r['held'] / MIB:>7.0f} "
                    f"{r['s']:>7.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
