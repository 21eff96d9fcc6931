"""On a CUDA GPU (skipped without one; bench/gpu/gpu_check.sh runs these): every attention backend
that can run there against the torch reference, greedy tokens against transformers (float32
exactly, bfloat16 within transformers' own bfloat16 error), replayed CUDA graphs against eager
decode, sampling on the device, and the KV pool sized from --gpu-memory-utilization.

The engine tests name their backend: `auto` picks by the installed kernels and the GPU, and a
test must not change what it checks when a flash-attn is installed."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from config import ConfigError
from engine import LLM, SamplingParams
from kernels.attention import Platform, build_backend, choose
from kernels.attention.registry import NAMES
from tests.support.attention_cases import DECODES, SHAPES, check_against_reference
from tests.support.models import hf_greedy
from tests.support.prompts import shared_prefix_prompts

pytestmark = pytest.mark.gpu

BACKEND_CASES = [  # (backend, dtype, block sizes)
    ("triton", torch.float32, (16, 256)),
    ("triton", torch.bfloat16, (16, 256)),
    ("flash-attn", torch.bfloat16, (256,)),
    ("flash-attn-4", torch.bfloat16, (128, 16)),
]


@pytest.mark.parametrize(("backend", "dtype", "block_sizes"), BACKEND_CASES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
def test_backend_matches_reference(
    backend: str,
    dtype: torch.dtype,
    block_sizes: tuple[int, ...],
    heads: int,
    kv_heads: int,
    dim: int,
) -> None:
    try:
        choose(backend, Platform.detect("cuda", dtype, dim), block_sizes[0])
    except ConfigError as exc:
        pytest.skip(f"{backend} cannot run here: {exc}")
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    for block_size in block_sizes:
        for shapes in (SHAPES, DECODES):
            check_against_reference(
                lambda: build_backend(backend),
                heads,
                kv_heads,
                dim,
                block_size,
                shapes,
                device="cuda",
                dtype=dtype,
                atol=atol,
            )


def _prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    return [
        p[:90] for p in shared_prefix_prompts(AutoTokenizer.from_pretrained(folder), prefix_len=40)
    ][:6]


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _graph_safe_backends(dtype: torch.dtype, head_dim: int) -> list[str]:
    """The backends that can run here at `dtype` and say they can be captured in CUDA graphs."""
    names = []
    for name in NAMES:
        try:
            choose(name, Platform.detect("cuda", dtype, head_dim))
        except ConfigError:
            continue
        if build_backend(name).graph_safe:
            names.append(name)
    return names


def test_greedy_tokens_equal_transformers(llama_dir: Path) -> None:
    """float32 (the flash-attn kernels take half types only: Triton), CUDA graphs on, chunked
    prefill and prefix caching."""
    prompts = _prompts(llama_dir)
    want = hf_greedy(llama_dir, prompts, 24, device="cuda")
    _release()
    llm = LLM(
        str(llama_dir),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=64,
        num_kv_blocks=64,
    )
    assert llm.engine.executor.runner.graphs is not None
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert llm.last_run_stats.prefix_cache_hits > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_what_eager_decode_computes(llama_dir: Path, dtype: str) -> None:
    for backend in _graph_safe_backends(getattr(torch, dtype), 64):
        _check_graphs_against_eager(llama_dir, dtype, backend)


def _check_graphs_against_eager(llama_dir: Path, dtype: str, backend: str) -> None:
    prompts = _prompts(llama_dir)
    params = [
        SamplingParams(temperature=0, max_tokens=10 + 5 * i, ignore_eos=True, logprobs=0)
        for i in range(len(prompts))
    ]
    results = {}
    for eager in (True, False):
        llm = LLM(
            str(llama_dir),
            device="cuda",
            dtype=dtype,
            attention_backend=backend,
            enforce_eager=eager,
            num_kv_blocks=64,
            max_num_seqs=8,
        )
        runner = llm.engine.executor.runner
        assert (runner.graphs is None) == eager
        if not eager:
            assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]
        results[eager] = llm.generate(prompts, params)
        del llm, runner
        _release()
    tol = 1e-4 if dtype == "float32" else 5e-2
    for eager_out, graph_out in zip(results[True], results[False]):
        assert graph_out.outputs[0].token_ids == eager_out.outputs[0].token_ids, backend
        got = [next(iter(p.values())) for p in graph_out.outputs[0].logprobs]
        want = [next(iter(p.values())) for p in eager_out.outputs[0].logprobs]
        assert got == pytest.approx(want, abs=tol)


def test_kv_pool_follows_gpu_memory_utilization(llama_dir: Path) -> None:
    total = torch.cuda.mem_get_info()[1]
    blocks = {}
    for share in (0.2, 0.4):
        _release()
        llm = LLM(str(llama_dir), device="cuda", gpu_memory_utilization=share)
        blocks[share] = llm.engine.kv.pool.num_blocks
        # --dtype auto loads the float32 checkpoint as bfloat16 on a GPU: the pool's dtype and
        # block size are what the engine chose, not the checkpoint's.
        kv_dtype = llm.engine.executor.runner.kv_caches[0][0].dtype
        block_size = llm.engine.executor.runner.spec.block_size
        reserved = torch.cuda.memory_reserved()
        assert reserved <= share * total, (reserved, share * total)
        out = llm.generate(
            _prompts(llama_dir)[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
        del llm, out
    _release()
    # The second share adds 0.2 of the GPU, all of it to the pool (the weights and step are the same).
    per_block = (0.2 * total) / (blocks[0.4] - blocks[0.2])
    assert blocks[0.4] > blocks[0.2] > 0
    assert 0.9 < per_block / _bytes_per_block(llama_dir, block_size, kv_dtype) < 1.1


def _bytes_per_block(folder: Path, block_size: int, dtype: torch.dtype) -> int:
    from engine.loading.model_spec import kv_bytes_per_block
    from engine.loading.resolve import load_hf_config
    from engine.models.registry import describe

    return kv_bytes_per_block(describe(load_hf_config(folder)), block_size, dtype)


def _hf_logprobs(
    folder: Path, seqs: list[list[int]], starts: list[int], dtype
) -> list[list[float]]:
    """transformers' logprob of each token of `seqs` from `starts` on, teacher-forced."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    out = []
    with torch.inference_mode():
        for seq, start in zip(seqs, starts):
            ids = torch.tensor([seq], device="cuda")
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            rows = torch.arange(start - 1, len(seq) - 1, device="cuda")
            out.append(logp[rows, ids[0, start:]].tolist())
    del model
    _release()
    return out


