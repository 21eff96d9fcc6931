"""Configuration errors name the CLI flag to change and what it accepts; the CLI reports them
(exit status 2) and otherwise generates."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm import LLM
from engine.loading import resolve
from engine.sampling_params import SamplingParams
from server import cli

MODEL_LIMIT = 1024  # max_position_embeddings of the random test models


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"block_size": 24}, ["--block-size", "power of two", "between 1 and 1024", "24"]),
        ({"block_size": 0}, ["--block-size", ">= 1", "<= 1024"]),
        ({"block_size": 2048}, ["--block-size", ">= 1", "<= 1024", "2048"]),
        ({"max_num_seqs": 0}, ["--max-num-seqs", ">= 1", "<= 4096"]),
        ({"max_num_batched_tokens": 0}, ["--max-num-batched-tokens", ">= 1", "<= 1048576"]),
        ({"num_kv_blocks": -3}, ["--num-kv-blocks", ">= 1", "-3"]),
        ({"max_model_len": 1}, ["--max-model-len", ">= 2"]),
        ({"kv_cache_memory_gib": 0}, ["--kv-cache-memory-gib", "> 0"]),
        ({"gpu_memory_utilization": 0}, ["--gpu-memory-utilization", "> 0 and <= 1"]),
        ({"gpu_memory_utilization": 1.5}, ["--gpu-memory-utilization", "> 0 and <= 1", "1.5"]),
        (
            {"attention_backend": "flashinfer"},
            ["--attention-backend", "'flash-attn'", "'flash-attn-4'"],
        ),
        ({"seed": -1}, ["--seed", ">= 0"]),
        ({"dtype": "int8"}, ["--dtype", "'float16'", "'bfloat16'"]),
        ({"max_num_seqs": "many"}, ["--max-num-seqs", "integer"]),
    ],
)
def test_invalid_value_names_flag_and_range(kwargs: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(**kwargs)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_every_invalid_flag_of_a_section_is_reported() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(max_num_seqs=0, max_num_batched_tokens=0)
    assert "--max-num-seqs" in str(info.value) and "--max-num-batched-tokens" in str(info.value)


def test_unknown_setting() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(max_num_sequences=8)
    message = str(info.value)
    assert "max_num_sequences" in message and "--max-num-sequences" in message
    assert "max_num_seqs" in message  # the known settings are listed


def test_valid_settings_reach_their_sections(tmp_path: Path) -> None:
    config = EngineConfig.from_kwargs(
        model="m",
        dtype="float16",
        model_cache_dir=tmp_path,
        block_size=32,
        num_kv_blocks=7,
        enable_prefix_caching=False,
        max_num_seqs=3,
        max_num_batched_tokens=99,
        max_model_len=200,
    )
    assert config.model == ModelConfig(model="m", dtype="float16", model_cache_dir=tmp_path)
    assert config.cache == CacheConfig(block_size=32, num_kv_blocks=7, enable_prefix_caching=False)
    assert config.scheduler == SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=99, max_model_len=200
    )


def test_max_model_len_against_model_and_pool() -> None:
    # Defaults to the model's limit.
    assert EngineConfig.from_kwargs().resolve_max_model_len(MODEL_LIMIT) == MODEL_LIMIT
    assert EngineConfig.from_kwargs(max_model_len=64).resolve_max_model_len(MODEL_LIMIT) == 64
    # A pool of exactly max_model_len tokens is enough.
    EngineConfig.from_kwargs().check_kv_capacity(64, 4, 16)

    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(max_model_len=MODEL_LIMIT + 1).resolve_max_model_len(MODEL_LIMIT)
    assert "--max-model-len" in str(
        info.value
    ) and f"between 2 and the model's limit {MODEL_LIMIT}" in str(info.value)

    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs().check_kv_capacity(65, 4, 16)
    message = str(info.value)
    assert "--num-kv-blocks to at least 5" in message and "--max-model-len" in message


def test_engine_checks_max_model_len(qwen2_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        LLM(str(qwen2_dir), max_model_len=2 * MODEL_LIMIT, num_kv_blocks=1000)
    assert "--max-model-len" in str(info.value) and str(MODEL_LIMIT) in str(info.value)

    with pytest.raises(ConfigError) as info:
        LLM(str(qwen2_dir), max_model_len=64, num_kv_blocks=3, block_size=16)
    assert "--num-kv-blocks to at least 4" in str(info.value)


@pytest.fixture(scope="module")
def llm(qwen2_dir: Path) -> LLM:
    return LLM(str(qwen2_dir), num_kv_blocks=MODEL_LIMIT // 16)


def test_max_model_len_defaults_to_the_model(llm: LLM) -> None:
    assert llm.engine.max_model_len == MODEL_LIMIT  # max_position_embeddings


# ---------------------------------------------------------------- command line


def test_cli_generate(qwen2_dir: Path, llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(
        ["generate", str(qwen2_dir), "--prompt", "hi", "--max-tokens", "4", "--num-kv-blocks", "64"]
    )
    printed = capsys.readouterr().out
    assert status == 0
    # The CLI samples greedily by default.
    expected = llm.generate("hi", SamplingParams(max_tokens=4, temperature=0.0))
    text = expected[0].outputs[0].text
    assert len(expected[0].outputs[0].token_ids) == 4
    assert f"--- prompt: 'hi'\n{text}\n[finish_reason=length]" in printed


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--block-size", "24"], ["--block-size", "power of two"]),
        (["--max-num-seqs", "0"], ["--max-num-seqs", ">= 1"]),
        (
            ["--max-model-len", str(4 * MODEL_LIMIT), "--num-kv-blocks", "1000"],
            ["--max-model-len", str(MODEL_LIMIT)],
        ),
        (["--max-tokens", "0", "--num-kv-blocks", "64"], ["max_tokens must be at least 1"]),
    ],
)
def test_cli_invalid_flag(
    qwen2_dir: Path, capsys: pytest.CaptureFixture[str], flags: list[str], words: list[str]
) -> None:
    status = cli.main(["generate", str(qwen2_dir), "--prompt", "hi", *flags])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.startswith("pagedserve: error: ")
    for word in words:
        assert word in captured.err
    assert "[finish_reason=" not in captured.out


def test_cli_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_windowed_models_serve_their_whole_context_with_a_window_per_layer() -> None:
    """Sliding-window layers attend through their window, so a windowed model is served up to
    its trained context; which layers are windowed comes from the config."""
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    from engine.loading.model_spec import context_limit
    from engine.models.registry import describe

    mistral = MistralConfig(max_position_embeddings=1024, sliding_window=128, num_hidden_layers=2)
    assert context_limit(mistral) == 1024
    assert describe(mistral).sliding_windows == (128, 128)
    no_window = MistralConfig(sliding_window=None, num_hidden_layers=2)
    assert describe(no_window).sliding_windows == (None, None)
    # Qwen2 declares a window but uses it only with use_sliding_window, above max_window_layers.
    off = Qwen2Config(sliding_window=64, use_sliding_window=False, num_hidden_layers=3)
    assert describe(off).sliding_windows == (None, None, None)
    on = Qwen2Config(
        sliding_window=64, use_sliding_window=True, max_window_layers=1, num_hidden_layers=3
    )
    assert describe(on).sliding_windows == (None, 64, 64)
    gemma = Gemma2Config(sliding_window=32, num_hidden_layers=4)
    assert describe(gemma).sliding_windows == (32, None, 32, None)


@pytest.mark.parametrize(("native_bf16", "want"), [(True, torch.bfloat16), (False, torch.float32)])
def test_dtype_auto_on_cpu_follows_native_bf16(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool, want: torch.dtype
) -> None:
    monkeypatch.setattr(resolve, "cpu_multiplies_bf16", lambda: native_bf16)
    dtype, why = resolve.resolve_dtype(
        "auto", SimpleNamespace(dtype="float32"), torch.device("cpu")
    )
    assert dtype == want
    assert "auto" in why and "bfloat16" in why
    # An explicit dtype is kept, whatever the CPU.
    assert resolve.resolve_dtype("float32", None, torch.device("cpu"))[0] == torch.float32


def test_dtype_auto_on_a_gpu_takes_the_checkpoint_dtype_in_half_precision() -> None:
    cuda = torch.device("cuda")
    assert resolve.resolve_dtype("auto", SimpleNamespace(dtype="float16"), cuda)[0] == torch.float16
    assert (
        resolve.resolve_dtype("auto", SimpleNamespace(dtype="float32"), cuda)[0] == torch.bfloat16
    )


def test_cpu_bf16_detection_reads_the_cpu_flags() -> None:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert resolve.cpu_multiplies_bf16.__wrapped__() == (
        "avx512_bf16" in flags or "amx_bf16" in flags
    )


def test_device_auto_takes_the_gpu_when_torch_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ModelConfig().device == "auto"
    assert resolve.resolve_device("cpu") == "cpu"
    for available, want in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda a=available: a)
        assert resolve.resolve_device("auto") == want


def test_engine_resolves_device_dtype_and_backend_into_its_spec(llm: LLM) -> None:
    spec = llm.engine.spec
    assert (spec.device, spec.dtype, spec.attention_backend) == ("cpu", torch.float32, "cpu")
