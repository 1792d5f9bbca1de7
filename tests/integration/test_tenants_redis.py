"""
Issue 22's shared parts: two real relay processes on one real
C{redis-server}. A key's C{rpm} holds across both (within one request of
the limit: the Lua check-and-count is atomic, so exactly C{rpm} pass); the
request log is one capped Redis stream, so either process answers for a
turn the other served; the request-id lookup over 10,000 records is timed
in C{bench/bench_requestlog.py}.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults

from relay.emulator import Emulator
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.relayproc import ADMIN, RelayProcess

KEY = "sk-relay-rpm"


def _write(path, port, emulator, redisURL, rpm) -> None:
    accounts = [{"id": "a1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
                 "api_key": "sk-shared-a1", "concurrency": 0}]
    keys = [{"name": "shared", "key": KEY, "concurrency": 0, "rpm": rpm}]
    with open(path, "w") as f:
        f.write(
            f'listen: "tcp:{port}:interface=127.0.0.1"\n'
            f"admin_key: {ADMIN}\n"
            f"keys: {json.dumps(keys)}\n"
            f"accounts: {json.dumps(accounts)}\n"
            f"state: {{backend: redis, redis_url: '{redisURL}'}}\n"
            "request_log: {flush_interval_seconds: 0.2}\n"
        )


async def _post(relay, requestId=None):
    headers = {"Authorization": [f"Bearer {KEY}"], "Content-Type": ["application/json"]}
    if requestId:
        headers["X-Request-Id"] = [requestId]
    response = await treq.post(relay.url + "/v1/responses",
                               json.dumps({"model": "gpt-5.5", "input": "hi"}).encode(),
                               headers=headers, persistent=False)
    body = await response.content()
    return response, body


@pytest_twisted.ensureDeferred
async def test_rpm_shared_by_two_processes_and_one_request_log(redisServer):  # noqa: F811
    """
    C{rpm: 5}: 14 concurrent requests spread over two relay processes --
    exactly 5 are served, the other 9 get 429 with C{Retry-After} and
    C{x-ratelimit-remaining-requests: 0}, and the emulator saw 5 requests.
    Each process's C{/admin/requests} finds a turn the other one served.
    """
    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-tenants-redis-")
    relays = []
    try:
        for i in range(2):
            path = os.path.join(tmp, f"relay{i}.yaml")
            relay = RelayProcess(config=path, log=os.path.join(tmp, f"relay{i}.log"))
            _write(path, relay.port, emulator, redisServer.url, rpm=5)
            relay.start()
            relays.append(relay)
        for relay in relays:
            await relay.waitHealthy()
        results = await gatherResults(
            [Deferred.fromCoroutine(_post(relays[i % 2])) for i in range(14)])
        codes = sorted(r.code for r, _ in results)
        assert codes.count(200) == 5, codes
        assert codes.count(429) == 9, codes
        for response, body in results:
            if response.code == 429:
                assert 1 <= int(response.headers.getRawHeaders("retry-after")[0]) <= 60
                assert response.headers.getRawHeaders("x-ratelimit-remaining-requests") == ["0"]
                assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        assert len(emulator.requestsFor("sk-shared-a1")) == 5

        # A turn one process served, asked of the other one.
        servedBy, rid = next((i % 2, r.headers.getRawHeaders("x-request-id")[0])
                             for i, (r, _) in enumerate(results) if r.code == 200)
        await _waitFlush()
        response = await treq.get(
            relays[1 - servedBy].url + f"/admin/requests?request_id={rid}",
            headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False)
        found = json.loads(await response.content())["requests"]
        assert [r["request_id"] for r in found] == [rid], found
        assert found[0]["account"] == "a1" and found[0]["status"] == 200
        response = await treq.get(relays[0].url + "/admin/requests?outcome=failed&limit=100",
                                  headers={"Authorization": [f"Bearer {ADMIN}"]},
                                  persistent=False)
        failed = json.loads(await response.content())["requests"]
        assert len(failed) == 9 and {r["status"] for r in failed} == {429}
    finally:
        for relay in relays:
            relay.stop()
        await emulator.stop()


async def _waitFlush():
    from twisted.internet.task import deferLater

    await deferLater(reactor, 0.6, lambda: None)


@pytest_twisted.ensureDeferred
async def test_redis_providers_on_a_real_server(redisServer):  # noqa: F811
    """
    L{RedisRequestLog} on a real server: filters, paging newest first with
    the cursor, the count bound (capped stream), a connection's turns by
    its id, the turns of a client's request id (R111) by that id, of any
    key. L{RedisRateLimiter}: the token window refuses at C{tpm}, and
    C{peek} counts nothing.
    """
    from relay.wire.redisclient import RedisService
    from relay.tenants.ratelimit import RedisRateLimiter
    from relay.tenants.requestlog import RedisRequestLog, RequestQuery
    from tests.test_tenants_requestlog import record

    redisServer.command("FLUSHALL")
    service = RedisService(url=redisServer.url, clock=reactor)
    service.startService()
    try:
        now = reactor.seconds()
        log = RedisRequestLog(clock=reactor, redis=service, maxRecords=50, batch=4)
        for n in range(60):
            log.add(record(n, t=now - 60 + n, outcome="failed" if n % 3 == 0 else "completed",
                           rid=f"ws_c:{n}" if n >= 58 else None,
                           cid="thread-1" if n in (55, 59) else None,
                           key="alice" if n == 55 else "bob"))
        await log.flush()
        assert int(redisServer.command("XLEN", "relay:requests").split(b":")[1]) == 50
        seen, cursor = [], None
        while True:
            page, cursor = await log.query(RequestQuery(outcome="failed"), 3, cursor)
            seen += [r.request_id for r in page]
            if cursor is None:
                break
        expected = [f"req-{n}" for n in range(57, 9, -1) if n % 3 == 0]
        assert seen == expected, seen
        found, _ = await log.query(RequestQuery(request_id="ws_c"), 10, None)
        assert [r.request_id for r in found] == ["ws_c:59", "ws_c:58"]
        found, _ = await log.query(RequestQuery(client_request_id="thread-1"), 10, None)
        assert [(r.request_id, r.key) for r in found] == [("ws_c:59", "bob"),
                                                          ("req-55", "alice")]
        found, _ = await log.query(RequestQuery(client_request_id="thread-1", key="alice"),
                                   10, None)
        assert [r.request_id for r in found] == ["req-55"]

        limiter = RedisRateLimiter(redis=service)
        assert (await limiter.admit("t", None, 100)).allowed
        await limiter.addTokens("t", 150)
        refused = await limiter.admit("t", None, 100)
        assert (refused.allowed, refused.refusedBy, refused.tokens) == (False, "tpm", 150)
        assert 59 <= refused.retryAfter <= 60
        for _ in range(3):
            assert (await limiter.peek("r", 2, None)).requests == 0
    finally:
        await service.stopService()
