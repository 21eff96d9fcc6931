"""A tensor-parallel worker process (ranks 1..N-1): load this rank's shard, then run every step
that rank 0 sends, taking part in the layers' collectives, until told to stop or rank 0 is gone.

Steps (and, once, the KV pool's size) arrive over a pipe from rank 0 as packed int64s: a worker idle for hours just
waits on its pipe (a collective would time out), and when rank 0's process dies the pipe's EOF
ends the worker too, so no orphan is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from config import EngineConfig
from engine.distributed.shard import Shard
from engine.kv_offload import tensor_parallel as tiers
from engine.kv_offload.setup import make_kv_offload
from engine.loading.model_spec import ModelSpec
from engine.lora.checkpoint import LoRALoadError
from engine.lora.request import LoRARequest
from engine.worker.model_input import HostBatch
from engine.worker.model_runner import ModelRunner, build_runner

log = logging.getLogger(__name__)

STOP = b""
# Every other message is int64s: its kind, then a packed `HostBatch` to run or the KV pool's size,
# or an adapter to read, load into a slot or forget, or blocks for the KV offload tiers (kinds
# tiers.FIND, LOAD and STORE, 5 to 7).
STEP, ALLOCATE_KV, LOAD_LORA, READ_LORA, FORGET_LORA = 0, 1, 2, 3, 4
# READ_LORA and LOAD_LORA are answered: None, or why the adapter cannot be served on this rank.
ANSWERED = (READ_LORA, LOAD_LORA)


def message(kind: int, body: torch.Tensor) -> bytes:
    return torch.cat([torch.tensor([kind], dtype=torch.int64), body]).numpy().tobytes()


def lora_message(kind: int, request: LoRARequest, slot: int = -1) -> bytes:
    """An adapter message: its request (and slot) as JSON, padded to whole int64s."""
    text = json.dumps({"slot": slot, **dataclasses.asdict(request)}).encode()
    text += b" " * (-len(text) % 8)
    return message(kind, torch.frombuffer(bytearray(text), dtype=torch.int64))


def read_lora_message(values: torch.Tensor) -> tuple[int, LoRARequest]:
    fields = json.loads(values.numpy().tobytes())
    slot = fields.pop("slot")
    return slot, LoRARequest(**fields)


def _run_lora(runner: ModelRunner, kind: int, slot: int, request: LoRARequest) -> str | None:
    """Read or load an adapter on this rank; a failure is answered, not raised, so that rank 0
    ends only that adapter's requests instead of the worker (and every request) dying."""
    try:
        if kind == READ_LORA:
            runner.read_lora(request)
        else:
            runner.load_lora(slot, request)
    except LoRALoadError as exc:
        return str(exc)
    return None


def join_group(config: EngineConfig, spec: ModelSpec, rank: int, port: int) -> None:
    size = spec.tensor_parallel_size
    cuda = spec.device.startswith("cuda")  # then rank r runs on cuda:r (build_runner)
    if cuda:
        torch.cuda.set_device(rank)
    else:  # ranks on one CPU share its cores
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=config.parallel.distributed_timeout),
    )


def worker_main(config_json: str, spec: ModelSpec, rank: int, port: int, conn: Connection) -> None:
    """`spec` is rank 0's, resolved once: a worker reads it and resolves nothing again."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s rank{rank} %(name)s: %(message)s"
    )
    config = EngineConfig.model_validate_json(config_json)
    try:
        runner = build_runner(config, spec, Shard(rank, spec.tensor_parallel_size))
    except BaseException as exc:  # noqa: BLE001 - rank 0 raises it, named, for every cause
        conn.send(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    conn.send("loaded")
    join_group(config, spec, rank, port)
    rank_tiers: tiers.RankTiers | None = None
    try:
        while True:
            try:
                packed = conn.recv_bytes()
            except EOFError:  # rank 0 is gone
                raise SystemExit(1) from None
            if packed == STOP:
                break
            values = torch.frombuffer(bytearray(packed), dtype=torch.int64)
            if values[0] == ALLOCATE_KV:
                runner.allocate_kv(int(values[1]))
                if rank_tiers is None:
                    shard = Shard(rank, spec.tensor_parallel_size)
                    connector = make_kv_offload(config, spec, lambda: runner.kv_caches, shard)
                    rank_tiers = tiers.RankTiers(connector) if connector is not None else None
            elif values[0] in (tiers.FIND, tiers.LOAD, tiers.STORE):
                assert rank_tiers is not None, "KV offload messages without the tiers"
                answer = rank_tiers.handle(int(values[0]), values[1:])
                if values[0] == tiers.FIND:
                    conn.send(answer)
            elif values[0] in ANSWERED:
                conn.send(_run_lora(runner, int(values[0]), *read_lora_message(values[1:])))
            elif values[0] == FORGET_LORA:
                runner.forget_lora(read_lora_message(values[1:])[1])
            else:
                runner.execute(HostBatch.unpack(values[1:]))
    finally:
        if rank_tiers is not None:
            rank_tiers.close()  # its queued disk writes land first
        dist.destroy_process_group()
