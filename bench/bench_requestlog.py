"""
Issue 22's request log, measured (not a test: it prints figures).

  python bench/bench_requestlog.py record   # in-process: building one turn's
                                            # TurnRecord and adding it to the
                                            # log, vs one relay.turn_finished
                                            # log line (text and JSON)
  python bench/bench_requestlog.py flush    # SQLite: the write of buffered
                                            # records, per record
  python bench/bench_requestlog.py query    # 10,000 turns of mixed outcomes
                                            # in a real relay (SQLite, and a
                                            # real redis-server when installed):
                                            # GET /admin/requests?request_id=
                                            # over HTTP, median and p95 ms

The issue's bars: a record costs no more than one log line does now; the
query by request id over 10,000 turns answers in < 50 ms.
"""

from __future__ import annotations

import io
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OUTCOMES = [("completed", 200)] * 7 + [("failed", 429), ("failed", 502), ("client_gone", 499)]


def _turnAndState():
    from relay.engine.runner import TurnState
    from relay.base.records import ClientKey, Turn
    from relay.tenants.record import Attempt
    from relay.usage.tokens import TokenCounts

    turn = Turn(entrypoint="http", endpoint="responses",
                client=ClientKey(name="bench", key="sk-x", concurrency=0), model="gpt-5.5",
                body={"model": "gpt-5.5", "input": "hi"}, stream=True,
                requestId="req_0123456789abcdef", clientAddress="127.0.0.1", userAgent="wrk")
    turn.usage = TokenCounts(1, 120, 100, 30, 12, cost=1_050_000)
    turn.firstOutputAt = 1005.0
    turn.upstreamRequestId = "req_e63c6c7ff7e5de539ec60762"
    state = TurnState(startedAt=1000.0)
    state.tried.append(Attempt("a1", 200, "ok", "served"))
    return turn, state


