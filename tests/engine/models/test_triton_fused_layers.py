"""A decoder given the GPU's fused Triton ops (kernels/triton/fused_ops.py) as
engine/worker/gpu_fused_ops.py gives them on CUDA (with pre-norm layers, the loop that leaves
each layer's last residual add to the next one's norm) computes what its torch ops compute: the
same hidden states and the same K/V in the paged cache, over a prefill step and the decode
step after it (which reads the K/V the fused kernel stored, the backend storing nothing). Run
here on the CPU under Triton's interpreter with the torch attention backend, float32: Qwen3
(q/k norms), Llama (GQA 4:1, Llama-3 RoPE), Gemma 3 ((1 + w) q/k norms, which stay torch ops
before the fused rotary + store)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from config import EngineConfig
from engine.distributed.shard import Shard
from engine.loading.model_loader import load_model
from engine.loading.model_spec import resolve_model_spec
from engine.models.base import DecoderModel
from engine.worker.gpu_fused_ops import CarriedResidualLayers, give_fused_ops
from kernels.attention import AttentionMetadata
from kernels.attention.torch_ref import TorchReferenceBackend
from kernels.triton import fused_ops
from tests.support.models import build_random_model

BLOCK_SIZE = 16
PROMPTS = [17, 2]  # two requests' prompt lengths: the first spans two blocks


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("gemma3"), "gemma3", "llama")


def _model(folder: Path) -> DecoderModel:
    config = EngineConfig.model_validate(
        {"model": {"model": str(folder), "dtype": "float32", "device": "cpu"}}
    )
    spec = resolve_model_spec(config)
    model = load_model(spec, Shard(0, 1), torch.device("cpu"))
    assert isinstance(model, DecoderModel)
    model.init_rotary(256)
    return model


def _steps() -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
    """(input ids, positions, metadata) of a prefill of PROMPTS and the decode step after it;
    request 0 in blocks 3 and 1, request 1 in block 2 (block 0 unused), one padded row."""
    gen = torch.Generator().manual_seed(0)
    tables = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)

    def slot(req: int, pos: int) -> int:
        return int(tables[req, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE

    prefill_pos = [p for n in PROMPTS for p in range(n)]
    prefill = AttentionMetadata(
        slot_mapping=torch.tensor([slot(r, p) for r, n in enumerate(PROMPTS) for p in range(n)]),
        block_tables=tables,
        cu_seqlens_q=torch.tensor([0, PROMPTS[0], sum(PROMPTS)], dtype=torch.int32),
        seqlens_k=torch.tensor(PROMPTS, dtype=torch.int32),
        query_lens=list(PROMPTS),
        context_lens=list(PROMPTS),
    )
    # The decode step's rows: one per request, then a pad (slot -1) as a CUDA graph's batch has.
    decode = AttentionMetadata(
        slot_mapping=torch.tensor([slot(0, PROMPTS[0]), slot(1, PROMPTS[1]), -1]),
        block_tables=torch.tensor([[3, 1], [2, 0], [0, 0]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        seqlens_k=torch.tensor([PROMPTS[0] + 1, PROMPTS[1] + 1, 1], dtype=torch.int32),
        query_lens=[1, 1, 1],
        context_lens=[PROMPTS[0] + 1, PROMPTS[1] + 1, 1],
    )
    return [
        (torch.randint(0, 500, (sum(PROMPTS),), generator=gen), torch.tensor(prefill_pos), prefill),
        (
            torch.randint(0, 500, (3,), generator=gen),
            torch.tensor([PROMPTS[0], PROMPTS[1], 0]),
            decode,
        ),
    ]


def _run(model: DecoderModel) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    info = model.info
    caches = [
        (
            torch.zeros(4, BLOCK_SIZE, info.num_kv_heads, info.head_dim),
            torch.zeros(4, BLOCK_SIZE, info.num_kv_heads, info.head_dim),
        )
        for _ in range(info.num_layers)
    ]
    hidden = []
    with torch.no_grad():
        for ids, positions, meta in _steps():
            hidden.append(model(ids, positions, TorchReferenceBackend(), caches, meta))
    return hidden, caches


@pytest.mark.parametrize("folder", ["qwen3_dir", "llama_dir", "gemma3_dir"])
def test_fused_ops_compute_what_the_torch_ops_compute(
    folder: str, request: pytest.FixtureRequest
) -> None:
    model = _model(request.getfixturevalue(folder))
    want_hidden, want_caches = _run(model)
    give_fused_ops(model, fused_ops)
    # Gemma's layers norm their output too: they keep the plain loop.
    assert isinstance(model.layers_runner, CarriedResidualLayers) == (folder != "gemma3_dir")
    got_hidden, got_caches = _run(model)
    for got, want in zip(got_hidden, want_hidden):
        torch.testing.assert_close(got[: sum(PROMPTS)], want[: sum(PROMPTS)], atol=2e-5, rtol=1e-5)
    for (got_k, got_v), (want_k, want_v) in zip(got_caches, want_caches):
        torch.testing.assert_close(got_k, want_k, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got_v, want_v, atol=2e-5, rtol=1e-5)
