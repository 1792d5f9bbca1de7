"""
Every generated token is counted, whoever hangs up (behaviour.md R107), end
to end over loopback: a client that hangs up after
C{response.output_text.done} (HTTP SSE), after the C{finish_reason} chunk
(chat stream) or on the WebSocket (ctx_pool, passthrough, http_bridge)
leaves relay counting exactly the usage the emulator generated
(C{GET /_emulator/generations}); an upstream cut after the client left is
estimated and marked; a departure before output still counts nothing (R2).
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher

from tests.integration.cdp import Session
from tests.integration.hangup import hangUpAt
from tests.integration.harness import RELAY_KEY, startStack
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.test_status_page import CHROMIUM
from tests.integration.test_ws_turns import connect

PINNED = {"input_tokens": 6000, "output_tokens": 50}
PAGE_ADMIN = "drain-page-admin-key"
SCRIPT = {"text": "one two three four five six seven eight", "deltas": 4, "delay": 0.05,
          "usage": PINNED}


async def hangUpAfter(stack, path: str, body: dict, marker: bytes) -> bytes:
    """
    POST C{body} to relay and hang up once C{marker} was received
    (L{hangUpAt} with the stack's port and key).
    """
    return await hangUpAt(stack.port.getHost().port, RELAY_KEY, path, body, marker)


class _Tee:
    """
    The runner's request log, keeping a copy of each record it is given.
    """

    def __init__(self, log, records):
        self._log = log
        self._records = records

    def __getattr__(self, name):
        return getattr(self._log, name)

    def add(self, record):
        self._records.append(record)
        self._log.add(record)


class _Finished:
    """
    Collects relay's C{relay.turn_finished} events and the request log's
    records while a test runs.
    """

    def __init__(self, stack):
        self.events = []
        self.records = []
        log = stack.app.runner.requestLog
        if log is not None:
            stack.app.runner.requestLog = _Tee(log, self.records)

    def __call__(self, event):
        if event.get("event") == "relay.turn_finished":
            self.events.append(event)

    async def wait(self, count=1, timeout=10.0):
        waited = 0.0
        while len(self.events) < count:
            if waited > timeout:
                raise AssertionError(f"{len(self.events)} turn(s) finished, wanted {count}")
            await deferLater(reactor, 0.02, lambda: None)
            waited += 0.02
        return self.events


async def generations(stack) -> list:
    """
    C{GET /_emulator/generations}: every generation with its usage.
    """
    response = await treq.get(stack.emulator.baseURL("apikey").rsplit("/v1", 1)[0]
                              + "/_emulator/generations", persistent=False)
    body = json.loads(await response.content())
    assert response.code == 200
    return body["generations"]


async def relayUsage(stack) -> dict:
    """
    The test key's usage row as C{/admin/usage} serves it.
    """
    rows = await stack.app.runner.usage.totals(0, "key")
    return {row["key"]: row for row in rows}.get("test", {})


def assertCounted(gens: list, finished: list, usage: dict, estimated: int = 0) -> None:
    """
    Every token the emulator generated is in relay's usage (exactly: the
    emulator pins it) and on the turn's log line.
    """
    assert len(gens) == len(finished) == 1
    gen, = gens
    assert (gen["input_tokens"], gen["output_tokens"]) == (6000, 50)
    event, = finished
    assert (event["outcome"], event["status"]) == ("client_gone", 499)
    assert (event["input_tokens"], event["output_tokens"]) == (6000, 50)
    assert usage["input_tokens"] == sum(g["input_tokens"] for g in gens)
    assert usage["output_tokens"] == sum(g["output_tokens"] for g in gens)
    assert usage["estimated_requests"] == estimated


async def _stack(accounts=None, extra=""):
    stack = await startStack(accounts or [{"id": "a1", "credential": "sk-a1"}], extra=extra)
    stack.emulator.setScript("*", SCRIPT)
    return stack


@pytest_twisted.ensureDeferred
async def test_http_sse_hang_up_after_output_text_done():
    """
    R107: the client hangs up after C{response.output_text.done}, before
    C{response.completed}: relay counts the turn with the emulator's usage.
    """
    stack = await _stack()
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        got = await hangUpAfter(stack, "/v1/responses",
                                {"model": "gpt-5.5", "input": "hi", "stream": True},
                                b"response.output_text.done")
        assert b"response.completed" not in got
        await finished.wait()
        assertCounted(await generations(stack), finished.events, await relayUsage(stack))
        record, = finished.records
        assert (record.outcome, record.input_tokens, record.output_tokens) == (
            "client_gone", 6000, 50)
        assert not record.usage_estimated
        states = await stack.app.store.getAccountStates(["a1"])
        assert states["a1"].blockedUntil == 0 and not states["a1"].disabled
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chat_stream_hang_up_after_finish_reason():
    """
    R107 on a chat stream: the client hangs up after the C{finish_reason}
    chunk, before the usage chunk and C{[DONE]}.
    """
    stack = await _stack()
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        got = await hangUpAfter(
            stack, "/v1/chat/completions",
            {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
             "stream": True},
            b'"finish_reason":"stop"')
        assert b"[DONE]" not in got
        await finished.wait()
        assertCounted(await generations(stack), finished.events, await relayUsage(stack))
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()


@pytest.mark.parametrize("mode", ["ctx_pool", "passthrough", "http_bridge"])
@pytest_twisted.ensureDeferred
async def test_websocket_hang_up_after_output_text_done(mode):
    """
    R107 on the WebSocket, every mode: the client drops its connection
    after C{response.output_text.done}.
    """
    stack = await _stack([{"id": "a1", "credential": "sk-a1", "ws_mode": mode}])
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        client = await connect(stack)
        client.sendJSON({"type": "response.create", "model": "gpt-5.5", "input": "hi"})
        while True:
            event = await client.next(10)
            assert event["type"] not in ("response.completed", "__closed__"), event
            if event["type"] == "response.output_text.done":
                break
        client.transport.abortConnection()
        await finished.wait()
        assertCounted(await generations(stack), finished.events, await relayUsage(stack))
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_upstream_cut_after_client_left_is_estimated():
    """
    R107: the client hangs up at the first delta and the upstream is cut
    before its terminal event: relay records its estimate, marked in the
    request log, the usage totals and the metric.
    """
    stack = await _stack()
    stack.emulator.setFault("sk-a1", {"kind": "cut_after_events", "events": 7})
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        await hangUpAfter(stack, "/v1/responses",
                          {"model": "gpt-5.5", "input": "x" * 4000, "stream": True},
                          b"response.output_text.delta")
        events = await finished.wait()
        assert await generations(stack) == []
        event, = events
        assert event["outcome"] == "client_gone"
        assert event["input_tokens"] >= 1000 and event["output_tokens"] >= 1
        record, = finished.records
        assert record.usage_estimated and record.asDict()["usage_estimated"] is True
        usage = await relayUsage(stack)
        assert usage["estimated_requests"] == 1 and usage["requests"] == 1
        metrics = stack.app.runner.metrics
        if metrics is not None:
            value = metrics.registry.get_sample_value(
                "relay_usage_estimated_turns_total",
                {"key": "test", "account": "a1", "model": "gpt-5.5"})
            assert value == 1
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_hang_up_before_output_counts_nothing():
    """
    R2 unchanged: the client leaves while the first output is delayed; the
    upstream is dropped at once, nothing generated, nothing counted.
    """
    stack = await _stack()
    stack.emulator.setFault("sk-a1", {"kind": "delay_first_output", "seconds": 3})
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        client = await hangUpAfter(stack, "/v1/responses",
                                   {"model": "gpt-5.5", "input": "hi", "stream": True}, None)
        waited = 0.0
        while stack.emulator.state.inflight("sk-a1") == 0:
            assert waited < 5, "the upstream never got the turn"
            await deferLater(reactor, 0.02, lambda: None)
            waited += 0.02
        assert client.received == b"", "R22: nothing reached the client before output"
        client.transport.abortConnection()
        events = await finished.wait()
        assert events[0]["outcome"] == "client_gone"
        assert events[0]["input_tokens"] is None
        await deferLater(reactor, 0.3, lambda: None)
        assert stack.emulator.state.inflight("sk-a1") == 0
        assert await generations(stack) == []
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_redis_counts_a_left_client(redisServer):  # noqa: F811
    """
    With Redis state the drained usage goes the same way into the shared
    totals (one test: usage is recorded through one path).
    """
    redisServer.command("FLUSHALL")
    stack = await _stack(
        extra=f"state: {{backend: redis, redis_url: {json.dumps(redisServer.url)}}}\n")
    stack.app.services[0].startService()  # the Redis client
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        await hangUpAfter(stack, "/v1/responses",
                          {"model": "gpt-5.5", "input": "hi", "stream": True},
                          b"response.output_text.done")
        await finished.wait()
        assertCounted(await generations(stack), finished.events, await relayUsage(stack))
        hour = int(reactor.seconds()) // 3600 * 3600
        assert redisServer.command("EXISTS", f"relay:usage:h:{hour}").strip().endswith(b"1")
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()
        await stack.app.services[0].stopService()


@pytest_twisted.ensureDeferred
async def test_background_counted_once_whoever_polls():
    """
    R107, R88: a background response is counted once, when it finishes:
    its streaming client hangs up at the first delta and never polls, and
    relay still counts it (the drain reads its stream to the end); two
    later polls of the finished response count nothing more.
    """
    stack = await _stack()
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        got = await hangUpAfter(stack, "/v1/responses",
                                {"model": "gpt-5.5", "input": "hi", "stream": True,
                                 "background": True},
                                b"response.output_text.delta")
        await finished.wait()
        waited = 0.0
        while not await generations(stack):
            assert waited < 5, "the background run never finished"
            await deferLater(reactor, 0.05, lambda: None)
            waited += 0.05
        usage = await relayUsage(stack)
        gens = await generations(stack)
        assert len(gens) == 1
        assert (usage["requests"], usage["input_tokens"], usage["output_tokens"]) == (
            1, gens[0]["input_tokens"], gens[0]["output_tokens"])
        responseId = gens[0]["response_id"]
        assert responseId and responseId.encode() in got
        for _ in range(2):
            response = await treq.get(f"{stack.url}/v1/responses/{responseId}",
                                      headers={"Authorization": [f"Bearer {RELAY_KEY}"]},
                                      persistent=False)
            body = json.loads(await response.content())
            assert response.code == 200 and body["status"] == "completed", body
        usage = await relayUsage(stack)
        assert (usage["requests"], usage["input_tokens"]) == (1, 6000)
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
@pytest_twisted.ensureDeferred
async def test_status_page_shows_left_clients_tokens_and_cost():
    """
    R107: C{client_gone} rows show their tokens and cost on the status
    page; an estimated one is marked (C{≈}, "estimated" in its detail).
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}],
                             extra=f"admin_key: {PAGE_ADMIN}\n")
    stack.emulator.setScript("*", SCRIPT)
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    session = Session()
    try:
        await hangUpAfter(stack, "/v1/responses",
                          {"model": "gpt-5.5", "input": "hi", "stream": True},
                          b"response.output_text.done")
        await finished.wait(1)
        stack.emulator.setFault("sk-a1", {"kind": "cut_after_events", "events": 7, "times": 1})
        await hangUpAfter(stack, "/v1/responses",
                          {"model": "gpt-5.5", "input": "x" * 400, "stream": True},
                          b"response.output_text.delta")
        await finished.wait(2)
        await stack.app.runner.requestLog.flush()
        page = await session.start()
        await page.goto(stack.url + "/admin/#key=" + PAGE_ADMIN)
        await page.section("requests", "requests-loaded")
        rows = await page.evaluate(
            "Array.from(document.querySelectorAll('tr.request.outcome-client_gone'))"
            ".map(function (r) { return r.innerText; })")
        assert len(rows) == 2, rows
        estimated, real = rows  # newest first
        assert "client_gone 499" in real and "6050 tok" in real and "$" in real, real
        assert "≈" in estimated and "tok" in estimated and "≈" not in real, estimated
        await page.click("tr.request.outcome-client_gone")
        await page.waitFor("document.body.getAttribute('data-request-detail') !== null")
        detail = await page.text("#request-detail")
        assert "estimated" in detail, detail
    finally:
        globalLogPublisher.removeObserver(finished)
        await session.stop()
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_oauth_json_client_leaves_mid_generation():
    """
    R107 on an OAuth account with a non-streaming client: the upstream
    streams (the ChatGPT backend always does) while relay holds the answer
    for the JSON client; the client leaves mid-generation and the turn is
    still counted with the emulator's usage.
    """
    stack = await _stack([{"id": "o1", "type": "oauth", "credential": "tok-o1"}])
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        client = await hangUpAfter(stack, "/v1/responses",
                                   {"model": "gpt-5.5", "input": "hi"}, None)
        waited = 0.0
        while stack.emulator.state.inflight("tok-o1") == 0:
            assert waited < 5, "the upstream never got the turn"
            await deferLater(reactor, 0.02, lambda: None)
            waited += 0.02
        await deferLater(reactor, 0.3, lambda: None)  # past the first output
        assert client.received == b""
        client.transport.abortConnection()
        await finished.wait()
        assertCounted(await generations(stack), finished.events, await relayUsage(stack))
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()


