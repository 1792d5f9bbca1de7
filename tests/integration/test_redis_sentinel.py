"""
Redis high availability with Sentinel (issue 23; config.md
C{state.redis_sentinels}, C{state.redis_master_name}; behaviour.md R34,
R35, R101).

Two relay processes find the master through three Sentinels
(L{tests.integration.sentinel_group}: one master, one replica, all real
C{redis-server} processes on loopback) and serve a running load of
streaming HTTP turns and WebSocket turns. Twice the master goes away under
that load:

  1. C{SENTINEL FAILOVER}: the master is I{demoted} while it runs and the
     replica promoted -- relay must stop writing to it (C{READONLY} drops
     the connections; new ones check C{ROLE}) and move to the new master;
  2. the new master is killed (C{SIGKILL}) and the old one, meanwhile a
     replica again, is promoted.

Each time the test measures the seconds from the event until turns
succeed again and how many turns failed, and prints the table. It checks:
every failed turn failed as R35/R32 say (HTTP 503 service error, WebSocket
close 1011 "failed to acquire ... concurrency slot" or 1013), never 502
C{upstream_error}; both relays recover on their own and are ready again;
afterwards no slot or wait ticket is left on the final master (the R34
liveness rules hold there: both processes' heartbeats are in
C{relay:processes}); the OAuth account's token record, refreshed and
saved (with C{WAIT} for the replica) before the failovers, is on the final
master and no refresh token was reused; no log has a traceback.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.task import deferLater

from relay.emulator import Emulator
from tests.integration.oauthstack import emulatorConfig, oauthStats
from tests.integration.redis_server import requireRedis
from tests.integration.relayproc import RelayProcess
from tests.integration.sentinel_group import MASTER_NAME, SentinelGroup
from tests.integration.test_ws_turns import _Client, userTurn

KEY = "sk-relay-sentinel"
HTTP_LOOPS_PER_RELAY = 2
WS_LOOPS_PER_RELAY = 1
SERVICE_MESSAGE = b"Service temporarily unavailable, please retry later"


def _config(path, port, emulator, group: SentinelGroup) -> None:
    accounts = [
        {"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
         "api_key": "sk-sent-a1", "concurrency": 8},
        {"id": "o1", "type": "oauth", "base_url": emulator.baseURL("oauth"),
         "access_token": emulator.mintAccessToken("o1", 6), "refresh_token": "rt-o1-0",
         "auth_base_url": emulator.baseURL("root"), "chatgpt_account_id": "acct-o1",
         "concurrency": 8},
    ]
    keys = [{"name": "sentinel", "key": KEY, "concurrency": 16}]
    state = {
        "backend": "redis", "redis_url": "redis://127.0.0.1/0",
        "redis_sentinels": group.addresses, "redis_master_name": MASTER_NAME,
    }
    text = (
        f'listen: "tcp:{port}:interface=127.0.0.1"\n'
        "admin_key: admin-sentinel-0123456789\n"
        f"keys: {json.dumps(keys)}\n"
        f"accounts: {json.dumps(accounts)}\n"
        "gateway: {websocket: {mode_default: ctx_pool}, oauth: {refresh_margin_seconds: 4},"
        " scheduling: {fallback_wait_timeout: 10, sticky_session_wait_timeout: 10}}\n"
        f"state: {json.dumps(state)}\n"
    )
    with open(path, "w") as f:
        f.write(text)


class Load:
    """
    A running load: each loop sends turns back to back and records
    C{(started, ended, ok, detail)}.
    """

    def __init__(self, relays):
        self.relays = relays
        self.turns = []
        self.running = True
        self._loops = []

    def start(self) -> None:
        for relay in self.relays:
            for i in range(HTTP_LOOPS_PER_RELAY):
                self._loops.append(Deferred.fromCoroutine(self._http(relay, i)))
            for i in range(WS_LOOPS_PER_RELAY):
                self._loops.append(Deferred.fromCoroutine(self._ws(relay, i)))

    async def stop(self) -> None:
        self.running = False
        await gatherResults(self._loops)

    def _record(self, started, ok, detail) -> None:
        self.turns.append((started, reactor.seconds(), ok, detail))

    async def _http(self, relay, n) -> None:
        i = 0
        while self.running:
            i += 1
            started = reactor.seconds()
            body = {"model": "gpt-5.5", "input": f"http {n} {i}", "stream": True}
            try:
                r = await treq.post(
                    relay.url + "/v1/responses", json.dumps(body).encode(),
                    headers={"Authorization": [f"Bearer {KEY}"],
                             "Content-Type": ["application/json"],
                             "session_id": [f"s-{relay.port}-{n}"]},
                    persistent=False,
                ).addTimeout(20, reactor)
                data = await r.content()
                ok = r.code == 200 and b"event: response.completed" in data
                self._record(started, ok, ("http", r.code, data[:300]))
            except Exception as e:  # noqa: BLE001 - recorded, judged by the test
                self._record(started, False, ("http", "exception", repr(e)))
            if not self.turns[-1][2]:
                await deferLater(reactor, 0.1, lambda: None)

    async def _ws(self, relay, n) -> None:
        proto = None
        i = 0
        while self.running:
            i += 1
            started = reactor.seconds()
            try:
                if proto is None or proto.closeInfo is not None:
                    proto = await _connect(relay)
                events = await proto.turn(userTurn(f"ws {n} {i}"), timeout=20)
                types = [e["type"] for e in events]
                ok = "response.completed" in types
                self._record(started, ok, ("ws", types[-1], proto.closeInfo))
            except Exception as e:  # noqa: BLE001 - recorded, judged by the test
                self._record(started, False, ("ws", "exception", repr(e)))
                proto = None
            if not self.turns[-1][2]:
                await deferLater(reactor, 0.1, lambda: None)
        if proto is not None:
            proto.bye()

    def window(self, since: float):
        """
        @return: C{(seconds until the first success of a turn started
            after C{since}, failed turns ending after C{since})}.
        """
        after = [t for t in self.turns if t[0] >= since and t[2]]
        recovered = min(t[1] for t in after) - since if after else None
        failed = [t for t in self.turns if t[1] >= since and not t[2]]
        return recovered, failed


async def _connect(relay) -> _Client:
    factory = WebSocketClientFactory(
        f"ws://127.0.0.1:{relay.port}/v1/responses",
        headers={"Authorization": f"Bearer {KEY}"}, reactor=reactor,
    )
    factory.protocol = _Client
    proto = await TCP4ClientEndpoint(reactor, "127.0.0.1", relay.port, timeout=5).connect(factory)
    await proto.opened.addTimeout(10, reactor)
    return proto


def _assertFailedAsR35(failed) -> None:
    """
    Every failure is R32's service error (or a WebSocket close R32 allows),
    never an upstream error.
    """
    for started, ended, ok, detail in failed:
        if detail[0] == "http":
            assert detail[1] == 503 and SERVICE_MESSAGE in detail[2], detail
            assert b"upstream_error" not in detail[2], detail
        else:
            close = detail[2]
            assert close is not None and close[0] in (1011, 1013), detail
            if close[0] == 1011:
                assert "concurrency slot" in close[1], detail


async def _waitSuccesses(load: Load, since: float, count: int, timeout: float) -> None:
    deadline = reactor.seconds() + timeout
    while reactor.seconds() < deadline:
        if sum(1 for t in load.turns if t[0] >= since and t[2]) >= count:
            return
        await deferLater(reactor, 0.1, lambda: None)
    raise AssertionError(f"turns did not succeed again within {timeout}s")


async def _ready(relay) -> bool:
    r = await treq.get(relay.url + "/readyz", persistent=False)
    await r.content()
    return r.code == 200


def _leftovers(group: SentinelGroup, port: int) -> list:
    out = []
    for pattern in ("concurrency:*", "wait:*"):
        cursor = "0"
        while True:
            cursor, keys = group.command(port, "SCAN", cursor, "MATCH", pattern, "COUNT", "1000")
            for key in keys:
                if group.command(port, "TYPE", key) == "zset":
                    n = group.command(port, "ZCARD", key)
                    if n:
                        out.append((key, n))
            if cursor == "0":
                break
    return out


@pytest_twisted.ensureDeferred
async def test_sentinel_failover_under_load():
    """
    See the module docstring.
    """
    requireRedis()
    group = SentinelGroup()
    group.start()
    emulator = Emulator(
        reactor=reactor,
        config=dict(emulatorConfig(("o1",), ttl=600, apikeys=("sk-sent-a1",)),
                    default_script={"text": "failover load", "delay": 0.03, "deltas": 5}),
    )
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-sentinel-test-")
    relays = []
    load = None
    rows = []
    try:
        for i in range(2):
            relay = RelayProcess(config=os.path.join(tmp, f"relay{i}.yaml"),
                                 log=os.path.join(tmp, f"relay{i}.log"))
            _config(relay.config, relay.port, emulator, group)
            relay.start()
            relays.append(relay)
        for relay in relays:
            await relay.waitHealthy()
        for relay in relays:
            deadline = reactor.seconds() + 10
            while not await _ready(relay):
                assert reactor.seconds() < deadline, relay.tail()
                await deferLater(reactor, 0.1, lambda: None)
        # The OAuth account's token (6 s) is refreshed ~2 s after start
        # (margin 4 s) and saved with WAIT for the replica.
        deadline = reactor.seconds() + 15
        while oauthStats(emulator, "o1")["refreshes"] < 1:
            assert reactor.seconds() < deadline, relays[0].tail()
            await deferLater(reactor, 0.2, lambda: None)
        await deferLater(reactor, 0.5, lambda: None)
        first = group.currentMaster()
        record = group.command(first, "HGET", "relay:oauth:o1", "record")
        assert record, "token record not saved"

        load = Load(relays)
        load.start()
        await _waitSuccesses(load, reactor.seconds(), 10, 20)

        # 1. The master is demoted while it runs.
        at = reactor.seconds()
        old = group.manualFailover()
        second = await group.waitMaster(notPort=old)
        await _waitSuccesses(load, at, 10, 30)
        await deferLater(reactor, 1.0, lambda: None)
        recovered, failed = load.window(at)
        rows.append(("master demoted (SENTINEL FAILOVER)", recovered, len(failed)))
        _assertFailedAsR35(failed)
        # relay left the old master when the Sentinels switched: once it was
        # demoted it never got a write (no READONLY refusal there).
        await group.waitRole(old, "slave")
        assert "errorstat_READONLY" not in group.command(old, "INFO", "errorstats")

        # 2. The (new) master is killed.
        at = reactor.seconds()
        killed = group.killMaster()
        assert killed == second
        third = await group.waitMaster(notPort=killed)
        await _waitSuccesses(load, at, 10, 30)
        await deferLater(reactor, 1.0, lambda: None)
        recovered, failed = load.window(at)
        rows.append(("master killed (SIGKILL)", recovered, len(failed)))
        _assertFailedAsR35(failed)

        await load.stop()
        sent = len(load.turns)
        for relay in relays:
            assert await _ready(relay), relay.tail()

        # No slot or wait ticket left on the final master (the released
        # and in-doubt members included), once the last releases landed.
        deadline = reactor.seconds() + 10
        while (left := _leftovers(group, third)) and reactor.seconds() < deadline:
            await deferLater(reactor, 0.2, lambda: None)
        rows = [row + (len(left),) for row in rows]
        assert left == [], left
        processes = group.command(third, "ZRANGE", "relay:processes", "0", "-1")
        assert len(processes) == 2, processes
        # The token record survived both failovers; no refresh token reused.
        assert group.command(third, "HGET", "relay:oauth:o1", "record")
        stats = oauthStats(emulator, "o1")
        assert stats["reuse_attempts"] == 0, stats
        for relay in relays:
            log = relay.tail(10**7)
            assert "Traceback" not in log, log[-3000:]
            assert "upstream_error" not in log
        print()
        if os.environ.get("RELAY_SENTINEL_TIMELINE"):
            base = load.turns[0][0]
            for t in sorted(load.turns):
                print(f"{t[0]-base:7.2f} {t[1]-base:7.2f} {t[2]} {str(t[3])[:100]}")
        print(f"Sentinel failover under load: 2 relays, {sent} turns sent "
              f"({HTTP_LOOPS_PER_RELAY * 2} SSE loops, {WS_LOOPS_PER_RELAY * 2} WebSocket loops)")
        print(f"{'event':38} {'seconds to recovery':>20} {'turns failed':>13} {'slots leaked':>13}")
        for event, seconds, failures, leaked in rows:
            print(f"{event:38} {seconds:20.2f} {failures:13d} {leaked:13d}")
    finally:
        if load is not None and load.running:
            await load.stop()
        for relay in relays:
            await relay.shutdown()
        await emulator.stop()
        group.stop()
