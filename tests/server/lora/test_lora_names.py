"""Adapter names keep to a safe set, at run time over real HTTP (a 400 naming what is allowed,
param lora_name) and in --lora-modules (refused at start-up), while hub-like names such as
`org/adapter-v1.2` load and serve."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from config import ServerConfig
from tests.support.lora import make_adapter
from tests.support.server_harness import RunningServer, assert_openai_error, start_engine

BASE = "tiny-llama"
HTTP_TIMEOUT = 60


@pytest.fixture(scope="module")
def adapter(llama_dir: Path, tmp_path_factory) -> Path:
    return make_adapter(llama_dir, tmp_path_factory.mktemp("names") / "a", 4, 8, ["q_proj"], seed=8)


@pytest.fixture(scope="module")
def served(llama_dir: Path) -> Iterator[RunningServer]:
    engine = start_engine(
        model=str(llama_dir), enable_lora=True, max_lora_rank=8, num_kv_blocks=32, max_model_len=64
    )
    config = ServerConfig(
        served_model_name=[BASE], allow_runtime_lora_updating=True, responses_store="none"
    )
    server = RunningServer(engine, config)
    yield server
    server.stop()
    engine.shutdown()


def _load(served: RunningServer, name: str, path: Path) -> httpx.Response:
    return httpx.post(
        served.url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout=HTTP_TIMEOUT,
    )


BAD_NAMES = ["../x", "x/../y", "a\x00b", "a\nb", "a//b", "/a", "a/", "./a", "a b", "é", "a" * 257]


def test_names_outside_the_safe_set_are_400s(served, adapter):
    for name in BAD_NAMES:
        response = _load(served, name, adapter)
        assert response.status_code == 400, (name, response.text)
        error = assert_openai_error(response.json())
        assert error["param"] == "lora_name", (name, error)
        assert "ASCII letters, digits and . _ - : @ +" in error["message"], (name, error)
    client = openai.OpenAI(
        base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=HTTP_TIMEOUT
    )
    assert {m.id for m in client.models.list().data} == {BASE}
    good = "org/adapter-v1.2"
    loaded = _load(served, good, adapter)
    assert loaded.status_code == 200, loaded.text
    out = client.completions.create(model=good, prompt="Once", max_tokens=4, temperature=0)
    assert out.model == good
    assert httpx.post(
        served.url + "/v1/unload_lora_adapter", json={"lora_name": good}, timeout=HTTP_TIMEOUT
    ).is_success


@pytest.mark.parametrize("name", BAD_NAMES)
def test_lora_modules_refuse_the_same_names(name):
    for text in (f"{name}=/adapters/a", json.dumps({"name": name, "path": "/adapters/a"})):
        with pytest.raises(ValueError, match="is not allowed: a name has 1 to 256 characters"):
            ServerConfig(lora_modules=[text])
    assert ServerConfig(lora_modules=["org/adapter-v1.2@3:x+y_z=/adapters/a"]).lora_modules
