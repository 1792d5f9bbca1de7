"""
A Redis Sentinel group on loopback for the failover tests (issue 23): one
master, one replica and three Sentinels, all real C{redis-server} processes
(a Sentinel is C{redis-server FILE --sentinel}), tuned to fail over within
a couple of seconds (C{down-after-milliseconds} 1000, quorum 2).

Every data node runs with the persistence docs/deploying.md asks of a
Sentinel deployment: AOF on (C{appendonly yes}, C{appendfsync everysec}).
With a single replica, C{min-replicas-to-write} stays off here: once the
master dies the promoted replica has no replica of its own and would refuse
every write (docs/deploying.md's production layout has two replicas).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from twisted.internet import reactor
from twisted.internet.task import deferLater

from tests.integration.redis_server import REDIS_SERVER, freePort

MASTER_NAME = "relaymaster"


def _send(port: int, *args: str, timeout: float = 2.0) -> bytes:
    """
    One command to a loopback Redis or Sentinel; the raw reply.
    """
    payload = f"*{len(args)}\r\n".encode()
    for a in args:
        b = str(a).encode()
        payload += b"$%d\r\n%s\r\n" % (len(b), b)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        data = b""
        while True:
            chunk = s.recv(65536)
            data += chunk
            if not chunk or data.endswith(b"\r\n"):
                return data


def _parse(reply: bytes):
    """
    A minimal RESP2 reader for replies to the commands used here.
    """

    def read(i):
        kind, end = reply[i:i + 1], reply.index(b"\r\n", i)
        line = reply[i + 1:end]
        i = end + 2
        if kind in (b"+", b"-"):
            return line.decode(), i
        if kind == b":":
            return int(line), i
        if kind == b"$":
            n = int(line)
            if n < 0:
                return None, i
            return reply[i:i + n].decode(), i + n + 2
        if kind == b"*":
            n = int(line)
            out = []
            for _ in range(max(n, 0)):
                item, i = read(i)
                out.append(item)
            return out, i
        raise ValueError(reply)

    return read(0)[0]


class SentinelGroup:
    """
    The processes and their ports.

    @ivar data: C{{port: Popen}} of the data nodes (master first).
    @ivar sentinels: C{{port: Popen}} of the Sentinels.
    """

    def __init__(self, downAfterMs: int = 1000):
        self.dir = tempfile.mkdtemp(prefix="relay-sentinel-")
        self.downAfterMs = downAfterMs
        self.masterPort = freePort()
        self.replicaPort = freePort()
        self.sentinelPorts = [freePort() for _ in range(3)]
        self.data: dict = {}
        self.sentinels: dict = {}

    # -- lifecycle -------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> None:
        """
        Start master, replica and Sentinels; wait until the replica is in
        sync and every Sentinel knows the replica and the other Sentinels.
        """
        self._startData(self.masterPort)
        self._startData(self.replicaPort, replicaOf=self.masterPort)
        for port in self.sentinelPorts:
            self._startSentinel(port)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._settled():
                return
            time.sleep(0.1)
        raise RuntimeError("sentinel group did not settle: " + self.describe())

    def _startData(self, port: int, replicaOf: int | None = None) -> None:
        workdir = os.path.join(self.dir, f"data-{port}")
        os.makedirs(workdir, exist_ok=True)
        argv = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                "--dir", workdir, "--save", "", "--appendonly", "yes",
                "--appendfsync", "everysec", "--protected-mode", "no",
                "--loglevel", "warning", "--logfile", os.path.join(workdir, "redis.log")]
        if replicaOf is not None:
            argv += ["--replicaof", "127.0.0.1", str(replicaOf)]
        self.data[port] = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)
        self._waitPing(port)

    def _startSentinel(self, port: int) -> None:
        path = os.path.join(self.dir, f"sentinel-{port}.conf")
        with open(path, "w") as f:
            f.write(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\n"
                f"dir {self.dir}\nlogfile {self.dir}/sentinel-{port}.log\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.masterPort} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.downAfterMs}\n"
                f"sentinel failover-timeout {MASTER_NAME} 5000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
        self.sentinels[port] = subprocess.Popen(
            [REDIS_SERVER, path, "--sentinel"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._waitPing(port)

    def _waitPing(self, port: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if _send(port, "PING", timeout=0.3).startswith(b"+PONG"):
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis on {port} did not start")

    def _settled(self) -> bool:
        try:
            info = _send(self.replicaPort, "INFO", "replication").decode()
            if "master_link_status:up" not in info:
                return False
            for port in self.sentinelPorts:
                master = self._sentinelMaster(port)
                if int(master.get("num-slaves", 0)) < 1:
                    return False
                if int(master.get("num-other-sentinels", 0)) < 2:
                    return False
            return True
        except (OSError, ValueError):
            return False

    def _sentinelMaster(self, port: int) -> dict:
        flat = _parse(_send(port, "SENTINEL", "MASTER", MASTER_NAME))
        return dict(zip(flat[::2], flat[1::2]))

    def stop(self) -> None:
        """
        Kill every process and remove the working directory.
        """
        for proc in list(self.sentinels.values()) + list(self.data.values()):
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except OSError:
                    pass
                proc.kill()
            proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- what the tests ask ------------------------------------------------------

    @property
    def addresses(self) -> list:
        """
        @return: C{["127.0.0.1:port", ...]} of the Sentinels.
        """
        return [f"127.0.0.1:{p}" for p in self.sentinelPorts]

    def currentMaster(self) -> int | None:
        """
        @return: the port the Sentinels name as master now (the first one
            that answers), or L{None}.
        """
        for port in self.sentinelPorts:
            try:
                reply = _parse(_send(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME))
                return int(reply[1])
            except (OSError, ValueError, TypeError, IndexError):
                continue
        return None

    def role(self, port: int) -> str | None:
        """
        @return: C{master} or C{slave} as the node itself says, or L{None}.
        """
        try:
            return _parse(_send(port, "ROLE"))[0]
        except (OSError, ValueError):
            return None

    def command(self, port: int, *args: str):
        """
        @return: the parsed reply of one command to a node.
        """
        return _parse(_send(port, *args))

    def killMaster(self) -> int:
        """
        SIGKILL the current master (a crash). @return: its port.
        """
        port = self.currentMaster()
        proc = self.data[port]
        proc.kill()
        proc.wait(10)
        return port

    def manualFailover(self) -> int:
        """
        C{SENTINEL FAILOVER}: the master is demoted while it runs, the
        replica promoted. @return: the old master's port.
        """
        port = self.currentMaster()
        reply = _send(self.sentinelPorts[0], "SENTINEL", "FAILOVER", MASTER_NAME)
        if not reply.startswith(b"+OK"):
            raise RuntimeError(f"SENTINEL FAILOVER: {reply!r}")
        return port

    async def waitMaster(self, notPort: int, timeout: float = 20.0) -> int:
        """
        Wait (without blocking the reactor: the emulator runs on it) until
        the Sentinels name another master and it says so itself.

        @return: its port.
        """
        deadline = reactor.seconds() + timeout
        while reactor.seconds() < deadline:
            port = self.currentMaster()
            if port is not None and port != notPort and self.role(port) == "master":
                return port
            await deferLater(reactor, 0.05, lambda: None)
        raise RuntimeError("no new master: " + self.describe())

    async def waitRole(self, port: int, role: str, timeout: float = 20.0) -> None:
        """
        Wait (without blocking the reactor) until the node on C{port} says
        it is a C{role}.
        """
        deadline = reactor.seconds() + timeout
        while reactor.seconds() < deadline:
            if self.role(port) == role:
                return
            await deferLater(reactor, 0.05, lambda: None)
        raise RuntimeError(f"{port} is not a {role}: " + self.describe())

    def describe(self) -> str:
        out = []
        for port in [self.masterPort, self.replicaPort]:
            out.append(f"{port}: {self.role(port)}")
        out.append(f"sentinels say {self.currentMaster()}")
        return ", ".join(out)
