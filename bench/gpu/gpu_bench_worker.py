"""One stage of bench/gpu/gpu_bench.py in a process of its own:

    python -m bench.gpu.gpu_bench_worker TASK.json RESULT.json      (from the repository root)

Each system runs in a fresh process so that neither starves the other: pagedserve sizes its KV
pool from the GPU memory it finds free, transformers keeps its caches and allocator pools. The
result file is rewritten after every part, so a part that crashes the process or runs out of
time leaves the parts before it; a part that raises is recorded as "failed: <reason>" and the
next part still runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from bench.gpu.gpu_bench_models import build

Record = dict[str, object]


class Progress:
    """The result file, rewritten whole (write, then rename) after each part."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.parts: Record = {}

    def attempt(self, key: str, part: Callable[[], Record]) -> None:
        try:
            self.parts[key] = {"status": "ok", **part()}
        except Exception as exc:  # noqa: BLE001 - recorded, not raised: the other parts still run
            traceback.print_exc()
            self.parts[key] = {"status": f"failed: {describe(exc)}"}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.parts))
        os.replace(tmp, self.path)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def throughput(
    prompts: list[list[int]], requested: list[int], produced: list[int], seconds: float
) -> Record:
    """`produced` counts, per request, only tokens it asked for (at most `requested`); output tok/s
    is their sum over the wall time, total tok/s adds the prompt tokens."""
    prompt_tokens = sum(map(len, prompts))
    return {
        "requests": len(prompts),
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "requested_tokens": requested,
        "output_tokens": produced,
        "output_tok_s": sum(produced) / seconds,
        "total_tok_s": (prompt_tokens + sum(produced)) / seconds,
    }


# --------------------------------------------------------------------------- build


