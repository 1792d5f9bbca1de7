"""
Issue 13 item 5 end to end: token usage counted on every entrypoint
(Responses SSE and JSON, Chat Completions stream and JSON, the WebSocket in
ctx_pool, passthrough and http_bridge), once per turn across failover,
served at C{/admin/usage} and C{/metrics} and on the status page, per-key
budgets, persistence in SQLite and sharing through a real Redis.

The emulator pins each answer's usage (its script's C{usage}), so every
number below is exact. Clients are the real C{openai} SDK and an autobahn
WebSocket client, over loopback.
"""

from __future__ import annotations

import json
import re

import openai
import pytest_twisted
import treq
from autobahn.twisted.websocket import WebSocketClientFactory
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.threads import deferToThread

from relay.process.app import buildApplication
from relay.configuration.parse import settingsFromString
from relay.emulator import Emulator
from relay.usage.service import UsageFlushService
from tests.integration.harness import RELAY_KEY, accountsYAML, startStack
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.test_status_page import CHROMIUM, chromium
from tests.integration.test_ws_turns import _Client

ADMIN = "usage-admin-key-0000"
PINNED = {"input_tokens": 120, "cached_tokens": 100, "output_tokens": 30, "reasoning_tokens": 12}
ONE = {"requests": 1, "input_tokens": 120, "cached_input_tokens": 100, "output_tokens": 30,
       "reasoning_tokens": 12, "total_tokens": 150}


def times(n: int) -> dict:
    """
    @return: L{ONE} multiplied by C{n}.
    """
    return {name: value * n for name, value in ONE.items()}


def sdk(port: int) -> openai.OpenAI:
    """
    A sync SDK client for a relay port: no SDK retries, short timeout.
    """
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=RELAY_KEY,
                         max_retries=0, timeout=20.0)


async def usage(port: int, query: str = "group_by=key") -> dict:
    """
    C{GET /admin/usage?<query>} on a relay port.
    """
    response = await treq.get(f"http://127.0.0.1:{port}/admin/usage?{query}",
                              headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False)
    body = json.loads(await response.content())
    assert response.code == 200, body
    return body


MONEY = ("cost_usd", "unpriced_requests", "estimated_requests")
"""Issue 22's money fields of a row, compared by L{costs}, and R107's count of
estimated turns (none here: every client stays to the end)."""


def rows(body: dict) -> dict:
    """
    @return: group value -> the row without its group field and its money
        fields (see L{costs}).
    """
    group = body["group_by"]
    return {row[group]: {k: v for k, v in row.items() if k != group and k not in MONEY}
            for row in body["rows"]}


def costs(body: dict) -> dict:
    """
    @return: group value -> C{(cost_usd, unpriced_requests)} (issue 22).
    """
    group = body["group_by"]
    return {row[group]: (row["cost_usd"], row["unpriced_requests"]) for row in body["rows"]}


async def wsTurns(port: int, model: str, count: int) -> list:
    """
    C{count} turns on one client WebSocket.

    @return: each turn's last event.
    """
    factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/v1/responses",
                                     headers={"Authorization": f"Bearer {RELAY_KEY}"},
                                     reactor=reactor)
    factory.protocol = _Client
    client = await TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=5).connect(factory)
    await client.opened.addTimeout(5, reactor)
    try:
        last = []
        for _ in range(count):
            events = await client.turn({"type": "response.create", "model": model,
                                        "input": "hi"}, timeout=10)
            last.append(events[-1])
        return last
    finally:
        client.bye()
        await client.closed.addTimeout(5, reactor)


ACCOUNTS = [
    {"id": "api", "credential": "sk-api", "models": ["gpt-5.5"]},
    {"id": "oauth", "type": "oauth", "credential": "tok-oauth", "models": ["gpt-5.4"]},
    {"id": "pass", "credential": "sk-pass", "models": ["gpt-4.1"], "ws_mode": "passthrough"},
    {"id": "bridge", "credential": "sk-bridge", "models": ["gpt-5.4-mini"],
     "ws_mode": "http_bridge"},
]


