"""
Egress proxies through the real relay (issue 8): real C{microsocks} and
C{tinyproxy} processes on loopback, the real relay and HTTP dialer, the
bundled emulator. Covers the happy path through each proxy (the emulator's
peer socket belongs to the proxy process), wrong proxy credentials and a
dead proxy (persistent: switch and 10-minute cooldown), a proxy that
accepts and drops (transient: the R-B1 breaker opens after 3), TLS through
the tunnel with a test CA (hostname verified; a mismatch is a transient TLS
failure and switches), and the proxy quarantine after mid-stream cuts.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import pytest
import pytest_twisted
from attrs import define
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import globalLogPublisher

from relay.process.app import buildApplication
from relay.configuration.parse import settingsFromString
from relay.emulator import Emulator
from tests.integration.harness import RELAY_KEY, Stack, accountsYAML, sseEvents
from tests.integration.proxy_servers import startMicrosocks, startTinyproxy
from tests.integration.tlsca import TestCA

pytestmark = pytest.mark.skipif(
    not (os.path.exists("/usr/bin/microsocks") and os.path.exists("/usr/bin/tinyproxy")),
    reason="microsocks and tinyproxy are not installed",
)

STREAM = {"model": "gpt-5.5", "input": "hi", "stream": True}


def fresh(n) -> dict:
    """
    A streaming body with its own input, so no sticky session (R37) ties
    it to the account an earlier turn used.
    """
    return dict(STREAM, input=f"hi, turn {n}")

PROXIES = {
    "microsocks": lambda: startMicrosocks(),
    "microsocks-auth": lambda: startMicrosocks("relayuser", "relaypass"),
    "tinyproxy": lambda: startTinyproxy("relayuser", "relaypass"),
}


def proxyURL(server, password=None) -> str:
    """
    The account C{proxy:} URL for a running L{ProxyServer}.

    @param password: override the password (a wrong one).
    """
    auth = ""
    if server.username is not None:
        auth = f"{server.username}:{password or server.password}@"
    return f"{server.scheme}://{auth}127.0.0.1:{server.port}"


# ---------------------------------------------------------------------------
# Which process owns the emulator's peer socket
# ---------------------------------------------------------------------------


def _socketInodes(localPort: int, remotePort: Optional[int] = None) -> set:
    """
    Inodes of IPv4 TCP sockets bound to C{127.0.0.1:localPort}.
    """
    want = f"0100007F:{localPort:04X}"
    wantRemote = None if remotePort is None else f"0100007F:{remotePort:04X}"
    inodes = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[1] == want and (wantRemote is None or fields[2] == wantRemote):
                inodes.add(fields[9])
    return inodes


def socketOwners(localPort: int, remotePort: Optional[int] = None) -> set:
    """
    PIDs holding a TCP socket whose local end is C{127.0.0.1:localPort}
    (and, when given, whose remote end is C{127.0.0.1:remotePort}: Linux
    reuses an ephemeral local port for sockets to different destinations,
    so the local port alone can match another process's socket).
    """
    inodes = _socketInodes(localPort, remotePort)
    owners = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    owners.add(int(pid))
        except OSError:
            continue
    return owners


def recordPeers(emulator: Emulator, port) -> list:
    """
    Record, for every connection accepted on C{port} (serving the
    emulator's site), the set of PIDs owning the client end, looked up at
    accept time.

    @return: the list the records are appended to.
    """
    seen = []
    factory = port.factory
    original = factory.buildProtocol

    listening = port.getHost().port

    def buildProtocol(addr):
        seen.append(socketOwners(addr.port, listening))
        return original(addr)

    factory.buildProtocol = buildProtocol
    return seen


# ---------------------------------------------------------------------------
# The stack
# ---------------------------------------------------------------------------


@define(eq=False)
class ProxiedStack(Stack):
    """
    A L{Stack} whose emulator may also listen with TLS.

    @ivar tlsPort: the emulator's TLS port, or L{None}.
    """

    tlsPort: int = None


async def startProxiedStack(accounts, gateway="{}", tls: TestCA = None, extra="") -> Stack:
    """
    Like L{tests.integration.harness.startStack}, but the emulator also
    listens with TLS when C{tls} is given (its port is C{stack.tlsPort}),
    and relay trusts the test CA. Account C{base_url}s may contain
    C{{tls_port}} and C{{port}}.
    """
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    stack = ProxiedStack(emulator=emulator)
    trustRoot = None
    if tls is not None:
        tlsListening = await tls.listen(reactor, emulator.site)
        stack.extraPorts.append(tlsListening)
        stack.tlsPort = tlsListening.getHost().port
        trustRoot = tls.trustRoot()
    rendered = []
    for a in accounts:
        a = dict(a)
        if "base_url" in a:
            a["base_url"] = a["base_url"].format(tls_port=stack.tlsPort, port=emulator.port)
        rendered.append(a)
    keys = json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": 0}])
    text = (
        'listen: "tcp:0:interface=127.0.0.1"\n'
        'database: ":memory:"\n'
        f"keys: {keys}\n"
        f"accounts: {accountsYAML(emulator, rendered)}\n"
        f"gateway: {gateway}\n"
        f"{extra}"
    )
    config = settingsFromString(text)
    stack.app = buildApplication(config, reactor, trustRoot=trustRoot)
    stack.port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(stack.app.site)
    return stack


class DropAtOnce(Protocol):
    """
    A "proxy" that accepts TCP and closes at once (transient failure).
    """

    def connectionMade(self):
        self.transport.loseConnection()


@pytest.fixture
def logs():
    """
    Every log event emitted during the test.
    """
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


def named(events, name) -> list:
    return [e for e in events if e.get("event") == name]


def assertNoSecrets(events, *secrets) -> None:
    for e in events:
        text = repr({k: v for k, v in e.items() if k not in ("log_logger", "log_source")})
        for secret in secrets:
            assert secret not in text, (secret, e.get("event"))


async def blockedUntil(stack, accountId):
    states = await stack.app.store.getAccountStates([accountId])
    state = states.get(accountId)
    return (state.blockedUntil or None) if state is not None else None


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(PROXIES))
@pytest_twisted.ensureDeferred
async def test_stream_through_proxy(kind, logs):
    """
    A streaming C{/v1/responses} through each proxy completes, and the
    socket the emulator accepted belongs to the proxy process (so the
    request really went through it). With the proxy stopped the same
    account fails (refused: persistent).
    """
    proxy = PROXIES[kind]()
    stack = None
    try:
        stack = await startProxiedStack(
            [{"id": "p1", "credential": "sk-p1", "proxy": proxyURL(proxy)}]
        )
        peers = recordPeers(stack.emulator, stack.emulator.listeningPort)
        response, data = await stack.postJSON("/v1/responses", STREAM)
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        assert len(stack.emulator.requestsFor("sk-p1")) == 1
        assert peers and all(owners == {proxy.process.pid} for owners in peers), peers
        if proxy.password:
            assertNoSecrets(logs, proxy.password)
    finally:
        if stack is not None:
            await stack.stop()
        proxy.stop()


@pytest.mark.parametrize("kind", ["microsocks-auth", "tinyproxy"])
@pytest_twisted.ensureDeferred
async def test_wrong_proxy_password_switches_and_cools(kind, logs):
    """
    R3/R4: wrong proxy credentials are a persistent failure: the turn
    switches to the other account, the proxied account is cooled for 10
    minutes, and the failover log names the proxy by id, host and port,
    never its password.
    """
    proxy = PROXIES[kind]()
    stack = None
    try:
        stack = await startProxiedStack(
            [
                {
                    "id": "p1", "credential": "sk-p1", "priority": 1,
                    "proxy": proxyURL(proxy, password="wrong-secret"),
                },
                {"id": "d1", "credential": "sk-d1", "priority": 50},
            ]
        )
        now = reactor.seconds()
        response, data = await stack.postJSON("/v1/responses", STREAM)
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        assert stack.emulator.requestsFor("sk-p1") == []
        assert len(stack.emulator.requestsFor("sk-d1")) == 1
        until = await blockedUntil(stack, "p1")
        assert until is not None and now + 590 <= until <= reactor.seconds() + 601
        [switch] = named(logs, "openai.upstream_failover_switching")
        assert switch["account_id"] == "p1"
        assert switch["proxy_id"] == "acct-p1"
        assert (switch["proxy_host"], switch["proxy_port"]) == ("127.0.0.1", proxy.port)
        assertNoSecrets(logs, "wrong-secret", proxy.password)
    finally:
        if stack is not None:
            await stack.stop()
        proxy.stop()


@pytest_twisted.ensureDeferred
async def test_proxy_killed_switches_and_cools(logs):
    """
    R3/R4/R-B12: the account's proxy works, then is killed: the next turn
    fails over (connection refused: persistent) to the direct account and
    the proxied account is cooled for 10 minutes.
    """
    proxy = startMicrosocks("relayuser", "relaypass")
    stack = None
    try:
        stack = await startProxiedStack(
            [
                {"id": "p1", "credential": "sk-p1", "priority": 1, "proxy": proxyURL(proxy)},
                {"id": "d1", "credential": "sk-d1", "priority": 50},
            ]
        )
        response, data = await stack.postJSON("/v1/responses", STREAM)
        assert response.code == 200, data
        assert len(stack.emulator.requestsFor("sk-p1")) == 1
        proxy.stop()
        await stack.app.dialer.close()  # no pooled tunnel survives the proxy
        now = reactor.seconds()
        response, data = await stack.postJSON("/v1/responses", STREAM)
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        assert len(stack.emulator.requestsFor("sk-p1")) == 1
        assert len(stack.emulator.requestsFor("sk-d1")) == 1
        until = await blockedUntil(stack, "p1")
        assert until is not None and until >= now + 590
        assert named(logs, "openai.upstream_failover_switching")[0]["proxy_port"] == proxy.port
    finally:
        if stack is not None:
            await stack.stop()
        proxy.stop()


@pytest_twisted.ensureDeferred
async def test_transient_proxy_failures_open_breaker(logs):
    """
    R3/R-B1: a "proxy" that accepts TCP and drops it is a transient
    failure: each turn switches to the direct account without a cooldown,
    and the third failure within 60 s opens the breaker on the proxied
    account (2 minutes).
    """
    dropper = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
        Factory.forProtocol(DropAtOnce)
    )
    port = dropper.getHost().port
    stack = None
    try:
        stack = await startProxiedStack(
            [
                {"id": "p1", "credential": "sk-p1", "priority": 1,
                 "proxy": f"socks5h://127.0.0.1:{port}"},
                {"id": "d1", "credential": "sk-d1", "priority": 50},
            ]
        )
        for n in range(1, 4):
            response, data = await stack.postJSON("/v1/responses", fresh(n))
            assert response.code == 200, data
            assert sseEvents(data)[-1][0] == "response.completed"
            assert len(stack.emulator.requestsFor("sk-d1")) == n
            if n < 3:
                assert await blockedUntil(stack, "p1") is None
                assert named(logs, "openai.account_transport_circuit_open") == []
        [opened] = named(logs, "openai.account_transport_circuit_open")
        assert opened["account_id"] == "p1"
        assert opened["proxy_id"] == "acct-p1"
        assert opened["failures"] == 3
        assert stack.app.health.localBlock("p1") is not None
        # The open breaker keeps the next turn off p1 entirely.
        switches = len(named(logs, "openai.upstream_failover_switching"))
        response, data = await stack.postJSON("/v1/responses", fresh(4))
        assert response.code == 200
        assert len(named(logs, "openai.upstream_failover_switching")) == switches
    finally:
        if stack is not None:
            await stack.stop()
        await dropper.stopListening()


@pytest.mark.parametrize("kind", sorted(PROXIES))
@pytest_twisted.ensureDeferred
async def test_tls_through_tunnel(kind, logs):
    """
    HTTPS to a TLS emulator through each proxy, with the test CA as relay's
    trust root: C{https://localhost:<port>/v1} verifies and completes. The
    same server as C{https://127.0.0.1:<port>/v1} fails verification (the
    certificate names only C{localhost}): a transient TLS failure, so the
    turn switches to the other account and no cooldown is written.
    """
    proxy = PROXIES[kind]()
    ca = TestCA.create(("localhost",))
    stack = None
    try:
        url = proxyURL(proxy)
        stack = await startProxiedStack(
            [
                {"id": "good", "credential": "sk-good", "priority": 1, "proxy": url,
                 "base_url": "https://localhost:{tls_port}/v1"},
            ],
            tls=ca,
        )
        response, data = await stack.postJSON("/v1/responses", STREAM)
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        assert len(stack.emulator.requestsFor("sk-good")) == 1
        await stack.stop()
        stack = await startProxiedStack(
            [
                {"id": "badname", "credential": "sk-bad", "priority": 1, "proxy": url,
                 "base_url": "https://127.0.0.1:{tls_port}/v1"},
                {"id": "good", "credential": "sk-good", "priority": 50, "proxy": url,
                 "base_url": "https://localhost:{tls_port}/v1"},
            ],
            tls=ca,
        )
        response, data = await stack.postJSON("/v1/responses", STREAM)
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        assert stack.emulator.requestsFor("sk-bad") == []
        assert len(stack.emulator.requestsFor("sk-good")) == 1
        failed = [e for e in named(logs, "openai.ops_event") if e["account_id"] == "badname"]
        assert failed and failed[0]["kind"] == "request_error"
        assert await blockedUntil(stack, "badname") is None  # transient: no cooldown
        [switch] = named(logs, "openai.upstream_failover_switching")
        assert switch["account_id"] == "badname"
    finally:
        if stack is not None:
            await stack.stop()
        proxy.stop()
        ca.cleanup()


@pytest_twisted.ensureDeferred
async def test_mid_stream_cuts_quarantine_shared_proxy(logs):
    """
    Issue 8 quarantine: two accounts share one proxy (top-level
    C{proxies:}); their streams are cut mid-stream once each, so the proxy
    is quarantined and the next turn goes to the direct account although
    the proxied ones are preferred. The admin snapshot shows it.
    """
    proxy = startMicrosocks()
    stack = None
    try:
        stack = await startProxiedStack(
            [
                {"id": "p1", "credential": "sk-p1", "priority": 1, "proxy_id": "shared"},
                {"id": "p2", "credential": "sk-p2", "priority": 2, "proxy_id": "shared"},
                {"id": "d1", "credential": "sk-d1", "priority": 50},
            ],
            extra=f'proxies: [{{"id": "shared", "url": "{proxyURL(proxy)}"}}]\n',
        )
        cut = {"kind": "cut_after_events", "events": 2, "times": 1}
        stack.emulator.setFault("sk-p1", cut)
        stack.emulator.setFault("sk-p2", cut)
        # p1 is cut before output (fails over), then p2 is cut: 2 cuts.
        response, data = await stack.postJSON("/v1/responses", fresh(1))
        assert response.code == 200, data
        health = stack.app.extras["proxyHealth"]
        assert health.quarantinedUntil("shared") is not None
        assert [e["account_id"] for e in named(logs, "relay.proxy_stream_cut")] == ["p1", "p2"]
        [quarantined] = named(logs, "relay.proxy_quarantined")
        assert quarantined["proxy_id"] == "shared"
        assert (quarantined["proxy_host"], quarantined["proxy_port"]) == ("127.0.0.1", proxy.port)
        assert quarantined["until"] >= reactor.seconds() + 590
        before = len(stack.emulator.requestsFor("sk-d1"))
        response, data = await stack.postJSON("/v1/responses", fresh(3))
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
        assert len(stack.emulator.requestsFor("sk-d1")) == before + 1
        snap = health.snapshot()
        assert snap["shared"]["state"] == "quarantined"
        assert snap["shared"]["port"] == proxy.port
    finally:
        if stack is not None:
            await stack.stop()
        proxy.stop()


@pytest_twisted.ensureDeferred
async def test_cuts_after_output_quarantine(logs):
    """
    Cuts after output also count: two turns on an account behind a proxy
    are cut after their first text reached the client (no failover, the
    client gets the in-stream error), and the proxy is quarantined.
    """
    proxy = startTinyproxy("relayuser", "relaypass")
    stack = None
    try:
        stack = await startProxiedStack(
            [{"id": "p1", "credential": "sk-p1", "proxy": proxyURL(proxy)}]
        )
        stack.emulator.setFault("sk-p1", {"kind": "cut_after_events", "events": 6, "times": 2})
        for n in range(2):
            _response, data = await stack.postJSON("/v1/responses", fresh(n))
            types = [t for t, _ in sseEvents(data)]
            assert "response.output_text.delta" in types
            assert "response.completed" not in types
        cuts = named(logs, "relay.proxy_stream_cut")
        assert [(e["account_id"], e["proxy_id"]) for e in cuts] == [("p1", "acct-p1")] * 2
        [quarantined] = named(logs, "relay.proxy_quarantined")
        assert quarantined["proxy_port"] == proxy.port
        assert stack.app.extras["proxyHealth"].snapshot()["acct-p1"]["state"] == "quarantined"
        assertNoSecrets(logs, proxy.password)
    finally:
        if stack is not None:
            await stack.stop()
        proxy.stop()
