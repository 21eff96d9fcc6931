"""An `LLM`'s lifetime: closing it (explicitly, twice, or by leaving its `with` block) or
dropping its last reference stops its tensor-parallel workers, leaves the process group and
gives back rank 0's torch thread count, so a second tensor-parallel `LLM` in the same process
starts and yields the first one's greedy tokens; nothing keeps a dropped engine alive."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine import LLM, ModelLoadError, SamplingParams
from engine.worker.executor import WorkerDiedError
from tests.support.server_harness import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16]]
SETTINGS = {"num_kv_blocks": 64, "max_model_len": 256}
EXIT_SECONDS = 30.0  # a bound for a hang, far above what stopping takes


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def workers() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedserve-tp")]


def exited(pid: int | None) -> bool:
    """Gone and reaped (a zombie still answers signal 0)."""
    assert pid is not None  # a started process has one
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_exited(pids: list[int | None]) -> None:
    wait_until(
        lambda: [pid for pid in pids if not exited(pid)],
        EXIT_SECONDS,
        until=lambda running: not running,
        what=f"workers {pids} to exit",
    )


def assert_released(threads: int) -> None:
    assert not dist.is_initialized()
    assert not [t for t in threading.enumerate() if t.name == "pagedserve-tp-monitor"]
    assert torch.get_num_threads() == threads  # rank 0's share of the cores given back


def test_a_dropped_or_closed_tensor_parallel_llm_stops_its_workers(
    small_vocab_qwen3_dir: Path,
) -> None:
    """Dropped, then closed by its `with` block, then closed twice: each time its worker exits
    and the next tensor-parallel LLM starts and gives the first one's tokens (one test, so that
    three engines start rather than four: each start spawns a worker that imports torch)."""
    threads = torch.get_num_threads()
    llm = LLM(str(small_vocab_qwen3_dir), tensor_parallel_size=2, **SETTINGS)
    first = greedy_tokens(llm)
    [worker] = workers()
    engine, executor = weakref.ref(llm.engine), weakref.ref(llm.engine.executor)

    del llm
    gc.collect()
    # Nothing kept them alive: not the thread that watches the workers, not the finalizer.
    assert engine() is None and executor() is None
    wait_exited([worker.pid])
    assert worker.exitcode == 0  # told to stop, not killed
    assert_released(threads)

    with LLM(str(small_vocab_qwen3_dir), tensor_parallel_size=2, **SETTINGS) as second:
        assert greedy_tokens(second) == first
        [worker] = workers()
        # The process group is one per process: a second one is refused while this one is open,
        # before it starts a worker that would wait for a group that never forms.
        with pytest.raises(ModelLoadError, match="close the other tensor-parallel engine"):
            LLM(str(small_vocab_qwen3_dir), tensor_parallel_size=2, **SETTINGS)
        assert workers() == [worker]

    assert exited(worker.pid) and worker.exitcode == 0  # close() waited for it
    assert_released(threads)
    second.close()  # a second close does nothing
    with pytest.raises(WorkerDiedError, match="closed"):
        second.generate(PROMPTS, GREEDY)

    third = LLM(str(small_vocab_qwen3_dir), tensor_parallel_size=2, **SETTINGS)
    assert greedy_tokens(third) == first
    third.close()
    third.close()
    assert not workers()
    assert_released(threads)


def test_a_dropped_single_process_llm_is_freed_at_once(small_vocab_qwen3_dir: Path) -> None:
    before = set(threading.enumerate())
    llm = LLM(str(small_vocab_qwen3_dir), **SETTINGS)
    first = greedy_tokens(llm)
    engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.executor.runner.model)
    assert set(threading.enumerate()) == before  # it starts no thread of its own

    del llm  # no reference cycle: reference counting alone frees it, weights included
    assert engine() is None and model() is None

    with LLM(str(small_vocab_qwen3_dir), **SETTINGS) as second:
        assert greedy_tokens(second) == first