@pytest_twisted.ensureDeferred
async def test_every_entrypoint_is_counted_once():
    """
    Issue 13 item 5: SSE, JSON (API-key and OAuth), chat stream with and
    without C{include_usage}, chat JSON, and WebSocket turns in all three
    modes each count input, cached, output and reasoning tokens once, per
    key, account and model; C{/metrics} has the same numbers. A chat
    client that did not ask for usage never sees a usage chunk.
    """
    stack = await startStack(ACCOUNTS, emulatorConfig={"default_script": {"usage": PINNED}},
                             extra=f"admin_key: {ADMIN}\n")
    port = stack.port.getHost().port
    try:
        def http():
            with sdk(port) as c:
                events = [e.type for e in c.responses.create(model="gpt-5.5", input="hi",
                                                              stream=True)]
                assert events[-1] == "response.completed"
                assert c.responses.create(model="gpt-5.5", input="hi").usage.input_tokens == 120
                oauth = c.responses.create(model="gpt-5.4", input="hi")
                assert oauth.usage.input_tokens_details.cached_tokens == 100
                plain = list(c.chat.completions.create(
                    model="gpt-5.5", messages=[{"role": "user", "content": "hi"}], stream=True))
                assert all(chunk.usage is None for chunk in plain)
                assert plain[-1].choices[0].finish_reason == "stop"
                asked = list(c.chat.completions.create(
                    model="gpt-5.5", messages=[{"role": "user", "content": "hi"}], stream=True,
                    stream_options={"include_usage": True}))
                assert asked[-1].choices == [] and asked[-1].usage.prompt_tokens == 120
                assert asked[-1].usage.completion_tokens_details.reasoning_tokens == 12
                whole = c.chat.completions.create(
                    model="gpt-5.5", messages=[{"role": "user", "content": "hi"}])
                assert whole.usage.prompt_tokens_details.cached_tokens == 100

        await deferToThread(http)
        for model in ("gpt-5.5", "gpt-4.1", "gpt-5.4-mini"):
            last = await wsTurns(port, model, 1)
            assert last[0]["type"] == "response.completed", last

        byAccount = rows(await usage(port, "group_by=account"))
        assert byAccount == {"api": times(6), "oauth": ONE, "pass": ONE, "bridge": ONE}
        byKey = await usage(port, "group_by=key&since=0")
        assert rows(byKey) == {"test": times(9)}
        assert {k: v for k, v in byKey["total"].items() if k not in MONEY} == times(9)
        modelBody = await usage(port, "group_by=model")
        byModel = rows(modelBody)
        assert byModel == {"gpt-5.5": times(6), "gpt-5.4": ONE, "gpt-4.1": ONE,
                           "gpt-5.4-mini": ONE}
        # Issue 22: each model's turns at its shipped price, on every entrypoint.
        from relay.tenants.prices import PriceTable
        from relay.usage.tokens import TokenCounts

        def price(model, n):
            return round(n * PriceTable().cost(model, TokenCounts(1, 120, 100, 30, 12)) / 1e9, 9)

        assert costs(modelBody) == {"gpt-5.5": (price("gpt-5.5", 6), 0),
                                    "gpt-5.4": (price("gpt-5.4", 1), 0),
                                    "gpt-4.1": (price("gpt-4.1", 1), 0),
                                    "gpt-5.4-mini": (price("gpt-5.4-mini", 1), 0)}

        metrics = stack.app.extras["metrics"].registry
        labels = {"key": "test", "account": "api", "model": "gpt-5.5"}
        assert metrics.get_sample_value("relay_tokens_total", dict(labels, type="cached_input")) \
            == 600
        assert metrics.get_sample_value("relay_usage_turns_total", labels) == 6
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_failover_counts_the_serving_account_once():
    """
    An attempt that fails over before output is not counted; the turn is
    counted once, on the account that served it (SSE and JSON).
    """
    stack = await startStack(
        [{"id": "bad", "credential": "sk-bad", "priority": 1},
         {"id": "good", "credential": "sk-good", "priority": 2}],
        emulatorConfig={"default_script": {"usage": PINNED}}, extra=f"admin_key: {ADMIN}\n",
    )
    port = stack.port.getHost().port
    try:
        stack.emulator.setFault("sk-bad", {"kind": "stream_error", "code": "server_error",
                                           "message": "The server had an error", "times": 1})

        def calls():
            with sdk(port) as c:
                types = [e.type for e in c.responses.create(model="gpt-5.5", input="hi",
                                                             stream=True)]
                assert types.count("response.created") == 1 and types[-1] == "response.completed"

        await deferToThread(calls)
        assert len(stack.emulator.requestsFor("sk-bad")) == 1
        assert rows(await usage(port, "group_by=account")) == {"good": ONE}
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_incomplete_is_forwarded_unchanged_and_counted():
    """
    C{response.incomplete} (C{max_output_tokens} reached) reaches the SDK
    as upstream sent it, stream and JSON, and its usage is counted.
    """
    stack = await startStack([{"id": "api", "credential": "sk-api"}],
                             emulatorConfig={"default_script": {"usage": PINNED}},
                             extra=f"admin_key: {ADMIN}\n")
    port = stack.port.getHost().port
    try:
        def calls():
            with sdk(port) as c:
                events = list(c.responses.create(model="gpt-5.5", input="hi", stream=True,
                                                  max_output_tokens=2))
                assert events[-1].type == "response.incomplete"
                assert events[-1].response.incomplete_details.reason == "max_output_tokens"
                whole = c.responses.create(model="gpt-5.5", input="hi", max_output_tokens=2)
                assert whole.status == "incomplete"

        await deferToThread(calls)
        assert rows(await usage(port)) == {"test": times(2)}
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_budget_429_with_reset_on_http_and_in_band_on_ws():
    """
    Once C{daily_tokens} is reached: HTTP 429 before any upstream request,
    the message naming the budget and its UTC reset, C{Retry-After}; the
    WebSocket turn gets the in-band 429 event with the same message and the
    reset time, and the socket stays open (R113; it used to close 1013);
    another key goes on.
    """
    keys = json.dumps([{"name": "capped", "key": RELAY_KEY, "concurrency": 0,
                        "daily_tokens": 200},
                       {"name": "free", "key": "sk-relay-free", "concurrency": 0}])
    stack = await startStack([{"id": "api", "credential": "sk-api"}], keys=keys,
                             emulatorConfig={"default_script": {"usage": PINNED}},
                             extra=f"admin_key: {ADMIN}\n")
    port = stack.port.getHost().port
    try:
        for _ in range(2):
            response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5",
                                                                 "input": "hi"})
            assert response.code == 200
        response, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi",
                                                                "stream": True})
        assert response.code == 429
        error = json.loads(data)["error"]
        assert error["type"] == "insufficient_quota"
        assert "daily_tokens is 200" in error["message"] and "300 were used" in error["message"]
        assert re.search(r"resets at \d{4}-\d\d-\d\dT00:00:00Z", error["message"])
        retry = int(response.headers.getRawHeaders("retry-after")[0])
        assert 0 < retry <= 86400
        assert len(stack.emulator.requestsFor("sk-api")) == 2

        factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/v1/responses",
                                         headers={"Authorization": f"Bearer {RELAY_KEY}"},
                                         reactor=reactor)
        factory.protocol = _Client
        client = await TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(factory)
        await client.opened.addTimeout(5, reactor)
        for _ in range(2):
            events = await client.turn({"type": "response.create", "model": "gpt-5.5",
                                        "input": "hi"})
            event = events[-1]
            assert (event["type"], event["status"], event["error"]["type"]) == (
                "error", 429, "usage_limit_reached"), events
            assert "daily_tokens is 200" in event["headers"]["x-codex-promo-message"]
            assert event["error"]["resets_at"] % 86400 == 0
            assert 0 < event["error"]["resets_in_seconds"] <= 86400
            assert client.closeInfo is None
        client.bye()

        response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"},
                                           key="sk-relay-free")
        assert response.code == 200
        budgets = (await usage(port))["budgets"]
        assert budgets == [{**budgets[0], "key": "capped", "daily_tokens": 200,
                            "daily_used": 300, "monthly_tokens": None}]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_sqlite_totals_survive_a_restart():
    """
    Hourly totals are written to the settings database by the flush
    service (on its period and at shutdown) and read by the next relay on
    the same file.
    """
    stack = await startStack([{"id": "api", "credential": "sk-api"}],
                             emulatorConfig={"default_script": {"usage": PINNED}},
                             extra=f"admin_key: {ADMIN}\n")
    try:
        app = stack.app
        service = next(s for s in app.services if isinstance(s, UsageFlushService))
        service.startService()
        response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"})
        assert response.code == 200
        await service.stopService()
        app.settings.store.close()

        again = buildApplication(app.config, reactor)
        try:
            found = await Deferred.fromCoroutine(again.extras["usage"].totals(0, "account"))
            assert found == [{"account": "api", **ONE, "cost_usd": 0.00105,
                              "unpriced_requests": 0, "estimated_requests": 0}]
        finally:
            again.settings.store.close()
    finally:
        await stack.stop()


