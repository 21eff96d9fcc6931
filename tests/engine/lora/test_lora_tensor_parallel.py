"""LoRA under tensor parallelism 2 (gloo, a worker process): each rank holds its slice of every
adapter (B's rows on q/k/v and gate/up, A's columns on o and down) and the workers load an
adapter into the same slot as rank 0, between steps; greedy tokens of a batch mixing the base
model and two adapters, chunked, preempted and prefix-cached, equal transformers + peft's."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from engine import LLM, LoRARequest, SamplingParams
from tests.support.lora import ALL_TARGETS, make_adapter, peft_greedy
from tests.support.models import build_random_model
from tests.support.prompts import cut_prompts

MAX_NEW = 8


def test_mixed_adapters_with_two_ranks(tmp_path: Path) -> None:
    model = build_random_model(tmp_path / "llama", "llama", "llama", num_key_value_heads=2)
    a = make_adapter(model, tmp_path / "a", 8, 16, ALL_TARGETS, seed=21)
    b = make_adapter(model, tmp_path / "b", 4, 8, ["k_proj", "o_proj", "up_proj"], seed=22)
    loras = {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}
    prompts = cut_prompts(AutoTokenizer.from_pretrained(model), [5, 30])
    refs = {
        name: peft_greedy(
            model, None if name is None else Path(loras[name].lora_path), prompts, MAX_NEW
        )
        for name in (None, "a", "b")
    }
    batch = [(p, i, name) for name in (None, "a", "b") for i, p in enumerate(prompts)]
    with LLM(
        str(model),
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_num_batched_tokens=16,
        num_kv_blocks=12,
        block_size=8,
        max_model_len=64,
    ) as llm:
        outputs = llm.generate(
            [p for p, _, _ in batch],
            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
            lora_request=[None if n is None else loras[n] for _, _, n in batch],
        )
        assert llm.last_run_stats.num_preemptions > 0
        kv = llm.engine.kv
        assert kv.pool.num_free == kv.pool.num_blocks
    for (_, i, name), out in zip(batch, outputs, strict=True):
        assert out.outputs[0].token_ids == refs[name][i], (name, i)


def test_workers_read_an_adapter_when_it_is_added(tmp_path: Path) -> None:
    """Every rank reads its slice when the adapter is added: folders removed afterwards still
    serve from each rank's host copy, even for an adapter no step had used yet and one evicted
    from the single slot and loaded again (a worker reading lazily would die here)."""
    import shutil

    model = build_random_model(tmp_path / "llama", "llama", "llama", num_key_value_heads=2)
    a = make_adapter(model, tmp_path / "a", 4, 8, ["q_proj", "down_proj"], seed=31)
    b = make_adapter(model, tmp_path / "b", 4, 8, ["v_proj", "up_proj"], seed=32)
    loras = {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}
    prompt = cut_prompts(AutoTokenizer.from_pretrained(model), [6])[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(
        str(model),
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=4,
        num_kv_blocks=8,
        block_size=8,
        max_model_len=32,
        enable_prefix_caching=False,
    ) as llm:
        first = llm.generate([prompt], params, lora_request=loras["a"])[0]
        llm.engine.add_lora(loras["b"])
        shutil.rmtree(a)
        shutil.rmtree(b)
        under_b = llm.generate([prompt], params, lora_request=loras["b"])[0]
        again = llm.generate([prompt], params, lora_request=loras["a"])[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert len(under_b.outputs[0].token_ids) == 4
