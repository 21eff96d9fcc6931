"""What KV events cost the engine thread: decode step time with events off and on, side by
side, on a one-layer model of width 32 (its forward costs next to nothing, so the step is the
engine's own host work and any cost of the events shows in full).

    python bench/routing/kv_events_cost.py [--batch 64] [--block-sizes 16 2] [--steps 200] [--rounds 3]

Every sequence decodes greedily (EOS ignored) from a 32-token prompt; the timed steps start
once every prompt is in; each step is timed in wall time and in the engine thread's own CPU
time (which other processes on a busy machine do not inflate). "on" publishes to a PUB socket bound on loopback, drained by a
subscriber in another process that counts what it decodes; block size 2 stores a block for
every sequence every other step, far more events than a real block size gives. Rounds
alternate which of off and on runs first, so drift on a busy machine hits both alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cpu.host_step import build_tiny_llama
from engine import LLM, SamplingParams

PROMPT_LEN = 32


def drain(endpoint: str, ready, counts) -> None:  # type: ignore[no-untyped-def]
    """The subscriber process: decode every message, count batches and events."""
    import msgpack
    import zmq

    sock = zmq.Context().socket(zmq.SUB)
    sock.subscribe(b"")
    sock.connect(endpoint)
    ready.set()
    batches = events = 0
    while sock.poll(3000):
        _, _, payload = sock.recv_multipart()
        batches += 1
        events += len(msgpack.unpackb(payload)[1])
    counts.put((batches, events))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def step_ms(
    folder: Path, batch: int, block_size: int, steps: int, events: bool
) -> tuple[float, float, str]:
    max_len = PROMPT_LEN + steps + 16
    kwargs: dict[str, object] = {}
    sub = None
    if events:
        port = free_port()
        kwargs["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{port}",
        }
        ready, counts = mp.Event(), mp.Queue()
        sub = mp.Process(target=drain, args=(f"tcp://127.0.0.1:{port}", ready, counts))
    llm = LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        block_size=block_size,
        max_model_len=max_len,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * PROMPT_LEN),
        num_kv_blocks=batch * -(-max_len // block_size) + 16,
        **kwargs,
    )
    engine = llm.engine
    if sub is not None:
        sub.start()
        ready.wait()
        time.sleep(0.5)  # the subscription reaches the publisher
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 4000 + 10 for j in range(PROMPT_LEN)]
        engine.add_request(prompt, params, prompt_token_ids=prompt)
    for _ in range(3):  # every prompt in, then a decode step or two
        engine.step()
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    note = ""
    if sub is not None:
        publisher = engine.kv_events
        assert publisher is not None
        publisher.wait_published(publisher.num_enqueued, timeout=10)
        llm.close()
        sub.join(10)
        batches, n = counts.get(timeout=5)
        note = f"  ({batches} batches, {n} events received, {publisher.num_dropped} dropped)"
    else:
        llm.close()
    return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3, note


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_llama(Path(tmp))
        for block_size in args.block_sizes:
            for r in range(args.rounds):
                # Off first in odd rounds, on first in even ones: drift favours neither.
                for events in (False, True) if r % 2 == 0 else (True, False):
                    ms, cpu_ms, note = step_ms(folder, args.batch, block_size, args.steps, events)
                    print(
                        f"block {block_size:3d} round {r + 1} events {'on ' if events else 'off'}: "
                        f"median step {ms:6.3f} ms wall, {cpu_ms:6.3f} ms engine-thread CPU{note}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
