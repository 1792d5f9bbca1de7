"""
Metrics that add up across workers (issue 23): with C{workers: 2}, turns
sent on new connections land on both workers (C{SO_REUSEPORT}), and one
scrape of C{/metrics} -- answered by whichever worker gets it -- reports
the whole group: C{relay_turns_total} equals the turns sent, and so do the
histogram counts. Without the supervisor's multiprocess directory each
scrape reports one worker's share.
"""

from __future__ import annotations

import json
import re
import tempfile

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults

from relay.emulator import Emulator
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.relayproc import ADMIN
from tests.integration.test_workers import _startWorkers, _threaded

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
