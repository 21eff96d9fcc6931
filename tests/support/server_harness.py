"""A real server for tests: uvicorn on 127.0.0.1 at a free port, in a background thread of the
test process, so that tests can also look inside the engine (running and waiting requests,
free KV blocks) after talking to it over real HTTP; or the real daemon in a subprocess; and
its /metrics as Prometheus parses them. `wait_until` is the suite's one polling loop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from config import EngineConfig, ServerConfig
from engine.async_engine import AsyncEngine
from server.app import create_app
from server.lifecycle import DrainingServer
from server.metrics.collector import EngineMetrics

ROOT = Path(__file__).resolve().parents[2]

T = TypeVar("T")

# A whole /metrics scrape can be the last value a wait saw; the failure must stay readable.
MAX_SHOWN = 2000


def wait_until(
    probe: Callable[[], T],
    timeout: float,
    *,
    what: str,
    until: Callable[[T], object] = bool,
    interval: float = 0.05,
) -> T:
    """Call `probe` every `interval` s until `until` holds for its value (by default: until the
    value is truthy) and return that value; after `timeout` s, fail naming `what` and the last
    value seen, which says how far from done it was."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if until(got):
            return got
        if time.monotonic() >= deadline:
            shown = repr(got)
            if len(shown) > MAX_SHOWN:
                shown = shown[:MAX_SHOWN] + "..."
            raise AssertionError(f"waited {timeout:g} s for {what}; last value: {shown}")
        time.sleep(interval)


class RunningServer:
    def __init__(
        self,
        engine: AsyncEngine,
        config: ServerConfig,
        metrics: EngineMetrics | None = None,
        lifecycle: bool = False,
    ) -> None:
        """`lifecycle`: run the daemon's own server class, which drains on `drain()` and stops
        by itself when the engine dies (`exit_code` then says what the process would exit with)."""
        self.engine = engine
        self.app = create_app(engine, config, metrics)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        settings = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2)
        gate = self.app.state.server.gate
        self._server = (
            DrainingServer(settings, engine, gate, config.shutdown_timeout)
            if lifecycle
            else uvicorn.Server(settings)
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()

        def started() -> bool:
            # A server that failed to start has ended its thread: no use waiting out the timeout.
            assert self._server.started or self._thread.is_alive(), "the test server did not start"
            return self._server.started

        wait_until(started, 30, interval=0.02, what="the test server to start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def drain(self) -> None:
        """What SIGTERM does to the daemon (lifecycle servers only)."""
        assert isinstance(self._server, DrainingServer)
        self._server.begin_drain()

    def join(self, timeout: float) -> int:
        """Wait for a lifecycle server to stop by itself; its exit status."""
        assert isinstance(self._server, DrainingServer)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the server did not stop within {timeout} s"
        return self._server.exit_code


# --------------------------------------------------------------------------- a tiny server

MAX_MODEL_LEN = 64
NUM_KV_BLOCKS = 64
ERROR_KEYS = {"message", "type", "param", "code"}

# The tiny model's tokenizer has no chat template; this one (Llama-3's layout, every role passed
# through as real templates do) lets chat requests reach the engine.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def chat_tokenizer_dir(model_dir: Path, folder: Path) -> Path:
    """The model's tokenizer files with a chat template added, in a folder of their own."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            (folder / name).write_bytes((model_dir / name).read_bytes())
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


def start_tiny_server(model_dir: Path, tokenizer_dir: Path) -> tuple[AsyncEngine, RunningServer]:
    """The tiny Llama with a 64-token context: no request can generate more than 64 tokens."""
    engine = start_engine(
        model=str(model_dir),
        tokenizer=str(chat_tokenizer_dir(model_dir, tokenizer_dir)),
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    )
    try:
        return engine, RunningServer(engine, ServerConfig())
    except BaseException:
        engine.shutdown()
        raise


def assert_openai_error(body: Any) -> dict[str, Any]:
    """`body` is exactly OpenAI's error object: one key, the four error keys, typed; the inner object."""
    assert isinstance(body, dict) and list(body) == ["error"], body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


@dataclass
class EngineState:
    running: int
    waiting: int
    free_blocks: int
    num_blocks: int
    requests: int


def engine_state(engine: AsyncEngine) -> EngineState:
    inner = engine.engine
    pool = inner.kv.pool
    scheduler = inner.scheduler
    return EngineState(
        len(scheduler.running),
        len(scheduler.waiting),
        pool.num_free,
        pool.num_blocks,
        len(inner.requests),
    )


def wait_until_idle(engine: AsyncEngine, timeout: float = 30.0) -> EngineState:
    """The engine state once no request is left in it (aborts land at the next step)."""
    return wait_until(
        lambda: engine_state(engine),
        timeout,
        until=lambda state: (state.running, state.waiting, state.requests) == (0, 0, 0),
        what="the engine to hold no request",
    )


def start_engine(**settings: object) -> AsyncEngine:
    engine = AsyncEngine.from_config(EngineConfig.from_kwargs(**settings))
    engine.start()
    return engine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_answering(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll `url` until it answers 200; fail with the process's log if it dies or never does."""

    def status() -> int | None:
        assert process.poll() is None, log.read_text()[-4000:]
        try:
            return httpx.get(url, timeout=2).status_code
        except httpx.TransportError:  # not listening yet
            return None

    wait_until(
        status, timeout, until=lambda code: code == 200, interval=0.2, what=f"{url} to answer 200"
    )


@dataclass
class Stream:
    """One streaming completion read on its own thread."""

    url: str
    body: dict
    events: list[dict | str] = field(default_factory=list)
    error: BaseException | None = None
    first_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        try:
            with httpx.stream(
                "POST",
                self.url + "/v1/completions",
                json={**self.body, "stream": True},
                timeout=120,
            ) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first_event.set()
        except BaseException as exc:  # noqa: BLE001 - a server that exits at once cuts the stream
            self.error = exc
            self.first_event.set()

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive()

    @property
    def finish_reasons(self) -> list[str]:
        chunks = [
            e for e in self.events if isinstance(e, dict) and "choices" in e
        ]  # not the error event
        return [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]


def wait_for_status(url: str, status: int, timeout: float = 10.0) -> httpx.Response:
    return wait_until(
        lambda: httpx.get(url, timeout=5),
        timeout,
        until=lambda response: response.status_code == status,
        what=f"{url} to answer {status}",
    )


# --------------------------------------------------------------------------- the daemon


@dataclass
class Daemon:
    process: subprocess.Popen
    url: str
    log: Path

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the server did not exit within {timeout} s:\n{self.log.read_text()[-3000:]}"
            ) from None


def start_daemon(
    tmp_path: Path, args: list[str], module: str = "server.cli", env: dict[str, str] | None = None
) -> Daemon:
    """`module serve ARGS` on a free port, logging to tmp_path/serve.log; once /health answers."""
    port = free_port()
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    daemon = Daemon(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_until_answering(daemon.url + "/health", process, log, timeout=180)
    except BaseException:
        process.kill()
        raise
    return daemon


def stop(daemon: Daemon) -> None:
    """Kill the daemon if it still runs, so that a failed test leaves no server behind."""
    if daemon.process.poll() is None:
        daemon.process.kill()
        daemon.process.wait()


# --------------------------------------------------------------------------- metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
# The model_name label `value` reads: servers whose metrics a test scrapes serve this name.
MODEL = "SmolLM2-135M-Instruct"


def scrape(url: str) -> Samples:
    response = httpx.get(url + "/metrics", timeout=10)
    assert response.status_code == 200
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get(
        ("pagedserve:" + name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0
    )