@pytest.mark.parametrize("limit", ["daily_tokens", "tpm"])
@pytest_twisted.ensureDeferred
async def test_left_turn_charges_budget_and_tpm(limit):
    """
    R107: the turn whose client hung up is charged to the key's token
    budget and C{tpm}: the next turn is refused.
    """
    keys = [{"name": "test", "key": RELAY_KEY, "concurrency": 0, limit: 6000}]
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], keys=json.dumps(keys))
    stack.emulator.setScript("*", SCRIPT)
    finished = _Finished(stack)
    globalLogPublisher.addObserver(finished)
    try:
        await hangUpAfter(stack, "/v1/responses",
                          {"model": "gpt-5.5", "input": "hi", "stream": True},
                          b"response.output_text.done")
        await finished.wait()
        response, body = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"})
        assert response.code == 429, body
    finally:
        globalLogPublisher.removeObserver(finished)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_background_json_create_never_polled_is_counted():
    """
    R107, R88: a non-streaming background create answers C{queued}; nobody
    ever polls it, and relay still counts its usage once, when it
    finished (relay looks at it itself), exactly as the emulator generated.
    """
    stack = await _stack()
    try:
        response, body = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "hi", "background": True})
        assert response.code == 200 and json.loads(body)["status"] == "queued", body
        waited = 0.0
        while not (await relayUsage(stack)).get("requests"):
            assert waited < 12, "the background response was never counted"
            await deferLater(reactor, 0.2, lambda: None)
            waited += 0.2
        gens = await generations(stack)
        usage = await relayUsage(stack)
        assert len(gens) == 1
        assert (usage["requests"], usage["input_tokens"], usage["output_tokens"]) == (
            1, gens[0]["input_tokens"], gens[0]["output_tokens"])
    finally:
        await stack.stop()