@pytest.mark.parametrize("backend", ["triton", "flash-attn", "flash-attn-4"])
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(
    llama_dir: Path, backend: str
) -> None:
    """bfloat16 greedy decoding cannot equal float32 token for token (near ties flip), so the
    tolerance is transformers' own: the logprobs we report for the tokens we pick are at most
    1.5 times as far (mean absolute difference) from transformers' float32 logprobs of the same
    tokens as transformers' bfloat16 logprobs are, plus 0.002 nats."""
    try:
        choose(backend, Platform.detect("cuda", torch.bfloat16, 64))
    except ConfigError as exc:
        pytest.skip(f"{backend} cannot run here: {exc}")
    prompts = _prompts(llama_dir)
    llm = LLM(str(llama_dir), device="cuda", dtype="bfloat16", attention_backend=backend)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    )
    del llm
    _release()
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    ours = [[next(iter(pos.values())) for pos in o.outputs[0].logprobs] for o in outs]
    starts = [len(p) for p in prompts]
    f32 = _hf_logprobs(llama_dir, seqs, starts, torch.float32)
    bf16 = _hf_logprobs(llama_dir, seqs, starts, torch.bfloat16)

    def mean_gap(a: list[list[float]]) -> float:
        flat = [abs(x - y) for row, ref in zip(a, f32) for x, y in zip(row, ref)]
        return sum(flat) / len(flat)

    ours_gap, hf_gap = mean_gap(ours), mean_gap(bf16)
    print(
        f"{backend}: mean |logprob - float32| ours {ours_gap:.4f}, transformers bf16 {hf_gap:.4f}"
    )
    assert ours_gap <= 1.5 * hf_gap + 2e-3, (ours_gap, hf_gap)


def test_sampling_runs_on_the_device_with_one_transfer_per_step() -> None:
    """Temperature, top-k/top-p/min-p, penalties, logit bias and min_tokens on CUDA logits (a
    vocabulary of Qwen3's size): the tokens come to the host
    in one synchronizing transfer for the whole step, and a seed gives the same tokens as the
    same logits sampled on the CPU (the uniform numbers come from the request's CPU generator)."""
    import warnings

    from engine.core.sequence import Sequence
    from engine.worker.sampler import Sampler

    def seqs() -> list[Sequence]:
        out = []
        for i in range(8):
            params = SamplingParams(
                temperature=0.8 if i % 4 else 0.0,
                top_p=0.9 if i % 2 else 1.0,
                top_k=50 if i % 3 == 1 else -1,
                min_p=0.05 if i == 5 else 0.0,
                presence_penalty=0.5 if i == 6 else 0.0,
                repetition_penalty=1.2 if i == 7 else 1.0,
                logit_bias={5: 3.0} if i == 3 else None,
                min_tokens=4 if i == 2 else 0,
                seed=i,
            )
            seq = Sequence(
                seq_id=str(i),
                request_id=str(i),
                index=0,
                prompt_token_ids=[1, 2, 3],
                params=params,
                arrival_time=0.0,
                generator=torch.Generator().manual_seed(i),
            )
            seq.append_token(7)
            out.append(seq)
        return out

    logits = torch.randn(8, 151_936, generator=torch.Generator().manual_seed(0)) * 4
    want = [s.token_id for s in Sampler(0)(logits.clone(), seqs())]
    gpu_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [s.token_id for s in Sampler(0)(gpu_logits, seqs())]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    # The float64 CDF on the GPU may round a draw onto the neighbouring token, rarely.
    assert sum(a == b for a, b in zip(got, want)) >= 7, (got, want)


def test_async_scheduling_gives_the_synchronous_tokens(llama_dir: Path) -> None:
    """CUDA graphs replayed from the model thread, a pool that preempts, chunked prompts,
    sampled and greedy requests: the same tokens with the steps overlapped and without."""
    prompts = _prompts(llama_dir)
    params = [
        SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=20 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results = {}
    for overlapped in (False, True):
        llm = LLM(
            str(llama_dir),
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            max_num_batched_tokens=48,
            num_kv_blocks=24,
            block_size=16,
            max_model_len=256,
            max_num_seqs=8,
            async_scheduling=overlapped,
        )
        assert (llm.engine._pipeline is not None) == overlapped
        assert llm.engine.executor.runner.graphs is not None
        results[overlapped] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        _release()
    assert results[True] == results[False]