def installed(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def run_build(task: Record, progress: Progress) -> None:
    dtype = getattr(torch, task["dtype"])
    device = task["device"]
    progress.attempt(
        "environment",
        lambda: {
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": installed("triton"),
            "transformers": installed("transformers"),
            "python": sys.version.split()[0],
        },
    )
    for name in task["models"]:
        folder = Path(task["root"]) / name
        # attempt calls the part at once, so the loop variables are the current ones.
        progress.attempt(
            name,
            lambda: build(name, folder, device, dtype, task["tiny"], task["seed"]),  # noqa: B023
        )


# --------------------------------------------------------------------------- pagedserve


def copy_bandwidth(device: str, nbytes: int, copies: int = 20) -> Record:
    """Bytes read plus bytes written per second by `dst.copy_(src)`: a copy of n bytes moves 2n."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch and allocation are not bandwidth
    synchronize(device)
    start = time.perf_counter()
    for _ in range(copies):
        dst.copy_(src)
    synchronize(device)
    seconds = time.perf_counter() - start
    del src, dst
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # before the engine measures what memory is free
    return {
        "bytes_per_copy": nbytes,
        "copies": copies,
        "seconds": seconds,
        "bytes_per_s": 2 * nbytes * copies / seconds,
    }


def engine_facts(llm) -> Record:
    """How the engine came out: its KV pool, attention backend and decode CUDA graphs."""
    engine = llm.engine
    runner = engine.executor.runner
    graphs = getattr(runner, "graphs", None)  # None: decode runs eagerly
    return {
        "kv_blocks": engine.kv.pool.num_blocks,
        "block_size": engine.block_size,
        "max_model_len": engine.max_model_len,
        "attention_backend": type(runner.backend).__name__,
        "cuda_graph_batch_sizes": list(graphs.sizes) if graphs is not None else None,
    }


def pagedserve_generate(llm, prompts: list[list[int]], requested: list[int], device: str) -> Record:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in requested]
    synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    synchronize(device)
    seconds = time.perf_counter() - start
    return throughput(prompts, requested, [len(o.outputs[0].token_ids) for o in outputs], seconds)


def decode_step(llm, prompts: list[list[int]], plan: Record, device: str) -> Record:
    """Mean wall time of `engine.step()` while all `batch` sequences decode (every prefill done)."""
    from engine import SamplingParams

    engine = llm.engine
    batch, prompt_len, steps = plan["batch"], plan["prompt_len"], plan["steps"]
    pool = [t for p in prompts for t in p]  # the workload's random tokens, reused cyclically
    params = SamplingParams(temperature=0, max_tokens=plan["max_tokens"], ignore_eos=True)
    ids = []
    try:
        for i in range(batch):
            prompt = [pool[(i * prompt_len + j) % len(pool)] for j in range(prompt_len)]
            ids.append(engine.add_request(prompt, params, prompt_token_ids=prompt))
        generated: dict[str, int] = {}
        while len(generated) < batch:
            for out in engine.step():
                generated[out.request_id] = len(out.outputs[0].token_ids)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            outputs = engine.step()
            if len(outputs) != batch or any(o.finished for o in outputs):
                raise RuntimeError(
                    f"the batch changed while timed: {len(outputs)} outputs, expected {batch} running"
                )
        synchronize(device)
        seconds = time.perf_counter() - start
    finally:  # the next batch size starts from an empty engine, whatever happened here
        for request_id in ids:
            engine.abort_request(request_id)
        engine.take_stats()
    # At timed step s a sequence holds prompt + g + s tokens (g generated before timing), all read.
    mean_context = prompt_len + sum(generated.values()) / batch + (steps - 1) / 2
    return {"batch": batch, "steps": steps, "mean_context": mean_context, "step_s": seconds / steps}


def run_pagedserve(task: Record, progress: Progress) -> None:
    from engine import LLM

    device, prompts, requested = task["device"], task["prompts"], task["output_lens"]
    decode = task["decode"]
    if decode:  # before the engine exists: its KV pool takes the memory a 1 GiB copy needs
        progress.attempt("bandwidth", lambda: copy_bandwidth(device, decode["copy_bytes"]))
    start = time.perf_counter()
    llm = LLM(model=task["model_dir"], **task["engine_args"])
    load_s = time.perf_counter() - start
    warm = [p[: task["warmup_prompt_len"]] for p in prompts[:4]]
    pagedserve_generate(
        llm, warm, [task["warmup_output_len"]] * len(warm), device
    )  # kernels compiled, graphs used
    progress.attempt(
        "throughput",
        lambda: {
            **pagedserve_generate(llm, prompts, requested, device),
            "load_s": load_s,
            "engine": engine_facts(llm),
        },
    )
    for plan in decode["plans"] if decode else []:
        # attempt calls the part at once, so `plan` is the current one.
        progress.attempt(
            f"decode_{plan['batch']}",
            lambda: decode_step(llm, prompts, plan, device),  # noqa: B023
        )


# --------------------------------------------------------------------------- transformers


def padded(batch: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and their attention mask."""
    width = max(map(len, batch))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    return ids, mask


def hf_static(
    model, prompts: list[list[int]], requested: list[int], batch_size: int, pad_id: int, device: str
) -> Record:
    """Static batches in workload order: each runs until its longest request has its tokens."""
    counted: list[int] = []
    synchronize(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i : i + batch_size], requested[i : i + batch_size]
        ids, mask = padded(batch, pad_id, device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(want),
                min_new_tokens=max(want),
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        made = out.shape[1] - ids.shape[1]  # every row runs the same number of steps
        counted += [min(n, made) for n in want]
    synchronize(device)
    return {
        **throughput(prompts, requested, counted, time.perf_counter() - start),
        "batch_size": batch_size,
    }


def hf_generate_batch(
    model, prompts: list[list[int]], requested: list[int], pad_id: int, device: str, tiny: bool
) -> Record:
    """transformers' continuous batching. It takes one max_new_tokens for all requests: each runs to
    the longest output, and only the tokens it asked for count."""
    import inspect

    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers has no generate_batch")
    accepted = inspect.signature(model.generate_batch).parameters
    config = GenerationConfig(
        max_new_tokens=max(requested), do_sample=False, eos_token_id=None, pad_token_id=pad_id
    )
    kwargs: Record = {"generation_config": config}
    if "progress_bar" in accepted:
        kwargs["progress_bar"] = False
    if tiny and "continuous_batching_config" in accepted:
        from transformers import ContinuousBatchingConfig

        # By default its cache is sized from the machine's memory: seconds of allocation on a CPU.
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=64, max_batch_tokens=256
        )
    synchronize(device)
    start = time.perf_counter()
    outputs = list(model.generate_batch(prompts, **kwargs).values())
    synchronize(device)
    call_s = time.perf_counter() - start
    errors = [o.error for o in outputs if getattr(o, "error", None)]
    if len(outputs) != len(prompts) or errors:
        raise RuntimeError(
            f"{len(outputs)} of {len(prompts)} results, {len(errors)} with errors: {errors[:1]}"
        )
    shortest = min(len(o.generated_tokens) for o in outputs)
    # The span from the first request scheduled to the last finished leaves out the manager's start
    # (cache allocation, CUDA-graph capture), as pagedserve's load is left out of its time.
    spans = [getattr(o, "lifespan", (-1, -1)) for o in outputs]
    timed_from = (
        "request lifespans" if all(s[0] > 0 and s[1] > 0 for s in spans) else "the whole call"
    )
    seconds = (
        max(s[1] for s in spans) - min(s[0] for s in spans)
        if timed_from == "request lifespans"
        else call_s
    )
    return {
        **throughput(prompts, requested, [min(n, shortest) for n in requested], seconds),
        "call_s": call_s,
        "timed_from": timed_from,
        "max_new_tokens": max(requested),
    }


def run_transformers(task: Record, progress: Progress) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device, prompts, requested = task["device"], task["prompts"], task["output_lens"]
    dtype = getattr(torch, task["dtype"])
    model = AutoModelForCausalLM.from_pretrained(
        task["model_dir"], dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    pad_id = AutoTokenizer.from_pretrained(task["model_dir"]).pad_token_id or 0
    warm = [p[: task["warmup_prompt_len"]] for p in prompts[:2]]
    hf_static(model, warm, [task["warmup_output_len"]] * len(warm), len(warm), pad_id, device)
    progress.attempt(
        "static", lambda: hf_static(model, prompts, requested, task["batch_size"], pad_id, device)
    )
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # generate_batch sizes its cache from the memory it finds free
    progress.attempt(
        "generate_batch",
        lambda: hf_generate_batch(model, prompts, requested, pad_id, device, task["tiny"]),
    )


# --------------------------------------------------------------------------- entry


TASKS: dict[str, Callable[[Record, Progress], None]] = {
    "build": run_build,
    "pagedserve": run_pagedserve,
    "transformers": run_transformers,
}


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )  # the engine's KV sizing
    task = json.loads(Path(argv[1]).read_text())
    if task[
        "tiny"
    ]:  # tiny matrices gain nothing from threads, and on a busy CPU their barriers cost seconds
        torch.set_num_threads(1)
    progress = Progress(Path(argv[2]))
    try:
        TASKS[task["kind"]](task, progress)
    # Outside any part (loading a model): the parts not reached fail with it.
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        progress.parts["error"] = describe(exc)
        progress.save()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
