"""One engine stage of bench/gpu/gpu_anchor.py in a process of its own:

    python -m bench.gpu.gpu_anchor_worker TASK.json RESULT.json      (from the repository root)

- "build": the model, as bench/gpu/gpu_bench_worker.py builds it;
- "anchor": the offline engine on the anchor workload (every prompt submitted at once to one
  `LLM.generate`), then kernels per decode step, then the decode-step table, on one engine;
- "kernels": kernels per decode step on an engine of its own, built from the task's engine
  arguments (and environment), so that a kernel switch can be counted both ways.

As in bench/gpu/gpu_bench_worker.py, the result file is rewritten after every part, and a part that
raises is recorded as "failed: <reason>" while the next part still runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

# serve_load and offline_same_workload, when run with -m
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))

from offline_same_workload import run_offline
from serve_load import make_workload, warmup_workload

from bench.cpu.decode_kernels import count_decode_kernels, count_on_engine
from bench.gpu.gpu_bench_worker import (
    Progress,
    copy_bandwidth,
    decode_step,
    describe,
    engine_facts,
    run_build,
)

Record = dict[str, object]


def run_anchor(task: Record, progress: Progress) -> None:
    from engine import LLM

    device, load = task["device"], task["workload"]
    workload = make_workload(
        load["num_prompts"], load["input_len"], load["output_len"], 0.0, load["vocab_size"],
        load["seed"],
    )  # fmt: skip
    warmup = warmup_workload(load["warmup"], load["input_len"], load["vocab_size"], load["seed"])
    decode = task["decode"]
    # Before the engine exists: its KV pool takes the memory the copy needs.
    progress.attempt("bandwidth", lambda: copy_bandwidth(device, decode["copy_bytes"]))
    llm = LLM(model=task["model_dir"], **task["engine_args"])
    progress.attempt(
        "offline", lambda: {**run_offline(llm, workload, warmup), "engine": engine_facts(llm)}
    )
    progress.attempt("kernels", lambda: count_on_engine(llm, task["kernel_batch"]))
    prompts = [item.prompt_ids for item in workload]
    for plan in decode["plans"]:
        # attempt calls the part at once, so `plan` is the current one.
        progress.attempt(
            f"decode_{plan['batch']}",
            lambda: decode_step(llm, prompts, plan, device),  # noqa: B023
        )
    llm.close()


def run_kernels(task: Record, progress: Progress) -> None:
    progress.attempt(
        "kernels",
        lambda: count_decode_kernels(task["model_dir"], task["engine_args"], task["kernel_batch"]),
    )


TASKS: dict[str, Callable[[Record, Progress], None]] = {
    "build": run_build,
    "anchor": run_anchor,
    "kernels": run_kernels,
}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    task = json.loads(Path(argv[1]).read_text())
    os.environ.update(
        task.get("env") or {}
    )  # a switch read from the environment, before the engine
    if task[
        "tiny"
    ]:  # tiny matrices gain nothing from threads, and on a busy CPU their barriers cost
        import torch

        torch.set_num_threads(1)
    progress = Progress(Path(argv[2]))
    try:
        TASKS[task["kind"]](task, progress)
    except Exception as exc:  # noqa: BLE001 - outside any part (loading): the parts not reached fail
        traceback.print_exc()
        progress.parts["error"] = describe(exc)
        progress.save()
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    # Everything is written: skip the interpreter's teardown. On the H200 (torch 2.11, CUDA 13)
    # both workers that had run torch.profiler aborted there ("terminate called without an active
    # exception"), which turned finished stages into failed ones.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
