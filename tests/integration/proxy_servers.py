"""
Real egress proxies for integration tests: Debian's C{microsocks} (SOCKS5,
optionally with RFC 1929 credentials) and C{tinyproxy} (HTTP C{CONNECT}
with C{BasicAuth}), each started on a free loopback port and killed at
teardown.

Command lines::

    microsocks -i 127.0.0.1 -p PORT [-u USER -P PASS]
    tinyproxy -d -c CONFIG

The tinyproxy configuration has no C{ConnectPort} line, which (tinyproxy
1.11) allows C{CONNECT} to every port; the packaged default config limits
it to 443 and 563.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Optional

from attrs import define, field

MICROSOCKS = "/usr/bin/microsocks"
TINYPROXY = "/usr/bin/tinyproxy"

STARTUP_TIMEOUT = 10.0
"""Seconds to wait for a proxy to accept connections."""


def freePort() -> int:
    """
    @return: a TCP port on 127.0.0.1 that was free a moment ago.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _waitForPort(port: int, process: subprocess.Popen, timeout: float) -> bool:
    """
    Poll until C{127.0.0.1:port} accepts a connection.

    @param port: the port.
    @param process: the server; polling stops when it exits.
    @param timeout: seconds to wait at most.
    @return: whether the port is accepting.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


@define(eq=False)
class ProxyServer:
    """
    One running proxy process.

    @ivar scheme: C{socks5h} or C{http}, for a L{relay.base.records.ProxySpec}.
    @ivar port: its loopback port.
    @ivar username: the accepted user name, or L{None}.
    @ivar password: the accepted password, or L{None}.
    @ivar process: the child process.
    @ivar workdir: a temporary directory to remove at stop, or L{None}.
    """

    scheme: str
    port: int
    username: Optional[str]
    password: Optional[str]
    process: subprocess.Popen
    workdir: Optional[str] = None
    _stopped: bool = field(default=False)

    def spec(self, id: str = "test-proxy", username=None, password=None, scheme=None):
        """
        @param id: the proxy id.
        @param username: override the user name (L{None}: the server's).
        @param password: override the password (L{None}: the server's).
        @param scheme: override the scheme (e.g. C{socks5}).
        @return: a L{relay.base.records.ProxySpec} for this server.
        """
        from relay.base.records import ProxySpec

        return ProxySpec(
            id=id,
            scheme=scheme or self.scheme,
            host="127.0.0.1",
            port=self.port,
            username=username if username is not None else self.username,
            password=password if password is not None else self.password,
        )

    def stop(self) -> None:
        """
        Kill the process (this one only, by its handle) and remove its
        files. Idempotent.
        """
        if self._stopped:
            return
        self._stopped = True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _start(argv_for_port, scheme, username, password, workdir=None, attempts=3) -> ProxyServer:
    """
    Start a server on a free port, retrying when the port was taken.

    @param argv_for_port: a callable from a port to the argv.
    @return: the running L{ProxyServer}.
    @raise RuntimeError: it never came up.
    """
    last = ""
    for _ in range(attempts):
        port = freePort()
        process = subprocess.Popen(
            argv_for_port(port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if _waitForPort(port, process, STARTUP_TIMEOUT):
            return ProxyServer(scheme, port, username, password, process, workdir)
        if process.poll() is None:
            process.kill()
        process.wait(5)
        last = f"{argv_for_port(port)[0]} exited with {process.returncode}"
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
    raise RuntimeError(f"proxy did not start: {last}")


def startMicrosocks(username: Optional[str] = None, password: Optional[str] = None) -> ProxyServer:
    """
    Start C{microsocks} on 127.0.0.1.

    @param username: require this user name (with C{password}), or L{None}
        for no authentication.
    @param password: the password.
    @return: the running server; call L{ProxyServer.stop}.
    """

    def argv(port):
        args = [MICROSOCKS, "-i", "127.0.0.1", "-p", str(port)]
        if username is not None:
            args += ["-u", username, "-P", password or ""]
        return args

    return _start(argv, "socks5h", username, password)


def startTinyproxy(username: str = "user", password: str = "pass") -> ProxyServer:
    """
    Start C{tinyproxy} on 127.0.0.1 with C{BasicAuth}.

    @param username: the accepted user name.
    @param password: the accepted password.
    @return: the running server; call L{ProxyServer.stop}.
    """
    workdir = tempfile.mkdtemp(prefix="relay-tinyproxy-")
    config = os.path.join(workdir, "tinyproxy.conf")

    def argv(port):
        with open(config, "w") as f:
            f.write(
                f"Port {port}\n"
                "Listen 127.0.0.1\n"
                "Timeout 30\n"
                "MaxClients 50\n"
                "Allow 127.0.0.1\n"
                f"BasicAuth {username} {password}\n"
                "LogLevel Warning\n"
                f'PidFile "{workdir}/tinyproxy.pid"\n'
            )
        return [TINYPROXY, "-d", "-c", config]

    return _start(argv, "http", username, password, workdir)
