from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter; it must be chosen before any
# kernel is defined, so here, before a test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import engine.loading.resolve
from tests.support.models import build_random_model


# The oracle of the token-exact tests is transformers in float32, so the suite runs in float32
# wherever it does not name a dtype, also on a CPU where `--dtype auto` would pick bfloat16 (that
# choice is tested on its own in test_config.py): in this process, and in the servers it starts.
def _float32_suite() -> bool:
    return False


_float32_suite.__wrapped__ = (
    engine.loading.resolve.cpu_multiplies_bf16
)  # the real probe, for its own test
engine.loading.resolve.cpu_multiplies_bf16 = _float32_suite
os.environ["PAGEDSERVE_DTYPE"] = "float32"


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """Llama: GQA 4:1, untied embeddings, Llama-3 RoPE, sharded checkpoint, Llama-3.2 tokenizer."""
    return build_random_model(tmp_path_factory.mktemp("llama"), "llama", "llama", shard=True)


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory) -> Path:
    """Mistral: GQA 2:1, untied, Llama-2 tokenizer family (here the Llama-3.2 one)."""
    return build_random_model(tmp_path_factory.mktemp("mistral"), "mistral", "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2: q/k/v bias, tied embeddings, Qwen tokenizer."""
    return build_random_model(tmp_path_factory.mktemp("qwen2"), "qwen2", "qwen")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3: per-head q/k RMSNorm, head_dim != hidden / heads, Qwen tokenizer."""
    return build_random_model(tmp_path_factory.mktemp("qwen3"), "qwen3", "qwen")


SMALL_VOCAB = 8192


@pytest.fixture(scope="session")
def small_vocab_qwen3_dir(tmp_path_factory) -> Path:
    """qwen3_dir with its tokenizer's first 8,192 ids only, for tests whose prompts are ids below
    that and that need no special token (no chat template, no EOS): the full vocabulary's
    embedding, head and per-step logits would cost more than the layers they test."""
    folder = tmp_path_factory.mktemp("qwen3-small-vocab")
    return build_random_model(folder, "qwen3", "qwen", vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once into the cache directory."""
    from config.engine_config import default_cache_dir
    from engine.loading.default_model import default_model_dir as convert

    return convert(default_cache_dir())


# --------------------------------------------------------------------------- servers

SERVER_SETTINGS = {"num_kv_blocks": 1024, "max_num_seqs": 64}  # the default model, a 16k-token pool
SERVED_NAMES = ["SmolLM2-135M-Instruct", "smol"]


@pytest.fixture(scope="session")
def default_engine(default_model_dir: Path):
    """One engine thread on the default model, shared by the server fixtures below."""
    from tests.support.server_harness import start_engine

    engine = start_engine(model=str(default_model_dir), **SERVER_SETTINGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def engine_metrics(default_engine):
    """The default engine's Prometheus metrics, served at /metrics by both server fixtures."""
    from config import ServerConfig
    from server.app import attach_metrics

    return attach_metrics(default_engine, ServerConfig(served_model_name=SERVED_NAMES))


@pytest.fixture(scope="session")
def server(default_engine, engine_metrics, tmp_path_factory):
    """The default model served over real HTTP on 127.0.0.1, no API key; stored responses in a
    SQLite file of the session's own."""
    from config import ServerConfig
    from tests.support.server_harness import RunningServer

    store = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    config = ServerConfig(served_model_name=SERVED_NAMES, responses_store=f"sqlite://{store}")
    running = RunningServer(default_engine, config, engine_metrics)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def keyed_server(default_engine, engine_metrics, tmp_path_factory):
    """The same engine behind a second app that requires an API key, with one CORS origin."""
    from config import ServerConfig
    from tests.support.server_harness import RunningServer

    store = tmp_path_factory.mktemp("keyed-responses") / "responses.sqlite3"
    config = ServerConfig(
        api_key="sk-test-key",
        allowed_origins=["http://dashboard.example"],
        responses_store=f"sqlite://{store}",
    )
    running = RunningServer(default_engine, config, engine_metrics)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    """The official OpenAI client pointed at the test server."""
    import openai

    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


# --------------------------------------------------------------------------- redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server for the session (tests/support/redis_server.py); its redis:// URL."""
    from tests.support.redis_server import running_redis

    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's redis-server, emptied first: each test starts with nothing stored."""
    from redis import Redis

    with Redis.from_url(redis_server) as client:
        client.flushall()
    return redis_server


# Where the suite's time goes, a module at a time (setup, call and teardown summed), printed after
# the slowest tests: module-scoped fixtures hide a module's cost from --durations' per-test list.
_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::")[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if len(_module_seconds) < 2:
        return
    slowest = sorted(_module_seconds.items(), key=lambda item: -item[1])[:30]
    terminalreporter.write_sep("=", f"slowest 30 of {len(_module_seconds)} modules")
    for module, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s {module}")
