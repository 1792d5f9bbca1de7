"""
Every form of C{state.redis_url} the configuration accepts is honoured by
the client (issue 23): C{unix://} (a unix socket, with a password and a
database) and C{rediss://} (TLS: the server's certificate verified, a client
certificate presented when given), each against a real C{redis-server}
(Debian's is built with TLS). Before, the configuration accepted both
schemes and L{relay.wire.redisclient.parseRedisUrl} refused them at start-up.

The TLS server requires client certificates (C{tls-auth-clients yes}, as
Redis does by default): with the right CA and certificate relay reads and
writes; without the client certificate, or trusting the system's CAs
instead of the test CA, it never reaches Redis. A relay process with a
C{rediss://} URL serves a turn and is ready.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest
import pytest_twisted
import treq
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet import reactor
from twisted.internet.task import deferLater

from relay.emulator import Emulator
from relay.wire.redisclient import RedisService, RedisUnavailable
from tests.integration.redis_server import REDIS_SERVER, freePort, requireRedis
from tests.integration.relayproc import RelayProcess, writeConfig
from tests.integration.test_workers import _account, _post
from tests.integration.tlsca import _keyPEM, makeCA, makeLeaf

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def _clientLeaf(caKey, caCert):
    """
    A client certificate (C{clientAuth}) signed by the test CA.
    """
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(caCert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        .sign(caKey, hashes.SHA256())
    )
    return key, cert


class _Server:
    """
    A C{redis-server} with extra arguments, in its own directory.
    """

    def __init__(self, *args: str):
        self.dir = tempfile.mkdtemp(prefix="relay-redis-url-")
        self.args = args
        self.process = None

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def write(self, name: str, data: bytes) -> str:
        with open(self.path(name), "wb") as f:
            f.write(data)
        return self.path(name)

    def start(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--save", "", "--appendonly", "no", "--dir", self.dir,
             "--loglevel", "warning", *self.args, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def cli(self, *args: str) -> str:
        result = subprocess.run([REDIS_CLI, *args], check=False, capture_output=True,
                                text=True, timeout=10)
        return result.stdout.strip()

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


async def _reachable(service: RedisService, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.reachable:
            return True
        await deferLater(reactor, 0.05, lambda: None)
    return False


async def _roundTrip(url: str, key: str) -> RedisService:
    """
    Start a L{RedisService} on C{url}, write C{key}, read it back.
    """
    service = RedisService(url=url, clock=reactor)
    service.startService()
    try:
        assert await _reachable(service, 10), f"redis never reachable on {url.split('@')[-1]}"
        await service.execute(2, "set", key, "written-by-relay")
        assert await service.execute(2, "get", key) == "written-by-relay"
    finally:
        await service.stopService()
    return service


@pytest_twisted.ensureDeferred
async def test_unix_socket_with_password_and_database():
    """
    C{unix://:password@/path/redis.sock?db=3}: the socket, the password and
    the database are used (the key lands in database 3).
    """
    requireRedis()
    server = _Server()
    socketPath = server.path("redis.sock")
    server.start("--port", "0", "--unixsocket", socketPath, "--unixsocketperm", "700",
                 "--requirepass", "sock-secret")
    try:
        await _roundTrip(f"unix://:sock-secret@{socketPath}?db=3", "relay-url-unix")
        got = server.cli("-s", socketPath, "--no-auth-warning", "-a", "sock-secret", "-n", "3",
                         "GET", "relay-url-unix")
        assert got == "written-by-relay", got
    finally:
        server.cleanup()


@pytest.fixture
def tlsServer():
    """
    A TLS-only C{redis-server} on loopback requiring client certificates;
    yields C{(server, port, {file name: path})}.
    """
    requireRedis()
    caKey, caCert = makeCA()
    serverKey, serverCert = makeLeaf(caKey, caCert, ("localhost",))
    clientKey, clientCert = _clientLeaf(caKey, caCert)
    server = _Server()
    pem = serialization.Encoding.PEM
    files = {
        "ca": server.write("ca.pem", caCert.public_bytes(pem)),
        "server.pem": server.write("server.pem", serverCert.public_bytes(pem)),
        "server.key": server.write("server.key", _keyPEM(serverKey)),
        "client.pem": server.write("client.pem", clientCert.public_bytes(pem)),
        "client.key": server.write("client.key", _keyPEM(clientKey)),
    }
    port = freePort()
    server.start("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                 "--tls-cert-file", files["server.pem"], "--tls-key-file", files["server.key"],
                 "--tls-ca-cert-file", files["ca"], "--tls-auth-clients", "yes")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if _tlsCli(server, port, files, "PING") == "PONG":
            break
        time.sleep(0.05)
    try:
        yield server, port, files
    finally:
        server.cleanup()


def _tlsCli(server: _Server, port: int, files: dict, *args: str) -> str:
    return server.cli("--tls", "-h", "localhost", "-p", str(port), "--cacert", files["ca"],
                      "--cert", files["client.pem"], "--key", files["client.key"], *args)


@pytest_twisted.ensureDeferred
async def test_tls_verified_with_client_certificate(tlsServer):
    """
    C{rediss://localhost:PORT/2?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...}
    reads and writes over TLS (the key lands in database 2); without the
    client certificate, or without the test CA (the system's trust store
    does not know it), relay never reaches Redis and commands fail with
    L{RedisUnavailable}.
    """
    server, port, files = tlsServer
    full = (f"rediss://localhost:{port}/2?ssl_ca_certs={files['ca']}"
            f"&ssl_certfile={files['client.pem']}&ssl_keyfile={files['client.key']}")
    await _roundTrip(full, "relay-url-tls")
    assert _tlsCli(server, port, files, "-n", "2", "GET", "relay-url-tls") == "written-by-relay"

    withoutCA = (f"rediss://localhost:{port}/0?ssl_certfile={files['client.pem']}"
                 f"&ssl_keyfile={files['client.key']}")
    for url in (f"rediss://localhost:{port}/0?ssl_ca_certs={files['ca']}", withoutCA):
        service = RedisService(url=url, clock=reactor)
        service.startService()
        try:
            assert not await _reachable(service, 1.5), url
            with pytest.raises(RedisUnavailable):
                await service.execute(1, "get", "relay-url-tls")
        finally:
            await service.stopService()


@pytest_twisted.ensureDeferred
async def test_relay_on_rediss(tlsServer):
    """
    A relay process configured with a C{rediss://} URL is ready
    (C{/readyz}: Redis reachable) and serves a turn, its state in Redis.
    """
    server, port, files = tlsServer
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-rediss-")
    relay = RelayProcess(config=os.path.join(tmp, "relay.yaml"), log=os.path.join(tmp, "relay.log"))
    url = (f"rediss://localhost:{port}/0?ssl_ca_certs={files['ca']}"
           f"&ssl_certfile={files['client.pem']}&ssl_keyfile={files['client.key']}")
    writeConfig(relay.config, relay.port, [_account(emulator, "a1")],
                extra=f"state: {{backend: redis, redis_url: '{url}'}}\n")
    try:
        relay.start()
        await relay.waitHealthy()
        deadline = time.monotonic() + 10
        code = None
        while time.monotonic() < deadline:
            r = await treq.get(relay.url + "/readyz", persistent=False)
            code, body = r.code, await r.content()
            if code == 200:
                break
            await deferLater(reactor, 0.1, lambda: None)
        assert code == 200, (body, relay.tail())
        from twisted.internet.threads import deferToThread

        status, data = await deferToThread(_post, relay.port)
        assert status == 200, data
        assert json.loads(data.partition(b"\r\n\r\n")[2])["status"] == "completed"
        assert int(_tlsCli(server, port, files, "DBSIZE")) > 0
    finally:
        relay.stop()
        await emulator.stop()
        shutil.rmtree(tmp, ignore_errors=True)
