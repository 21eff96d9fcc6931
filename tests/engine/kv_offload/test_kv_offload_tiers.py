"""The KV offload tiers on a real engine whose pool is smaller than the workload: documents
read once, then asked about again after the pool has evicted them. Revisits load their prefix
from the host tier, or from the disk tier (also after a restart), count it as cached tokens,
and generate exactly the tokens of an engine whose pool holds everything (float32, greedy).
Blocks of another model, dtype or adapter in the same folder never hit; bad files are misses
with a warning; a folder that cannot be written turns the disk tier off and serving goes on;
random arrivals with the tiers evicting between lookup and load keep the pool consistent; and
two tensor-parallel ranks each keep their own slice and agree on what was found."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import chain_hash
from engine.distributed.shard import Shard
from engine.kv_offload.disk_tier import SUFFIX, encode_block
from engine.kv_offload.keys import tier_key
from engine.kv_offload.setup import identity_of
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.stats import EngineStats
from tests.support.lora import make_adapter

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
COMMON = {"max_model_len": 128, "block_size": BLOCK, "dtype": "float32", "max_num_seqs": 2}
# Two sequences of 70 prompt tokens (+4) hold 10 blocks: the pool keeps about two documents.
SMALL_POOL = {**COMMON, "num_kv_blocks": 12}
HOST_GIB = 0.002  # ~500 blocks of this model: the whole workload
DISK_GIB = 0.004

_rng = random.Random(0)
DOCS = [[_rng.randrange(1000, 20000) for _ in range(4 * BLOCK)] for _ in range(6)]
QUESTIONS = [[_rng.randrange(1000, 20000) for _ in range(6)] for _ in range(2)]
FIRST = [doc + QUESTIONS[0] for doc in DOCS]
SECOND = [doc + QUESTIONS[1] for doc in DOCS]
DOC_TOKENS = 4 * BLOCK


@dataclass
class Run:
    tokens: list[list[int]]
    cached: list[int]
    stats: EngineStats


def run(llm: LLM, prompts: list[list[int]], lora: LoRARequest | None = None) -> Run:
    outputs = llm.generate(prompts, GREEDY, lora_request=lora)
    llm.engine.kv.check_consistency()
    stats = llm.last_run_stats
    assert stats is not None
    return Run(
        [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs], stats
    )


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> Iterator[LLM]:
    """An engine whose pool holds every prompt: the tokens the tiers must not change."""
    with LLM(str(llama_dir), **COMMON, num_kv_blocks=256) as llm:
        yield llm


def expected(reference: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]


def block_bytes(llm: LLM) -> int:
    return llm.engine.spec.kv_bytes_per_block


def disk(folder: Path, gib: float = DISK_GIB) -> dict[str, object]:
    return {"kv_offloading_disk_dir": str(folder), "kv_offloading_disk_size": gib}


def first_block_file(llm: LLM, doc: list[int]) -> Path:
    offload = llm.engine.offload
    assert offload is not None and offload.disk is not None
    return offload.disk.path(offload.key(chain_hash(b"", doc[:BLOCK])))


def test_revisits_load_their_prefix_from_the_host_tier(llama_dir: Path, reference: LLM) -> None:
    with LLM(str(llama_dir), **SMALL_POOL, kv_offloading_size=HOST_GIB) as llm:
        first = run(llm, FIRST)
        second = run(llm, SECOND)
        size = block_bytes(llm)
    assert first.tokens == expected(reference, FIRST)
    assert second.tokens == expected(reference, SECOND)
    assert first.stats.external_prefix_cache_hits == 0
    assert first.stats.external_prefix_cache_queries == sum(len(p) for p in FIRST)
    # The pool kept two documents at most: the first four at least come back from the tier.
    assert second.cached == [DOC_TOKENS] * len(DOCS)
    hits = second.stats.external_prefix_cache_hits
    assert hits >= 4 * DOC_TOKENS
    assert hits + second.stats.prefix_cache_hits == DOC_TOKENS * len(DOCS)
    offload = second.stats.kv_offload
    assert offload is not None
    assert offload.bytes_loaded == {"host": hits // BLOCK * size}
    assert first.stats.kv_offload is not None
    # Every full block of the first pass (4 of each prompt), copied once.
    assert first.stats.kv_offload.bytes_stored == {"host": 4 * len(DOCS) * size}
    assert offload.used_bytes["host"] == 4 * len(DOCS) * size
    assert offload.capacity_bytes["host"] == int(HOST_GIB * 2**30)


def test_revisits_load_from_the_disk_tier_and_a_restart_finds_it(
    llama_dir: Path, reference: LLM, tmp_path: Path
) -> None:
    folder = tmp_path / "tier"
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as llm:
        run(llm, FIRST)
        second = run(llm, SECOND)
    assert second.tokens == expected(reference, SECOND)
    assert second.cached == [DOC_TOKENS] * len(DOCS)
    assert second.stats.external_prefix_cache_hits >= 4 * DOC_TOKENS
    assert second.stats.kv_offload is not None
    assert set(second.stats.kv_offload.bytes_loaded) == {"disk"}
    assert len(list(folder.glob("*" + SUFFIX))) == 4 * len(DOCS)

    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as restarted:
        again = run(restarted, SECOND)
    assert again.tokens == expected(reference, SECOND)
    assert again.cached == [DOC_TOKENS] * len(DOCS)
    assert again.stats.external_prefix_cache_hits == DOC_TOKENS * len(DOCS)  # an empty pool


def test_another_model_dtype_or_adapter_never_hits(
    llama_dir: Path, qwen3_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "tier"
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as llm:
        run(llm, FIRST)
    stored = len(list(folder.glob("*" + SUFFIX)))
    with LLM(str(qwen3_dir), **SMALL_POOL, **disk(folder)) as other_model:
        assert run(other_model, FIRST).stats.external_prefix_cache_hits == 0
    with LLM(str(llama_dir), **{**SMALL_POOL, "dtype": "bfloat16"}, **disk(folder)) as bf16:
        assert run(bf16, FIRST).stats.external_prefix_cache_hits == 0
    adapter = make_adapter(llama_dir, tmp_path / "adapter", 8, 16, ["q_proj", "v_proj"], seed=1)
    lora = LoRARequest("a", 1, str(adapter))
    with LLM(
        str(llama_dir), **SMALL_POOL, **disk(folder), enable_lora=True, max_lora_rank=8
    ) as with_lora:
        assert run(with_lora, FIRST, lora).stats.external_prefix_cache_hits == 0
        # The base model's blocks are there all along.
        assert run(with_lora, FIRST).stats.external_prefix_cache_hits == DOC_TOKENS * len(DOCS)
    # Each stored its own blocks beside the others'.
    assert len(list(folder.glob("*" + SUFFIX))) == 4 * stored


def test_corrupt_truncated_and_foreign_files_are_misses_with_a_warning(
    llama_dir: Path, reference: LLM, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "tier"
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as llm:
        run(llm, FIRST)
        bad = [first_block_file(llm, doc) for doc in DOCS[:3]]
        offload = llm.engine.offload
        assert offload is not None and offload.disk is not None
        shape = offload.disk.shape
    flipped = bytearray(bad[0].read_bytes())
    flipped[-1] ^= 0xFF
    bad[0].write_bytes(bytes(flipped))
    bad[1].write_bytes(bad[1].read_bytes()[:-100])
    # A block file as another model would have written it, under this block's name.
    key = bytes.fromhex(bad[2].name.removesuffix(SUFFIX))
    bad[2].write_bytes(encode_block(key, b"\x01" * 16, torch.zeros(shape)))
    notes = folder / "notes.txt"
    notes.write_text("not a block")

    caplog.set_level(logging.WARNING, logger="engine.kv_offload")
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as restarted:
        again = run(restarted, FIRST)
    assert again.tokens == expected(reference, FIRST)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings
    for path, why in zip(bad, ["checksum mismatch", "truncated", "its model is"]):
        assert any(str(path) in w and why in w for w in warnings), (path, why, warnings)
    # The three documents computed their prefix again; the others loaded theirs.
    assert again.stats.external_prefix_cache_hits == 3 * DOC_TOKENS
    assert notes.read_text() == "not a block"  # not ours: left alone
    # Written again, whole, by the requests that recomputed them.
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as third:
        assert run(third, FIRST).stats.external_prefix_cache_hits == DOC_TOKENS * len(DOCS)


def test_a_folder_that_cannot_be_made_turns_the_disk_tier_off(
    llama_dir: Path, reference: LLM, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    caplog.set_level(logging.WARNING, logger="engine.kv_offload")
    with LLM(
        str(llama_dir), **SMALL_POOL, **disk(blocker / "tier"), kv_offloading_size=HOST_GIB
    ) as llm:
        run(llm, FIRST)
        second = run(llm, SECOND)
    assert any("KV disk tier off" in r.getMessage() for r in caplog.records)
    assert second.tokens == expected(reference, SECOND)
    assert second.stats.kv_offload is not None
    assert set(second.stats.kv_offload.bytes_loaded) == {"host"}  # the host tier still serves


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_turns_the_disk_tier_off(
    llama_dir: Path,
    reference: LLM,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
) -> None:
    """The disk fills up (or is remounted read-only) while serving: simulated at the rename
    that would put a written block in place (no test can fill a real disk here)."""
    import engine.kv_offload.disk_tier as disk_tier

    def failing_replace(src: object, dst: object) -> None:
        raise OSError(code, "simulated")

    monkeypatch.setattr(disk_tier.os, "replace", failing_replace)
    folder = tmp_path / "tier"
    caplog.set_level(logging.WARNING, logger="engine.kv_offload")
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as llm:
        first = run(llm, FIRST)
        second = run(llm, SECOND)
        offload = llm.engine.offload
        assert offload is not None and offload.disk is not None
        assert not offload.disk.enabled
    assert first.tokens == expected(reference, FIRST)
    assert second.tokens == expected(reference, SECOND)
    assert sum("KV disk tier off" in r.getMessage() for r in caplog.records) == 1
    assert list(folder.iterdir()) == []  # no temporary file left behind


def test_the_disk_tier_evicts_its_oldest_files_within_its_size(
    llama_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "tier"
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as sizing:
        run(sizing, FIRST[:1])
        file_size = next(folder.glob("*" + SUFFIX)).stat().st_size
    for f in folder.iterdir():
        f.unlink()
    gib = 10 * file_size / 2**30
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder, gib)) as llm:
        run(llm, FIRST)
        newest = first_block_file(llm, DOCS[-1])
        oldest = first_block_file(llm, DOCS[0])
    files = list(folder.glob("*" + SUFFIX))
    assert len(files) == 10
    assert newest.exists() and not oldest.exists()
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder, 5 * file_size / 2**30)):
        assert len(list(folder.glob("*" + SUFFIX))) == 5  # a smaller budget, at start-up


def test_random_arrivals_with_tier_evictions_between_lookup_and_load(
    llama_dir: Path, reference: LLM, tmp_path: Path
) -> None:
    """Requests arrive at random steps over shared documents; each time the tiers find a block,
    the host tier is flooded (evicting it) and a random disk file may vanish before the block
    is loaded. The pool stays consistent after every step, every block comes back, and every
    request gets the large pool's tokens."""
    rng = random.Random(7)
    prompts = []
    for _ in range(24):
        doc = rng.choice(DOCS)
        cut = rng.randrange(BLOCK, len(doc) + 1)
        prompts.append(doc[:cut] + [rng.randrange(1000, 20000) for _ in range(rng.randrange(1, 9))])
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randrange(1, 7), ignore_eos=True)
        for _ in prompts
    ]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    host_gib = 40 * 4096 / 2**30  # 40 blocks of this model
    with LLM(
        str(llama_dir), **SMALL_POOL, kv_offloading_size=host_gib, **disk(tmp_path / "tier")
    ) as llm:
        assert block_bytes(llm) == 4096
        engine = llm.engine
        offload = engine.offload
        assert offload is not None and offload.host is not None and offload.disk is not None
        host, disk_tier, find = offload.host, offload.disk, offload.find
        shape = disk_tier.shape
        found = 0

        def racing_find(block_hash: bytes):  # type: ignore[no-untyped-def]
            nonlocal found
            block = find(block_hash)
            if block is not None:
                found += 1
                if rng.random() < 0.5:  # every block of the host tier evicted
                    for _ in range(host.capacity_bytes // block_bytes(llm)):
                        host.put(rng.randbytes(16), torch.zeros(shape))
                files = list(disk_tier.folder.glob("*" + SUFFIX))
                if files and rng.random() < 0.3:
                    rng.choice(files).unlink()
            return block

        offload.find = racing_find  # type: ignore[method-assign]
        pending = list(enumerate(prompts))
        got: dict[str, list[int]] = {}
        while pending or engine.has_unfinished_requests():
            for _ in range(rng.randrange(0, 3)):
                if pending:
                    i, prompt = pending.pop(0)
                    engine.add_request(prompt, params[i], request_id=str(i))
            for out in engine.step():
                if isinstance(out, RequestOutput) and out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
            engine.kv.check_consistency()
            offload.flush()
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert found > 0
    assert [got[str(i)] for i in range(len(prompts))] == want


def test_weights_replaced_in_the_same_folder_never_hit(llama_dir: Path, tmp_path: Path) -> None:
    """A new revision saved over the old one keeps the folder's path: its blocks must not be
    the old weights'. A weight file with another size or modification time is another model."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    folder = tmp_path / "tier"
    with LLM(str(model), **SMALL_POOL, **disk(folder)) as llm:
        run(llm, FIRST)
    with LLM(str(model), **SMALL_POOL, **disk(folder)) as same:
        assert run(same, FIRST[:1]).stats.external_prefix_cache_hits == DOC_TOKENS
    weights = sorted(model.glob("*.safetensors"))[0]  # one shard of the checkpoint
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # saved again
    with LLM(str(model), **SMALL_POOL, **disk(folder)) as replaced:
        assert run(replaced, FIRST[:1]).stats.external_prefix_cache_hits == 0


def test_two_ranks_keep_their_own_slices_and_agree_on_the_hit_length(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    """Qwen3's 2 KV heads on 2 ranks: each rank stores its head's half of every block in tiers
    of its own (host, and a disk folder of its own), revisits and a restart load both halves,
    and a block one rank lost ends the hit for both (here: that document computes its prefix
    again), with the tokens of one rank and a pool that holds everything."""
    with LLM(str(qwen3_dir), **COMMON, num_kv_blocks=256) as one_rank:
        want_first, want_second = (expected(one_rank, p) for p in (FIRST, SECOND))
    folder = tmp_path / "tier"
    two_ranks = {**SMALL_POOL, "tensor_parallel_size": 2}
    with LLM(str(qwen3_dir), **two_ranks, kv_offloading_size=HOST_GIB, **disk(folder)) as llm:
        first = run(llm, FIRST)
        second = run(llm, SECOND)
        slice_bytes = block_bytes(llm)  # one rank's: its KV head
        identities = [identity_of(llm.engine.spec, Shard(r, 2)).digest() for r in (0, 1)]
    assert first.tokens == want_first and second.tokens == want_second
    assert second.cached == [DOC_TOKENS] * len(DOCS)
    hits = second.stats.external_prefix_cache_hits
    assert hits >= 4 * DOC_TOKENS
    assert second.stats.kv_offload is not None and first.stats.kv_offload is not None
    # Both ranks' bytes: each stored every full block once, and loaded each hit.
    assert second.stats.kv_offload.bytes_loaded == {"host": hits // BLOCK * 2 * slice_bytes}
    stored = 4 * len(DOCS) * 2 * slice_bytes
    assert first.stats.kv_offload.bytes_stored == {"host": stored, "disk": stored}
    ranks = [folder / "tp2-rank0", folder / "tp2-rank1"]
    assert sorted(folder.iterdir()) == ranks
    assert [len(list(f.glob("*" + SUFFIX))) for f in ranks] == [4 * len(DOCS)] * 2

    # Rank 1 loses the first block of the first document.
    lost = tier_key(identities[1], chain_hash(b"", DOCS[0][:BLOCK]))
    (ranks[1] / (lost.hex() + SUFFIX)).unlink()
    with LLM(str(qwen3_dir), **two_ranks, **disk(folder)) as restarted:
        again = run(restarted, SECOND)
    assert again.tokens == want_second
    assert again.cached == [0] + [DOC_TOKENS] * (len(DOCS) - 1)
    assert again.stats.external_prefix_cache_hits == DOC_TOKENS * (len(DOCS) - 1)


def test_a_request_whose_prefix_is_read_from_disk_holds_up_no_running_one(
    llama_dir: Path, reference: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart, a revisit's blocks are on disk only. They are read on the disk reader's
    thread as the request arrives (held back here until the test lets them go); meanwhile the
    request already running decodes a token every step and the revisit waits in the queue; then
    it is admitted with its whole document loaded, and gives the large pool's tokens."""
    import engine.kv_offload.disk_tier as disk_tier

    folder = tmp_path / "tier"
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as llm:
        run(llm, FIRST)
    read = disk_tier.DiskTier.read
    gate = threading.Event()
    readers: set[str] = set()

    def held_read(self: disk_tier.DiskTier, key: bytes) -> torch.Tensor | None:
        readers.add(threading.current_thread().name)
        assert gate.wait(60)
        return read(self, key)

    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as restarted:
        engine = restarted.engine
        engine.add_request(QUESTIONS[0] * 3, long, request_id="running")
        engine.step()  # its prompt
        monkeypatch.setattr(disk_tier.DiskTier, "read", held_read)
        engine.add_request(SECOND[0], GREEDY, request_id="revisit")
        for _ in range(5):
            produced = [o.request_id for o in engine.step() if isinstance(o, RequestOutput)]
            assert produced == ["running"]  # a token a step, the revisit still queued
        assert [s.request_id for s in engine.scheduler.waiting] == ["revisit"]
        gate.set()
        got: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if isinstance(out, RequestOutput) and out.finished:
                    got[out.request_id] = out
        engine.kv.check_consistency()
    assert readers == {"kv-disk-reader"}
    assert got["revisit"].num_cached_tokens == DOC_TOKENS
    assert got["revisit"].outputs[0].token_ids == expected(reference, SECOND[:1])[0]


def test_blocks_the_disk_queue_cannot_take_are_dropped_and_counted(
    llama_dir: Path, reference: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that falls behind: writes are held until the run ends, and the queue holds two
    blocks. The first two full blocks wait in it; the other 22 are dropped, counted in the
    stats, and never reach the disk; serving goes on with the same tokens."""
    import engine.kv_offload.connector as connector
    import engine.kv_offload.disk_tier as disk_tier

    monkeypatch.setattr(connector, "MAX_DISK_QUEUE_BYTES", 2 * 4096)  # blocks of 4,096 bytes
    write = disk_tier.DiskTier.write
    gate = threading.Event()

    def slow_write(self: disk_tier.DiskTier, key: bytes, block: torch.Tensor) -> None:
        assert gate.wait(60)
        write(self, key, block)

    monkeypatch.setattr(disk_tier.DiskTier, "write", slow_write)
    folder = tmp_path / "tier"
    with LLM(str(llama_dir), **SMALL_POOL, **disk(folder)) as llm:
        assert block_bytes(llm) == 4096
        first = run(llm, FIRST)
        gate.set()
    assert first.tokens == expected(reference, FIRST)
    offload = first.stats.kv_offload
    assert offload is not None
    assert offload.blocks_dropped == {"disk": 4 * len(DOCS) - 2}
    assert offload.bytes_stored == {"disk": 2 * 4096}
    assert len(list(folder.glob("*" + SUFFIX))) == 2
