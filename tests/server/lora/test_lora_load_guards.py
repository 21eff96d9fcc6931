"""Run-time adapter loads over real HTTP against hostile input, the server serving throughout:
a named pipe for a file is refused at once, a read past --lora-load-timeout fails that load
only, and a non-finite or non-positive alpha and a NaN weight are 400s. Adapter names keep to a
safe set, at run time (a 400 naming what is allowed, param lora_name) and in --lora-modules
(refused at start-up), while hub-like names such as `org/adapter-v1.2` load and serve."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file

from config import ServerConfig
from engine.lora import checkpoint
from tests.support.lora import make_adapter
from tests.support.server_harness import RunningServer, assert_openai_error, start_engine

BASE = "tiny-llama"
LOAD_TIMEOUT = 2.0  # --lora-load-timeout of the server here
# A stream long enough to be running while a load is tried beside it.
STREAM_TOKENS = 48
# Each request's limit: far beyond what any answer here takes, so that a hang fails the test.
HTTP_TIMEOUT = 60


@pytest.fixture(scope="module")
def adapter(llama_dir: Path, tmp_path_factory) -> Path:
    return make_adapter(
        llama_dir, tmp_path_factory.mktemp("guards") / "good", 4, 8, ["q_proj", "v_proj"], seed=7
    )


@pytest.fixture(scope="module")
def served(llama_dir: Path) -> Iterator[RunningServer]:
    engine = start_engine(
        model=str(llama_dir),
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        lora_load_timeout=LOAD_TIMEOUT,
        num_kv_blocks=64,
        block_size=16,
        max_model_len=128,
    )
    config = ServerConfig(
        served_model_name=[BASE], allow_runtime_lora_updating=True, responses_store="none"
    )
    server = RunningServer(engine, config)
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture
def client(served: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=HTTP_TIMEOUT
    ) as c:
        yield c


@pytest.fixture
def fifos() -> Iterator[list[Path]]:
    """Named pipes a test makes; after it, each is opened for writing once, which releases a
    reader blocked on it, so that a failing test cannot leave the server's engine hung."""
    made: list[Path] = []
    yield made
    for fifo in made:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting: nothing to release
            pass


def _load(served: RunningServer, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(
        served.url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout=HTTP_TIMEOUT,
    )


def _refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = assert_openai_error(response.json())
    assert error["param"] == param, error
    return error["message"]


class BaseStream:
    """A base-model completion streamed on a thread: started before a load, checked after."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.started = threading.Event()
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self._thread = threading.Thread(target=self._run, args=(client,), daemon=True)
        self._thread.start()
        assert self.started.wait(HTTP_TIMEOUT), "the base completion did not start"

    def _run(self, client: openai.OpenAI) -> None:
        stream = client.completions.create(
            model=BASE,
            prompt="The keeper of the lighthouse wrote",
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            self.started.set()
            if chunk.choices:
                self.pieces.append(chunk.choices[0].text)
                self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason

    def finished(self) -> bool:
        self._thread.join(HTTP_TIMEOUT)
        return not self._thread.is_alive() and self.finish_reason == "length"


def _healthy(served: RunningServer) -> bool:
    return httpx.get(served.url + "/health", timeout=HTTP_TIMEOUT).status_code == 200


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_named_pipe_is_refused_while_serving_goes_on(
    served, client, adapter, tmp_path, fifos, name
):
    folder = Path(shutil.copytree(adapter, tmp_path / "pipe"))
    (folder / name).unlink()
    os.mkfifo(folder / name)
    fifos.append(folder / name)
    stream = BaseStream(client)
    message = _refused(_load(served, "piped", folder), "lora_path")
    assert f"{name} is a named pipe (FIFO), not a regular file" in message
    assert _healthy(served)
    assert stream.finished()
    assert "piped" not in {m.id for m in client.models.list().data}


def test_a_read_past_the_time_limit_fails_that_load_only(
    served, client, adapter, tmp_path, monkeypatch
):
    """A stand-in for a folder on a filesystem that stops answering (a network mount gone
    away): its config's read waits until the test lets it go. The load fails when its time is
    up; meanwhile a base completion runs to its end and /health answers 200; the same name
    then loads from a folder that answers."""
    slow = Path(shutil.copytree(adapter, tmp_path / "slow"))
    entered, release = threading.Event(), threading.Event()
    read_config = checkpoint._read_config

    def stalled(path: Path) -> dict:
        if path == slow:
            entered.set()
            release.wait(HTTP_TIMEOUT)
        return read_config(path)

    monkeypatch.setattr(checkpoint, "_read_config", stalled)
    answers: list[httpx.Response] = []
    loading = threading.Thread(target=lambda: answers.append(_load(served, "slow", slow)))
    loading.start()
    try:
        assert entered.wait(HTTP_TIMEOUT), "the load never read the config"
        out = client.completions.create(model=BASE, prompt="Once", max_tokens=8, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
        assert _healthy(served)
        loading.join(HTTP_TIMEOUT)
        assert answers, "the load did not answer"
        message = _refused(answers[0], "lora_path")
        assert f"timed out after {LOAD_TIMEOUT:g} s (--lora-load-timeout)" in message
        assert not release.is_set()  # its read was still stuck when the load failed
    finally:
        release.set()
        loading.join(HTTP_TIMEOUT)
    assert _load(served, "slow", adapter).status_code == 200
    out = client.completions.create(model="slow", prompt="Once", max_tokens=4, temperature=0)
    assert out.model == "slow"
    assert httpx.post(
        served.url + "/v1/unload_lora_adapter", json={"lora_name": "slow"}, timeout=HTTP_TIMEOUT
    ).is_success


def _with_alpha(adapter: Path, folder: Path, alpha: float) -> Path:
    folder = Path(shutil.copytree(adapter, folder))
    config = json.loads((folder / "adapter_config.json").read_text())
    config["lora_alpha"] = alpha
    (folder / "adapter_config.json").write_text(json.dumps(config))  # NaN, Infinity: as Python
    return folder


def test_a_non_finite_adapter_is_a_400(served, client, adapter, tmp_path):
    for i, alpha in enumerate([float("nan"), float("inf"), float("-inf"), 0, -8]):
        folder = _with_alpha(adapter, tmp_path / f"alpha{i}", alpha)
        message = _refused(_load(served, f"alpha{i}", folder), "lora_path")
        assert "lora_alpha must be a finite positive number" in message, message
    nan = Path(shutil.copytree(adapter, tmp_path / "nan"))
    tensors = load_file(nan / "adapter_model.safetensors")
    name = next(k for k in tensors if "layers.0.self_attn.v_proj.lora_B" in k)
    tensors[name][3, 1] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    message = _refused(_load(served, "nan", nan), "lora_path")
    assert "model.layers.0.self_attn.v_proj: lora_B holds NaN or infinite values" in message
    assert {m.id for m in client.models.list().data} == {BASE}
    assert _healthy(served)


BAD_NAMES = ["../x", "x/../y", "a\x00b", "a\nb", "a//b", "/a", "a/", "./a", "a b", "é", "a" * 257]


def test_names_outside_the_safe_set_are_400s(served, client, adapter):
    for name in BAD_NAMES:
        message = _refused(_load(served, name, adapter), "lora_name")
        assert "ASCII letters, digits and . _ - : @ +" in message, (name, message)
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
