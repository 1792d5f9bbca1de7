"""
relay as a child process (C{python -m twisted relay --config FILE}) for the
tests that kill it or run two of it (issue 12). The child's own PID is the
only one ever signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import treq
from attrs import define, field
from twisted.internet import reactor
from twisted.internet.task import deferLater

from tests.integration.redis_server import freePort

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "sk-relay-proc"
ADMIN = "admin-proc-00000000"


def writeConfig(path: str, port: int, accounts: list, extra: str = "", gateway: str = "{}") -> None:
    """
    Write a relay configuration listening on C{port} with one client key
    (L{KEY}) and the admin key L{ADMIN}.
    """
    text = (
        f'listen: "tcp:{port}:interface=127.0.0.1"\n'
        f"admin_key: {ADMIN}\n"
        f"keys: {json.dumps([{'name': 'proc', 'key': KEY, 'concurrency': 0}])}\n"
        f"accounts: {json.dumps(accounts)}\n"
        f"gateway: {gateway}\n"
        f"{extra}"
    )
    with open(path, "w") as f:
        f.write(text)


@define(eq=False)
class RelayProcess:
    """
    One relay child.

    @ivar config: the configuration file.
    @ivar log: where its output goes.
    """

    config: str
    log: str
    port: int = field(factory=freePort)
    process: subprocess.Popen = None

    def start(self, env: dict = None) -> None:
        environ = dict(os.environ, PYTHONPATH=ROOT)
        environ.pop("RELAY_TEST_CRASH_AT", None)
        environ.update(env or {})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "twisted", "relay", "--config", self.config],
            cwd=ROOT, env=environ, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def waitHealthy(self, timeout: float = 20.0) -> None:
        deadline = reactor.seconds() + timeout
        while reactor.seconds() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"relay exited with {self.process.returncode}: "
                                     + self.tail())
            try:
                r = await treq.get(self.url + "/healthz", persistent=False)
                await r.content()
                if r.code == 200:
                    return
            except Exception:
                pass
            await deferLater(reactor, 0.1, lambda: None)
        raise AssertionError("relay did not become healthy: " + self.tail())

    async def waitExit(self, timeout: float = 30.0) -> int:
        deadline = reactor.seconds() + timeout
        while self.process.poll() is None:
            if reactor.seconds() > deadline:
                raise AssertionError("relay did not exit: " + self.tail())
            await deferLater(reactor, 0.05, lambda: None)
        return self.process.returncode

    def kill(self) -> None:
        """
        SIGKILL this child (kill -9), by its own PID only.
        """
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """
        L{stop} without blocking the reactor: C{SIGTERM}, then wait for the exit while
        the reactor runs, C{SIGKILL} after C{timeout} seconds. An in-process emulator
        then answers the relay's goodbyes: behind L{stop}'s blocking wait each pooled
        upstream WebSocket waited out its 5 s close handshake.
        """
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        deadline = reactor.seconds() + timeout
        while self.process.poll() is None and reactor.seconds() < deadline:
            await deferLater(reactor, 0.05, lambda: None)
        self.kill()

    def tail(self, n: int = 3000) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    async def post(self, body: dict):
        r = await treq.post(
            self.url + "/v1/responses", json.dumps(body).encode(),
            headers={"Authorization": [f"Bearer {KEY}"], "Content-Type": ["application/json"]},
            persistent=False,
        )
        return r.code, await r.content()

    async def accounts(self) -> dict:
        r = await treq.get(self.url + "/admin/accounts",
                           headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False)
        body = json.loads(await r.content())
        return {a["id"]: a for a in body["accounts"]}