def benchRecord(turns: int = 100_000) -> None:
    """
    The per-turn cost the engine adds: L{relay.engine.runner._turnRecord}
    plus L{relay.tenants.requestlog.MemoryRequestLog.add}-like buffering
    (the SQLite/Redis logs' C{add} is a list append), against one
    C{relay.turn_finished} line through relay's text and JSON observers.
    """
    from twisted.internet.task import Clock
    from twisted.logger import Logger

    from relay.engine.runner import _turnRecord
    from relay.base.logs import observerFor
    from relay.tenants.requestlog import SQLiteRequestLog

    turn, state = _turnAndState()
    log = SQLiteRequestLog(clock=Clock(), database=None)
    for _ in range(2000):
        log.add(_turnRecord(turn, state, "completed", 200, "a1", 1000.0, 1006.0))
    log._buffer.clear()
    start = time.perf_counter()
    for _ in range(turns):
        log.add(_turnRecord(turn, state, "completed", 200, "a1", 1000.0, 1006.0))
        if len(log._buffer) >= 10_000:
            log._buffer.clear()
    record = (time.perf_counter() - start) / turns * 1e6
    print(f"record: {record:.2f} us per turn (build TurnRecord + add)")

    import bench.bench_relay as relayBench

    _, fmt, fields = relayBench._requestEvents()[2]

    class Source:
        pass

    for kind in ("text", "json"):
        out = io.StringIO()
        logger = Logger(namespace="relay.engine.runner.TurnRunner", source=Source(),
                        observer=observerFor(kind, out, secrets=["sk-relay-bench-secret"]))
        for _ in range(2000):
            logger.info(fmt, **fields)
        out.seek(0)
        out.truncate()
        start = time.perf_counter()
        for _ in range(turns // 5):
            logger.info(fmt, **fields)
        line = (time.perf_counter() - start) / (turns // 5) * 1e6
        print(f"one relay.turn_finished line ({kind}): {line:.2f} us"
              f" -> record / line = {record / line:.2f}")


def _records(n: int, clock: float):
    from relay.tenants.record import Attempt, TurnRecord

    rng = random.Random(22)
    ids = []
    for i in range(n):
        outcome, status = rng.choice(OUTCOMES)
        attempts = [Attempt("a1", 503, "status_503", "switch")] if rng.random() < 0.2 else []
        attempts.append(Attempt("a2", status, "ok" if status == 200 else "rate_limited",
                                "served" if status == 200 else "pass"))
        rid = f"req_{i:08x}{rng.getrandbits(32):08x}"
        ids.append(rid)
        yield TurnRecord(
            time=clock - n + i, request_id=rid, key=rng.choice(["alice", "bob", "ci"]),
            entrypoint=rng.choice(["http", "ws"]), endpoint="responses", mode=None,
            stream=True, model=rng.choice(["gpt-5.5", "gpt-5.4"]), account="a2",
            attempts=attempts, outcome=outcome, status=status, first_output_ms=120,
            duration_ms=900, input_tokens=120, cached_tokens=100, output_tokens=30,
            reasoning_tokens=12, cost_nanos=1_050_000, client_ip="127.0.0.1",
            user_agent="codex_cli_rs/0.171.0",
        ), rid


def benchFlush(records: int = 10_000) -> None:
    """
    Writing buffered records to SQLite (the flush timer's work, off the
    hot path, on the settings store's connection thread): per record.
    """
    from twisted.internet.task import Clock

    from relay.state.settingsdb import SQLiteSettingsStore
    from relay.tenants.requestlog import SQLiteRequestLog
    from tests.test_usage import synchronousPool

    path = os.path.join(tempfile.mkdtemp(prefix="relay-bench-"), "relay.sqlite")
    database = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
    clock = Clock()
    clock.advance(time.time())
    log = SQLiteRequestLog(clock=clock, database=database)
    for batch in (100, 1000):
        items = [r for r, _ in _records(records, clock.seconds())]
        start = time.perf_counter()
        for i in range(0, len(items), batch):
            for r in items[i:i + batch]:
                log.add(r)
            log.flush()
        elapsed = time.perf_counter() - start
        print(f"flush SQLite, batches of {batch}: {elapsed / records * 1e6:.1f} us per record")
    database.close()


def benchQuery(records: int = 10_000, lookups: int = 200) -> None:
    """
    A real relay (in-process, real reactor, HTTP on loopback) whose request
    log holds C{records} turns of mixed outcomes: C{lookups} random
    C{GET /admin/requests?request_id=...}, timed by the client; SQLite,
    then Redis when C{redis-server} is installed.
    """
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    async def run():
        for backend in ("sqlite", "redis"):
            try:
                await _queryOne(backend, records, lookups)
            except FileNotFoundError as e:
                print(f"query {backend}: skipped ({e})")
        reactor.stop()

    reactor.callWhenRunning(lambda: ensureDeferred(run()).addErrback(
        lambda f: (f.printTraceback(), reactor.stop())))
    reactor.run()


async def _queryOne(backend: str, records: int, lookups: int) -> None:
    import treq
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint

    from relay.process.app import buildApplication
    from relay.configuration.parse import settingsFromString

    server = None
    tmp = tempfile.mkdtemp(prefix="relay-bench-")
    text = ('listen: "tcp:0:interface=127.0.0.1"\nadmin_key: bench-admin\n'
            f'database: {json.dumps(os.path.join(tmp, "relay.sqlite"))}\n'
            'keys: [{name: bench, key: sk-bench}]\n'
            'accounts: [{id: a1, type: apikey, api_key: x}, {id: a2, type: apikey, api_key: y}]\n'
            f'request_log: {{max_records: {records}}}\n')
    if backend == "redis":
        from tests.integration.redis_server import REDIS_SERVER, RedisServer

        if not os.path.exists(REDIS_SERVER):
            raise FileNotFoundError("redis-server not installed")
        server = RedisServer()
        server.start()
        text += f"state: {{backend: redis, redis_url: '{server.url}'}}\n"
    app = buildApplication(settingsFromString(text), reactor)
    if backend == "redis":
        app.services[0].startService()
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(app.site)
    try:
        log = app.extras["requestLog"]
        ids = []
        for record, rid in _records(records, reactor.seconds()):
            log.add(record)
            ids.append(rid)
            if len(log._buffer) >= 1000:
                await log.flush()
        await log.flush()
        url = f"http://127.0.0.1:{port.getHost().port}/admin/requests?request_id="
        headers = {"Authorization": ["Bearer bench-admin"]}
        rng = random.Random(5)
        times = []
        for n in range(lookups + 20):
            rid = rng.choice(ids)
            start = time.perf_counter()
            response = await treq.get(url + rid, headers=headers)
            body = await response.json()
            elapsed = (time.perf_counter() - start) * 1000
            assert [r["request_id"] for r in body["requests"]] == [rid], body
            if n >= 20:
                times.append(elapsed)
        times.sort()
        print(f"query {backend}: {records} records, request_id lookup over HTTP:"
              f" median {statistics.median(times):.2f} ms, p95 {times[int(len(times) * .95)]:.2f}"
              f" ms, max {times[-1]:.2f} ms ({lookups} lookups)")
        base = f"http://127.0.0.1:{port.getHost().port}/admin/requests?limit=50&"
        for query in ("account=a1", "outcome=client_gone", "key=ci&model=gpt-5.4"):
            spent = []
            for _ in range(20):
                start = time.perf_counter()
                response = await treq.get(base + query, headers=headers)
                body = await response.json()
                spent.append((time.perf_counter() - start) * 1000)
            print(f"query {backend}: ?{query}&limit=50 -> {len(body['requests'])} records,"
                  f" median {statistics.median(spent):.2f} ms")
    finally:
        await port.stopListening()
        if backend == "redis":
            await app.services[0].stopService()
            server.cleanup()
        else:
            app.settings.store.close()


if __name__ == "__main__":
    which = sys.argv[1:] or ["record", "flush", "query"]
    for w in which:
        {"record": benchRecord, "flush": benchFlush, "query": benchQuery}[w]()
