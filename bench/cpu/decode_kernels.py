"""Kernels per decode step: torch.profiler around one `engine.step()` with every sequence decoding.

    count_decode_kernels(model_dir, engine_args, batch=8)   # an engine of its own, built from the args
    count_on_engine(llm, batch=8)                           # an engine already built and warmed up

The step is counted as it is served (CUDA graph replays where the engine captured them) and, when
graphs are in use, once more eagerly: the profiler's device-side kernel events show what the GPU
ran, but whether a graph replay's kernels reach them depends on the CUDA and CUPTI versions, so a
served count of zero says "hidden", not "none". Memory copies and sets are not kernels and are
counted apart. On a CPU there are no device kernels: the count is of CPU operators, and labelled so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

Record = dict[str, Any]

# Steps run before the counted one, with every sequence decoding: graphs replayed, kernels compiled.
WARM_STEPS = 2


def _is_transfer(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def profile_step(step: Callable[[], object], device: str) -> Record:
    """What one call of `step` ran: device kernels (CUDA) or CPU operators (CPU), by name."""
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if not cuda:
        ops = Counter(e.name for e in events if e.device_type == DeviceType.CPU)
        return {"cpu_ops": sum(ops.values()), "top": ops.most_common(12)}
    device_events = [e.name for e in events if e.device_type == DeviceType.CUDA]
    kernels = Counter(n for n in device_events if not _is_transfer(n))
    return {
        "kernels": sum(kernels.values()),
        "transfers": sum(1 for n in device_events if _is_transfer(n)),
        "top": kernels.most_common(12),
    }


def count_on_engine(llm: Any, batch: int = 8, prompt_len: int = 32) -> Record:
    """Bring `batch` sequences of `prompt_len` random-ish tokens to decoding, then profile one step
    as served and, when decode runs CUDA graphs, one step with the graphs set aside."""
    from engine import SamplingParams

    engine = llm.engine
    runner = engine.executor.runner
    device = str(runner.device)
    budget = int(engine.config.scheduler.max_num_batched_tokens)
    prefill_steps = -(-batch * prompt_len // budget)
    params = SamplingParams(
        temperature=0, max_tokens=prefill_steps + WARM_STEPS + 8, ignore_eos=True
    )
    ids = []
    try:
        for i in range(batch):
            prompt = [1000 + (i * prompt_len + j) % 5000 for j in range(prompt_len)]
            ids.append(engine.add_request(prompt, params, prompt_token_ids=prompt))
        started: set[str] = set()
        while len(started) < batch:  # every prompt prefilled and its first token sampled
            started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        for _ in range(WARM_STEPS):
            engine.step()

        def one_step() -> None:
            outputs = engine.step()
            if len(outputs) != batch or any(o.finished for o in outputs):
                raise RuntimeError(f"{len(outputs)} sequences stepped, expected {batch} decoding")

        graphs = runner.graphs
        served = profile_step(one_step, device)
        result: Record = {"batch": batch, "device": device, "cuda_graphs": graphs is not None}
        if "cpu_ops" in served:
            return {**result, "counted": "CPU operators (no device kernels on a CPU)", **served}
        result["served"] = served
        if graphs is not None:
            runner.graphs = None  # this one step eagerly: every kernel launched from the host
            try:
                result["eager"] = profile_step(one_step, device)
            finally:
                runner.graphs = graphs
        return result
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
        engine.take_stats()


def kernels_per_step(count: Record) -> tuple[int | None, str, list]:
    """The one number to report, how it was counted, and the most launched kernels (or CPU
    operators) of that step: the served step's device kernels when it ran eagerly; with CUDA
    graphs, the eager step's, which are the kernels the graph holds (what of a replay reaches the
    profiler varies: on an H200 with CUDA 13 only the 2 kernels outside the graph did); None on a
    CPU."""
    if "served" not in count:
        return None, count.get("counted", "not counted"), count.get("top", [])
    served = count["served"]
    if not count["cuda_graphs"]:
        return served["kernels"], "eager step (no CUDA graphs), device kernel events", served["top"]
    eager = count["eager"]
    return (
        eager["kernels"],
        f"eager step, the kernels its CUDA graph replays ({served['kernels']} seen in a replay)",
        eager["top"],
    )


def count_decode_kernels(model_dir: str, engine_args: Record, batch: int = 8) -> Record:
    """`count_on_engine` on an engine of its own, built from `engine_args` (LLM's keyword arguments),
    so that the same step can be counted under two settings (e.g. a kernel switch on and off)."""
    from engine import LLM

    llm = LLM(model=model_dir, **engine_args)
    try:
        return {"engine_args": engine_args, **count_on_engine(llm, batch)}
    finally:
        llm.close()
