"""
A real C{redis-server} for integration tests (style.md pattern d: txredisapi
cannot run on a fake reactor).

L{RedisServer} starts C{/usr/bin/redis-server} on a free loopback port
(found by binding port 0 first), with persistence off, and can be killed and
restarted on the same port for the "Redis down" tests. L{redisServer} is a
module-scoped pytest fixture built on it; test modules import it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest
import pytest_twisted
from twisted.internet import reactor

from relay.wire.redisclient import RedisService

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def freePort() -> int:
    """
    @return: a TCP port on 127.0.0.1 that was free a moment ago.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """
    One C{redis-server} child process.

    @ivar port: the TCP port (kept across L{restart}).
    @ivar process: the running C{Popen}, or L{None}.
    """

    def __init__(self, port: int = 0):
        """
        @param port: a port, or 0 to pick a free one.
        """
        self.port = port or freePort()
        self.process = None
        self._dir = tempfile.mkdtemp(prefix="relay-redis-")

    @property
    def url(self) -> str:
        """
        @return: C{redis://127.0.0.1:<port>/0}.
        """
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 5.0) -> None:
        """
        Start the server and wait (blocking, briefly) until it answers.
        """
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self._dir,
             "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        """
        Kill the server (SIGKILL: a crash, nothing saved) and reap it.
        """
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        """
        Start again on the same port after L{stop}.
        """
        self.stop()
        self.start()

    def command(self, *args: str) -> bytes:
        """
        Send one command synchronously (for test setup), e.g. C{FLUSHALL}.

        @return: the raw reply bytes.
        """
        payload = f"*{len(args)}\r\n".encode()
        for a in args:
            b = a.encode()
            payload += b"$%d\r\n%s\r\n" % (len(b), b)
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(payload)
            return s.recv(65536)

    def cleanup(self) -> None:
        """
        Stop and remove the working directory.
        """
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def requireRedis() -> None:
    """
    Skip the calling test module when no C{redis-server} binary exists.
    """
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server not installed")


@pytest.fixture(scope="module")
def redisServer():
    """
    A running L{RedisServer} for one test module; flushed per test by the
    modules' own fixtures.
    """
    requireRedis()
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest_twisted.async_yield_fixture
async def redisService(redisServer):
    """
    A started L{RedisService} on a flushed server; stopped afterwards.
    """
    if redisServer.process is None:
        redisServer.start()
    redisServer.command("FLUSHALL")
    service = RedisService(url=redisServer.url, clock=reactor)
    service.startService()
    yield service
    await service.stopService()
