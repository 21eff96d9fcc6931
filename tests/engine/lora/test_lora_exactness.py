"""LoRA adapters through pagedserve give transformers + peft's greedy tokens, float32: alone,
mixed in one batch with the base model and a second adapter (every row its own reference),
under chunked prefill, preemption and prefix caching, and with fewer slots than adapters (a
slot reloaded between steps)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine import LLM, LoRARequest, SamplingParams
from tests.support.lora import ALL_TARGETS, make_adapter, peft_greedy
from tests.support.prompts import cut_prompts

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
LENGTHS = [3, 19, 41]


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("lora")
    a = make_adapter(llama_dir, root / "a", rank=8, alpha=16, targets=ALL_TARGETS, seed=1)
    # rsLoRA, a lower rank than the slots', only some of the projections.
    b = make_adapter(
        llama_dir,
        root / "b",
        rank=4,
        alpha=8,
        targets=["q_proj", "v_proj", "down_proj"],
        seed=2,
        use_rslora=True,
    )
    return {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}


@pytest.fixture(scope="module")
def prompts(llama_dir: Path) -> list[list[int]]:
    return cut_prompts(AutoTokenizer.from_pretrained(llama_dir), LENGTHS)


@pytest.fixture(scope="module")
def references(llama_dir, adapters, prompts) -> dict[str | None, list[list[int]]]:
    refs: dict[str | None, list[list[int]]] = {None: peft_greedy(llama_dir, None, prompts, MAX_NEW)}
    for name, request in adapters.items():
        refs[name] = peft_greedy(llama_dir, Path(request.lora_path), prompts, MAX_NEW)
    return refs


def test_adapters_change_the_output(references):
    """Otherwise an engine that ignored adapters would pass every test below."""
    assert references["a"] != references[None]
    assert references["b"] != references[None]
    assert references["a"] != references["b"]


@pytest.fixture(scope="module")
def llm(llama_dir: Path):
    """Chunked (16-token budget), preempting (a pool of 14 blocks of 8 for 9 sequences of up
    to 51 tokens) and prefix-cached, with two slots."""
    with LLM(
        str(llama_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_num_batched_tokens=16,
        num_kv_blocks=14,
        block_size=8,
        max_model_len=64,
        enable_prefix_caching=True,
        max_num_seqs=9,
    ) as engine:
        yield engine


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_one_adapter_alone(llm, adapters, prompts, references):
    assert _tokens(llm.generate(prompts, GREEDY, lora_request=adapters["a"])) == references["a"]


def test_mixed_batch_each_row_its_own_adapter(llm, adapters, prompts, references):
    names = [None, "a", "b"]
    batch = [(p, i, name) for name in names for i, p in enumerate(prompts)]
    outputs = llm.generate(
        [p for p, _, _ in batch],
        GREEDY,
        lora_request=[None if n is None else adapters[n] for _, _, n in batch],
    )
    stats = llm.last_run_stats
    for (_, i, name), out in zip(batch, outputs, strict=True):
        assert out.outputs[0].token_ids == references[name][i], (name, i)
    assert stats.num_preemptions > 0  # the pool was too small for the batch
    kv = llm.engine.kv
    assert kv.pool.num_free == kv.pool.num_blocks


def test_generate_reads_each_adapter_once(llm, adapters, prompts, references, monkeypatch):
    """One read per adapter of the call (before any prompt is queued), not one per prompt."""
    reads = []
    read = llm.engine.executor.read_lora
    monkeypatch.setattr(
        llm.engine.executor, "read_lora", lambda r, *kept: reads.append(r) or read(r, *kept)
    )
    outputs = llm.generate(prompts * 2, GREEDY, lora_request=adapters["a"])
    assert _tokens(outputs) == references["a"] * 2
    assert reads == [adapters["a"]]


def test_prefix_cache_isolates_adapters(llm, adapters, llama_dir):
    """The same prompt under A, B, A, B, then the base model: nothing cached across adapters,
    the whole cacheable prefix within one, and the tokens from cached K/V still the
    reference's."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    (prompt,) = cut_prompts(tokenizer, [45])  # not run before in this module: a cold cache
    prompt = prompt[5:]  # 40 tokens: 4 full blocks of 8 may be cached (the last token never)
    order = [adapters["a"], adapters["b"], adapters["a"], adapters["b"], None]
    refs = {
        lora: peft_greedy(
            llama_dir, None if lora is None else Path(lora.lora_path), [prompt], MAX_NEW
        )[0]
        for lora in order
    }
    cached = []
    for lora in order:
        (out,) = llm.generate([prompt], GREEDY, lora_request=lora)
        cached.append(out.num_cached_tokens)
        assert out.outputs[0].token_ids == refs[lora]
    assert cached == [0, 0, 32, 32, 0]


def test_fewer_slots_than_adapters(llama_dir, adapters, prompts, references):
    """One slot, two adapters and the base: the scheduler runs one adapter at a time and the
    slot is reloaded between steps."""
    with LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=8) as one:
        loras = [adapters["a"], adapters["b"], None, adapters["a"]]
        outputs = one.generate([prompts[1]] * 4, GREEDY, lora_request=loras)
    expected = [references["a"][1], references["b"][1], references[None][1], references["a"][1]]
    assert _tokens(outputs) == expected


def test_removing_an_adapter_in_use_lets_its_requests_finish(llm, adapters, prompts, references):
    """Unloading takes effect for new requests; one already running keeps its adapter to the
    end (its slot is left alone while it runs)."""
    engine = llm.engine
    engine.add_request(prompts[2], GREEDY, request_id="held", lora_request=adapters["b"])
    engine.step()  # its first chunk ran under b
    engine.remove_lora(adapters["b"])
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    assert tokens == {"held": references["b"][2]}
    engine.remove_lora(adapters["b"])  # idle now: its slot and host copy go
    assert adapters["b"] not in engine.loras.assignment.slots


def test_an_adapter_that_fails_to_reload_ends_only_its_requests(
    llama_dir, adapters, prompts, references, tmp_path
):
    """a's folder is gone by the time a slot needs it (its host copy dropped for b's: one host
    copy kept): a's request ends aborted, the engine goes on, and b's tokens are b's."""
    moved = tmp_path / "a"
    shutil.copytree(adapters["a"].lora_path, moved)
    a = LoRARequest("a-moved", 7, str(moved))
    with LLM(
        str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1
    ) as one:
        engine = one.engine
        engine.add_request(prompts[1], GREEDY, request_id="under-a", lora_request=a)
        engine.add_request(prompts[1], GREEDY, request_id="under-b", lora_request=adapters["b"])
        shutil.rmtree(moved)  # a's host copy went when b was read
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
        assert finished["under-a"].finish_reason == "abort"
        assert finished["under-b"].token_ids == references["b"][1]
        kv = engine.kv
        assert kv.pool.num_free == kv.pool.num_blocks
