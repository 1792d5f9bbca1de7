"""
Metrics that add up across workers (issue 23): with C{workers: 2}, turns
sent on new connections land on both workers (C{SO_REUSEPORT}), and one
scrape of C{/metrics} -- answered by whichever worker gets it -- reports
the whole group: C{relay_turns_total} equals the turns sent, and so do the
histogram counts. Without the supervisor's multiprocess directory each
scrape reports one worker's share.

The same holds for C{relay_oauth_refresh_failures_total}: forced token
refreshes (C{POST /admin/accounts/o1/refresh}) answered by both workers
against a token endpoint that answers 503, and every scrape reports as many
failures as the emulator's token endpoint saw requests (it used to be a
scrape-time reading of the answering worker's own count).
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import time

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults

from relay.emulator import Emulator
from tests.integration.oauthstack import emulatorConfig, oauthAccount, oauthStats
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.relayproc import ADMIN, RelayProcess
from tests.integration.test_workers import (
    _account,
    _children,
    _listening,
    _servedBy,
    _startWorkers,
    _threaded,
    _until,
    _writeWorkersConfig,
)

TURNS = 24


def _sample(text: str, name: str, **labels) -> float:
    """
    The sum of the samples of C{name} whose labels include C{labels}.
    """
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


@pytest_twisted.ensureDeferred
async def test_one_scrape_counts_every_worker(redisServer):  # noqa: F811
    """
    See the module docstring.
    """
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-metrics-workers-")
    relay = None
    try:
        relay = await _startWorkers(tmp, emulator, redisServer.url, extra="log: {format: json}\n")
        results = await gatherResults(
            [Deferred.fromCoroutine(_threaded(relay.port)) for _ in range(TURNS)])
        assert [code for code, _ in results] == [200] * TURNS, results
        log = relay.tail(10**7)
        served = set()
        for line in log.splitlines():
            if line.startswith("{") and '"relay.turn_finished"' in line:
                served.add(json.loads(line).get("worker"))
        assert served == {0, 1}, "the turns did not reach both workers: " + log[-3000:]
        scrapes = []
        for _ in range(4):  # new connections: several workers answer
            r = await treq.get(relay.url + "/metrics", headers={"Authorization": [f"Bearer {ADMIN}"]},
                               persistent=False)
            assert r.code == 200
            scrapes.append((await r.content()).decode())
        for text in scrapes:
            assert _sample(text, "relay_turns_total", entrypoint="http") == TURNS, text
            assert _sample(text, "relay_turns_total", outcome="completed") == TURNS
            assert _sample(text, "relay_upstream_status_total", status="200") == TURNS
            assert _sample(text, "relay_added_latency_seconds_count") == TURNS
            assert _sample(text, "relay_first_output_seconds_count") == TURNS
            # The scrape-time gauges are still there (read from Redis).
            assert "relay_slots_in_use" in text
    finally:
        if relay is not None:
            relay.stop()
        await emulator.stop()


def _refreshesByWorker(port: int, workers: list, attempts: int = 60) -> dict:
    """
    C{POST /admin/accounts/o1/refresh} on new connections until each of
    C{workers} has answered at least two (blocking; run in a thread).

    @return: worker pid -> the C{refreshed} values it answered.
    """
    answers = {pid: [] for pid in workers}
    for _ in range(attempts):
        if all(len(a) >= 2 for a in answers.values()):
            break
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            deadline = time.monotonic() + 5
            pid = _servedBy(s, workers, port)
            while pid is None and time.monotonic() < deadline:
                time.sleep(0.01)
                pid = _servedBy(s, workers, port)
            assert pid is not None, "no worker accepted the connection"
            s.sendall(b"POST /admin/accounts/o1/refresh HTTP/1.0\r\nHost: x\r\n"
                      b"Authorization: Bearer " + ADMIN.encode() + b"\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 2\r\n"
                      b"Connection: close\r\n\r\n{}")
            data = b""
            while True:
                part = s.recv(65536)
                if not part:
                    break
                data += part
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == b"200", data
        answers[pid].append(json.loads(body)["refreshed"])
    assert all(len(a) >= 2 for a in answers.values()), answers
    return answers


@pytest_twisted.ensureDeferred
async def test_refresh_failures_add_up_across_workers(redisServer):  # noqa: F811
    """
    See the module docstring.
    """
    from twisted.internet.threads import deferToThread

    emulator = Emulator(reactor=reactor, config=emulatorConfig(("o1",), ttl=86400))
    await emulator.listen(reactor)
    emulator.oauth.setFault("o1", {"kind": "status", "code": 503})
    tmp = tempfile.mkdtemp(prefix="relay-metrics-oauth-")
    relay = RelayProcess(config=os.path.join(tmp, "relay.yaml"),
                         log=os.path.join(tmp, "relay.log"))
    try:
        oauth = oauthAccount(emulator, "o1", accessTtl=86400)
        oauth["access_token"] = oauth.pop("credential")  # the configuration's name
        accounts = [_account(emulator, "a1"), oauth]
        _writeWorkersConfig(relay, accounts, redisServer.url, 2, "log: {format: json}\n")
        relay.start()
        await relay.waitHealthy()
        await _until(lambda: len(_children(relay.process.pid)) == 2, 20, "the workers")
        workers = _children(relay.process.pid)
        for pid in workers:
            await _until(lambda pid=pid: _listening(pid, relay.port), 20, f"worker {pid}")
        answers = await deferToThread(_refreshesByWorker, relay.port, workers)
        assert not any(v for values in answers.values() for v in values), answers
        requests = oauthStats(emulator, "o1")["token_requests"]
        started = set()
        for line in relay.tail(10**7).splitlines():
            if line.startswith("{") and '"relay.oauth_refresh_started"' in line:
                started.add(json.loads(line).get("worker"))
        # Both workers sent failing token requests of their own.
        assert started == {0, 1}, (started, answers)
        assert requests >= 2
        for _ in range(4):  # new connections: several workers answer
            r = await treq.get(relay.url + "/metrics",
                               headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False)
            assert r.code == 200
            text = (await r.content()).decode()
            assert _sample(text, "relay_oauth_refresh_failures_total",
                           account="o1") == requests, (requests, text)
        assert oauthStats(emulator, "o1")["token_requests"] == requests
    finally:
        relay.stop()
        await emulator.stop()