async def _redisRelay(emulator, redisURL):
    """
    An in-process relay on the Redis backend, its Redis client started.
    """
    keys = json.dumps([{"name": "team", "key": RELAY_KEY, "concurrency": 0,
                        "daily_tokens": 400}])
    text = (
        'listen: "tcp:0:interface=127.0.0.1"\n'
        f"keys: {keys}\n"
        f"accounts: {accountsYAML(emulator, [{'id': 'api', 'credential': 'sk-api'}])}\n"
        f"admin_key: {ADMIN}\n"
        f"state: {{backend: redis, redis_url: '{redisURL}'}}\n"
    )
    app = buildApplication(settingsFromString(text), reactor)
    app.services[0].startService()
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(app.site)
    return app, port


@pytest_twisted.ensureDeferred
async def test_two_relays_share_totals_and_budgets_in_redis(redisServer):  # noqa: F811
    """
    With C{state.backend: redis} two relays add to the same hourly totals
    (real C{redis-server}); a key's budget counts what both used once each
    has flushed.
    """
    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor, config={"default_script": {"usage": PINNED}})
    await emulator.listen(reactor)
    relays = []
    try:
        for _ in range(2):
            relays.append(await _redisRelay(emulator, redisServer.url))
        (app0, port0), (app1, port1) = relays
        for port in (port0, port1, port1):
            response = await treq.post(
                f"http://127.0.0.1:{port.getHost().port}/v1/responses",
                json.dumps({"model": "gpt-5.5", "input": "hi"}).encode(),
                headers={"Authorization": [f"Bearer {RELAY_KEY}"],
                         "Content-Type": ["application/json"]}, persistent=False)
            await response.content()
            assert response.code == 200
        for app in (app1, app0):
            await app.extras["usage"].flush()
        body = await usage(port0.getHost().port, "group_by=key")
        assert rows(body) == {"team": times(3)}
        assert body["budgets"][0]["daily_used"] == 450
        response = await treq.post(
            f"http://127.0.0.1:{port0.getHost().port}/v1/responses",
            json.dumps({"model": "gpt-5.5", "input": "hi"}).encode(),
            headers={"Authorization": [f"Bearer {RELAY_KEY}"],
                     "Content-Type": ["application/json"]}, persistent=False)
        await response.content()
        assert response.code == 429
        assert redisServer.command("EXISTS", f"relay:usage:h:{int(reactor.seconds()) // 3600 * 3600}")\
            .strip().endswith(b"1")
    finally:
        for app, port in relays:
            await port.stopListening()
            await app.services[0].stopService()
            await app.dialer.close()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_status_page_usage_section():
    """
    The status page shows the token usage section: one row per key with
    its totals, and the key's budget.
    """
    if CHROMIUM is None:
        import pytest

        pytest.skip("chromium is not installed")
    keys = json.dumps([{"name": "team-a", "key": RELAY_KEY, "concurrency": 0,
                        "monthly_tokens": 100000}])
    stack = await startStack([{"id": "api", "credential": "sk-api"}], keys=keys,
                             emulatorConfig={"default_script": {"usage": PINNED}},
                             extra=f"admin_key: {ADMIN}\n")
    try:
        response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "hi"})
        assert response.code == 200
        dom, err, code = await chromium(stack.url + "/admin/#usage&key=" + ADMIN, "--dump-dom")
        assert code == 0, err[-2000:]
        row = re.search(r'<tr class="usage-row" data-group="team-a">(.*?)</tr>', dom, re.DOTALL)
        assert row is not None, dom[-3000:]
        assert "<td>team-a</td>" in row.group(1) and ">150<" in row.group(1)
        assert re.search(r'<tr class="budget-row" data-key="team-a">.*?150 / 100,000', dom, re.DOTALL)
        assert 'data-usage-loaded="1"' in dom
    finally:
        await stack.stop()
