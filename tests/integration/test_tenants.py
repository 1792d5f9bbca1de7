"""
Issue 22 end to end (behaviour.md R102): client keys as tenants against a
real relay on loopback and the bundled emulator.

Every policy refuses exactly when it should, on HTTP (Responses SSE and
JSON, Chat Completions) and on the three WebSocket modes (ctx_pool,
passthrough, http_bridge), including on one open socket whose key expires,
is revoked, or goes over its budget or rate mid-session; a key bound to an
account group never reaches another account, even with its whole group
cooling; the real C{openai} SDK backs off on relay's C{Retry-After}; the
request log finds a turn by its request id, and explain names the account
the next turn gets. The two-process parts (RPM shared on one Redis) are in
L{tests.integration.test_tenants_redis}.
"""

from __future__ import annotations

import json
import time

import openai
import pytest_twisted
import treq
from attrs import evolve
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from relay.tenants.prices import PriceTable
from relay.usage.tokens import TokenCounts
from tests.integration.harness import sseEvents, startStack
from tests.integration.test_ws_turns import connect, drain

ADMIN = "tenants-admin-key"
PINNED = {"input_tokens": 120, "cached_tokens": 100, "output_tokens": 30, "reasoning_tokens": 12}
TURN_COUNTS = TokenCounts(1, 120, 100, 30, 12)

ACCOUNTS = [
    {"id": "api", "credential": "sk-api", "models": ["gpt-5.5"]},
    {"id": "pass", "credential": "sk-pass", "models": ["gpt-4.1"], "ws_mode": "passthrough"},
    {"id": "bridge", "credential": "sk-bridge", "models": ["gpt-5.4-mini"],
     "ws_mode": "http_bridge"},
]

#: entrypoint -> the model that routes it (the WebSocket mode follows the
#: account that serves the model).
ENTRYPOINTS = {
    "http_sse": "gpt-5.5", "http_json": "gpt-5.5", "chat": "gpt-5.5",
    "ws_ctx_pool": "gpt-5.5", "ws_passthrough": "gpt-4.1", "ws_http_bridge": "gpt-5.4-mini",
}


def cost(model: str) -> float:
    """
    @return: one pinned turn's cost in dollars at the shipped price.
    """
    return PriceTable().cost(model, TURN_COUNTS) / 1e9


def keyEntry(name: str, **policy) -> dict:
    return dict({"name": name, "key": "sk-" + name, "concurrency": 0}, **policy)


async def tenantsStack(keys, extra="", accounts=ACCOUNTS, emulatorConfig=None, gateway="{}"):
    return await startStack(
        accounts, keys=json.dumps(keys),
        emulatorConfig=emulatorConfig or {"default_script": {"usage": PINNED}},
        extra=f"admin_key: {ADMIN}\n{extra}", gateway=gateway,
    )


class Driver:
    """
    One client per (key, entrypoint): HTTP turns are requests, WebSocket
    turns go over one socket that stays open between turns.
    """

    def __init__(self, stack):
        self.stack = stack
        self.sockets = {}

    async def turn(self, entry: str, key: str) -> tuple:
        """
        One turn. @return: C{("ok", None, "")} or C{("refused", status or
        close code, message or reason)}.
        """
        model = ENTRYPOINTS[entry]
        secret = "sk-" + key
        if entry.startswith("ws_"):
            return await self._ws(entry, secret, model)
        if entry == "chat":
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}
            response, data = await self.stack.postJSON("/v1/chat/completions", body, key=secret)
        else:
            body = {"model": model, "input": "hi", "stream": entry == "http_sse"}
            response, data = await self.stack.postJSON("/v1/responses", body, key=secret)
        if response.code != 200:
            return ("refused", response.code, json.loads(data)["error"]["message"])
        if entry == "http_sse":
            assert sseEvents(data)[-1][0] == "response.completed", data[-300:]
        return ("ok", None, "")

    async def _ws(self, entry, secret, model):
        client = self.sockets.get((entry, secret))
        if client is None or client.closeInfo is not None:
            try:
                client = await connect(self.stack, key=secret)
            except Exception as e:  # the upgrade was refused
                return ("refused", "upgrade", str(e))
            self.sockets[(entry, secret)] = client
        events = await client.turn({"type": "response.create", "model": model, "input": "hi"},
                                   timeout=10)
        last = events[-1]
        if last["type"] == "error" and not last.get("status"):
            # R81: information without a status, then the close.
            last = await client.next(10)
        if last["type"] == "response.completed":
            return ("ok", None, "")
        if last["type"] == "__closed__":
            return ("refused", last["code"], last["reason"])
        if last["type"] == "error":
            # R113: a key's own limit, in-band; the socket stays open
            return ("refused", last.get("status"), last["error"]["message"])
        return ("refused", last.get("status"), json.dumps(last)[:200])

    async def close(self):
        await drain(self.stack, list(self.sockets.values()))


@pytest_twisted.ensureDeferred
async def test_each_policy_refuses_exactly_when_it_should():
    """
    Per entrypoint (HTTP SSE, JSON, chat; WebSocket ctx_pool, passthrough,
    http_bridge) and per policy, with one key each so the counts are its
    own: C{rpm: 2} and C{tpm: 200} (150 tokens a turn) admit two turns and
    refuse the third (429, the window ~60 s away being more than
    C{fallback_wait_timeout}); C{daily_usd} of 1.5 turns' cost admits two
    and refuses the third (429 insufficient_quota); a model outside
    C{models} is refused at once (403). The WebSocket turns of one key run
    on one open socket, and R113 keeps it open after a refusal (the
    WebSocket used to close 1013 / 1008).
    """
    keys = []
    for entry, model in ENTRYPOINTS.items():
        keys += [keyEntry(f"rpm-{entry}", rpm=2), keyEntry(f"tpm-{entry}", tpm=200),
                 keyEntry(f"usd-{entry}", daily_usd=round(1.5 * cost(model), 9)),
                 keyEntry(f"model-{entry}", models=["gpt-5.4"])]
    stack = await tenantsStack(keys)
    driver = Driver(stack)
    try:
        seen = {}
        for entry in ENTRYPOINTS:
            ws = entry.startswith("ws_")
            for policy in ("rpm", "tpm", "usd"):
                name = f"{policy}-{entry}"
                results = [await driver.turn(entry, name) for _ in range(3)]
                seen[name] = results
                assert [r[0] for r in results] == ["ok", "ok", "refused"], (name, results)
                code = results[2][1]
                assert code == 429, (name, results[2])
                if ws:
                    assert driver.sockets[(entry, "sk-" + name)].closeInfo is None, name
            results = [await driver.turn(entry, f"model-{entry}")]
            assert results[0][:2] == ("refused", 403), (entry, results)
            assert "gpt-5.4" in results[0][2], results
            if ws:
                assert driver.sockets[(entry, f"sk-model-{entry}")].closeInfo is None, entry
        assert "requests per min (RPM): Limit 2" in seen["rpm-http_sse"][2][2]
        assert "tokens per min (TPM): Limit 200" in seen["tpm-chat"][2][2]
        assert "daily_usd" in seen["usd-http_json"][2][2]
        assert "requests per min (RPM): Limit 2" in seen["rpm-ws_passthrough"][2][2]
        assert "daily_usd" in seen["usd-ws_http_bridge"][2][2]
        # Refused turns never reached an account.
        served = sum(len(stack.emulator.requestsFor(c)) for c in ("sk-api", "sk-pass", "sk-bridge"))
        assert served >= 6 * 3 * 2
    finally:
        await driver.close()


@pytest_twisted.ensureDeferred
async def test_refused_socket_serves_the_next_response_create():
    """
    R113: in every mode a refused C{response.create} (a model outside the
    key's C{models}; in C{http_bridge} a prewarm too) leaves the socket
    open, and its next C{response.create} with an allowed model completes
    on the same socket.
    """
    models = {"ws_ctx_pool": "gpt-5.5", "ws_passthrough": "gpt-4.1",
              "ws_http_bridge": "gpt-5.4-mini"}
    stack = await tenantsStack([keyEntry(f"one-{e}", models=[m]) for e, m in models.items()])
    clients = []
    try:
        for entry, model in models.items():
            other = next(m for m in models.values() if m != model)
            client = await connect(stack, key=f"sk-one-{entry}")
            clients.append(client)
            frames = [{"type": "response.create", "model": other, "input": "hi"}]
            if entry == "ws_http_bridge":
                frames.append({"type": "response.create", "model": other, "generate": False})
            for frame in frames:
                events = await client.turn(frame, timeout=10)
                assert (events[-1]["type"], events[-1].get("status")) == ("error", 403), events
                assert events[-1]["error"]["code"] == "model_not_found"
                assert client.closeInfo is None, (entry, client.closeInfo)
            events = await client.turn({"type": "response.create", "model": model,
                                        "input": "hi"}, timeout=10)
            assert events[-1]["type"] == "response.completed", (entry, events)
    finally:
        await drain(stack, clients)


@pytest_twisted.ensureDeferred
async def test_open_socket_expired_revoked_and_http_expired():
    """
    A socket whose key expires (a reload moves C{expires_at} into the
    past) or is revoked (removed from the file) between two turns: the next
    C{response.create} is refused with close 1008 on every mode; a new
    upgrade with the expired key is refused 401; HTTP turns get 401 saying
    the key expired. A key that expires by the clock does the same.
    """
    names = [f"k-{entry}" for entry in ENTRYPOINTS] + ["prewarm"]
    keys = [keyEntry(n) for n in names] + [keyEntry("soon", expires_at=time.time() + 1.5)]
    stack = await tenantsStack(keys)
    driver = Driver(stack)
    ring = stack.app.keys
    try:
        for entry in ENTRYPOINTS:
            if entry.startswith("ws_"):
                assert (await driver.turn(entry, f"k-{entry}"))[0] == "ok"
        assert (await driver.turn("ws_ctx_pool", "soon"))[0] == "ok"
        assert (await driver.turn("ws_http_bridge", "prewarm"))[0] == "ok"
        past = time.time() - 1
        expired = {"k-ws_ctx_pool", "k-ws_http_bridge", "k-http_sse", "k-http_json", "k-chat",
                   "prewarm"}
        kept = [evolve(k, expires_at=past) if k.name in expired else k for k in ring.keys
                if k.name != "k-ws_passthrough"]
        ring.replace(kept)  # what a reload does
        for entry in ("ws_ctx_pool", "ws_http_bridge"):
            result = await driver.turn(entry, f"k-{entry}")
            assert result == ("refused", 1008, "api key expired"), (entry, result)
        # An http_bridge prewarm (answered by relay, no generation) is
        # refused like a turn (R102).
        prewarm = driver.sockets[("ws_http_bridge", "sk-prewarm")]
        events = await prewarm.turn({"type": "response.create", "model": "gpt-5.4-mini",
                                     "generate": False}, timeout=10)
        assert events[-1]["type"] == "__closed__" and events[-1]["code"] == 1008, events
        result = await driver.turn("ws_passthrough", "k-ws_passthrough")
        assert result == ("refused", 1008, "api key is no longer valid"), result
        for entry in ("http_sse", "http_json", "chat"):
            result = await driver.turn(entry, f"k-{entry}")
            assert result[:2] == ("refused", 401) and "expired at" in result[2], result
        driver.sockets.pop(("ws_ctx_pool", "sk-k-ws_ctx_pool"))
        result = await driver.turn("ws_ctx_pool", "k-ws_ctx_pool")
        assert result[:2] == ("refused", "upgrade"), result
        await deferLater(reactor, 1.6, lambda: None)
        result = await driver.turn("ws_ctx_pool", "soon")
        assert result == ("refused", 1008, "api key expired"), result
    finally:
        await driver.close()


GROUPED = [
    {"id": "pro", "credential": "sk-pro", "priority": 0},
    {"id": "c1", "credential": "sk-c1", "priority": 1},
    {"id": "c2", "credential": "sk-c2", "priority": 2},
]


@pytest_twisted.ensureDeferred
async def test_group_never_reaches_another_account_even_all_cooling():
    """
    A key bound to C{contractors: [c1, c2]}: served by c1 while the
    preferred C{pro} is healthy; fails over to c2 when c1 fails; with both
    rate-limited the key gets the group's own 429 with Retry-After (R83) on
    HTTP and close 1013 on the WebSocket, and C{pro} never saw one of its
    requests. An unbound key meanwhile uses C{pro}. C{/v1/models} and
    explain say the same.
    """
    keys = [keyEntry("contractor", group="contractors"), keyEntry("staff")]
    stack = await tenantsStack(keys, accounts=GROUPED, extra="groups: {contractors: [c1, c2]}\n",
                               emulatorConfig={"accounts": [
                                   {"name": a["id"], "credential": a["credential"]}
                                   for a in GROUPED]})
    driver = Driver(stack)
    try:
        assert (await driver.turn("http_json", "contractor"))[0] == "ok"
        assert (await driver.turn("http_json", "staff"))[0] == "ok"
        assert len(stack.emulator.requestsFor("sk-c1")) == 1
        assert len(stack.emulator.requestsFor("sk-pro")) == 1
        stack.emulator.setFault("sk-c1", {"kind": "status", "code": 503, "times": 1})
        assert (await driver.turn("http_sse", "contractor"))[0] == "ok"
        assert len(stack.emulator.requestsFor("sk-c2")) == 1
        for credential in ("sk-c1", "sk-c2"):
            stack.emulator.setFault(credential, {
                "kind": "status", "code": 429, "headers": {"retry-after": "30"},
                "body": {"error": {"message": "Rate limit reached", "type": "requests",
                                   "code": "rate_limit_exceeded"}}})
        before = len(stack.emulator.requestsFor("sk-pro"))
        result = await driver.turn("http_json", "contractor")
        assert result[:2] == ("refused", 429), result
        response, data = await stack.postJSON("/v1/responses", {"model": "gpt-5.5",
                                                                "input": "hi"},
                                              key="sk-contractor")
        assert response.code == 429, data
        retry = int(response.headers.getRawHeaders("retry-after")[0])
        assert 1 <= retry <= 30
        assert "rate-limited" in json.loads(data)["error"]["message"]
        result = await driver.turn("ws_ctx_pool", "contractor")
        assert result[:2] == ("refused", 1013), result
        assert len(stack.emulator.requestsFor("sk-pro")) == before
        assert (await driver.turn("http_json", "staff"))[0] == "ok"

        models = await treq.get(stack.url + "/v1/models",
                                headers={"Authorization": ["Bearer sk-contractor"]})
        assert (await models.json())["object"] == "list"
        explained = await adminGet(stack, "explain?key=contractor&model=gpt-5.5")
        verdicts = {a["id"]: a["verdict"] for a in explained["accounts"]}
        assert verdicts["pro"] == "not_in_group"
        assert verdicts["c1"].startswith("unschedulable") and verdicts["c2"].startswith(
            "unschedulable"), verdicts
        assert explained["decision"]["status"] == 429
    finally:
        await driver.close()


async def adminGet(stack, path: str) -> dict:
    response = await treq.get(stack.url + "/admin/" + path,
                              headers={"Authorization": [f"Bearer {ADMIN}"]})
    body = await response.json()
    assert response.code == 200, body
    return body


@pytest_twisted.ensureDeferred
async def test_sdk_retry_honours_retry_after():
    """
    The real C{openai} SDK (its own retries on) against a key at its RPM:
    relay's 429 says C{Retry-After: 3} (and C{retry-after-ms}); the SDK
    waits that long -- not its own half-second backoff -- and its retry
    succeeds. Without retries the SDK raises C{RateLimitError} carrying
    relay's headers. (With C{fallback_wait_timeout: 1}: relay itself waits
    for a window that frees sooner, R113, L{test_http_waits_for_the_window}.)
    """
    stack = await tenantsStack([keyEntry("sdk", rpm=1)],
                               gateway="{scheduling: {fallback_wait_timeout: 1}}")
    limiter = stack.app.extras["rateLimiter"]
    port = stack.port.getHost().port
    try:
        # The key's one request of this minute was made 57 s ago: the window
        # frees in 3 s.
        limiter._requests["sdk"] = __import__("collections").deque([reactor.seconds() - 57])

        def call(retries):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-sdk",
                                   max_retries=retries, timeout=20.0)
            started = time.monotonic()
            try:
                return client.responses.create(model="gpt-5.5", input="hi"), \
                    time.monotonic() - started
            except openai.RateLimitError as e:
                return e, time.monotonic() - started

        error, _ = await deferToThread(call, 0)
        assert isinstance(error, openai.RateLimitError)
        assert error.response.headers["retry-after"] == "3"
        assert 2000 <= int(error.response.headers["retry-after-ms"]) <= 3000
        assert error.response.headers["x-ratelimit-limit-requests"] == "1"
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert error.code == "rate_limit_exceeded"
        response, elapsed = await deferToThread(call, 2)
        assert response.status == "completed", response
        assert 1.9 <= elapsed < 10, elapsed
        records = (await adminGet(stack, "requests?key=sdk"))["requests"]
        assert [r["status"] for r in records][:2] == [200, 429]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_http_waits_for_the_window():
    """
    R113: a key at its C{rpm} whose window frees in 3 s, less than
    C{fallback_wait_timeout} (30 s): relay waits and serves the request,
    no 429: a stream is kept alive meanwhile (SSE comments first), the
    real SDK without retries gets its answer after about 3 s.
    """
    stack = await tenantsStack([keyEntry("wait", rpm=1)],
                               gateway="{stream_keepalive_interval: 1}")
    limiter = stack.app.extras["rateLimiter"]
    port = stack.port.getHost().port

    def full():
        # the key's one request of this minute was made 57 s ago
        limiter._requests["wait"] = __import__("collections").deque([reactor.seconds() - 57])

    try:
        full()
        started = time.monotonic()
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True}, key="sk-wait")
        assert response.code == 200
        assert 2 <= time.monotonic() - started < 10
        assert data.startswith(b":"), data[:40]  # keepalives while it waited
        assert sseEvents(data)[-1][0] == "response.completed", data[-300:]

        def call():
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-wait",
                                   max_retries=0, timeout=20.0)
            started = time.monotonic()
            return client.responses.create(model="gpt-5.5", input="hi"), \
                time.monotonic() - started

        full()
        response, elapsed = await deferToThread(call)
        assert response.status == "completed", response
        assert 2 <= elapsed < 10, elapsed
        records = (await adminGet(stack, "requests?key=wait"))["requests"]
        assert [r["status"] for r in records][:2] == [200, 200]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_request_log_and_explain_agree():
    """
    A turn that failed over is in C{/admin/requests}, found by the
    C{X-Request-Id} the client got, with both attempts, why the first was
    left, tokens, cost, the client's address and agent; filters by key,
    account and outcome find it; no prompt text is stored. Explain, asked
    before a turn, names the account the turn then gets.
    """
    accounts = [{"id": "first", "credential": "sk-first", "priority": 1},
                {"id": "second", "credential": "sk-second", "priority": 2}]
    stack = await tenantsStack([keyEntry("log")], accounts=accounts)
    try:
        stack.emulator.setFault("sk-first", {"kind": "status", "code": 503, "times": 1})
        response, data = await stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": "a secret prompt"}, key="sk-log",
            headers={"User-Agent": ["tenants-test/1"]})
        assert response.code == 200, data
        rid = response.headers.getRawHeaders("x-request-id")[0]
        [record] = (await adminGet(stack, f"requests?request_id={rid}"))["requests"]
        assert [(a["account"], a["status"], a["decision"]) for a in record["attempts"]] == [
            ("first", 503, "switch"), ("second", 200, "served")]
        assert (record["key"], record["account"], record["outcome"], record["status"]) == (
            "log", "second", "completed", 200)
        assert record["input_tokens"] == 120 and record["cost_usd"] == cost("gpt-5.5")
        assert record["client_ip"] == "127.0.0.1" and record["user_agent"] == "tenants-test/1"
        assert record["first_output_ms"] is not None and record["duration_ms"] >= 0
        assert "secret" not in json.dumps(record)
        for query in ("key=log", "account=first", "outcome=completed", "model=gpt-5.5"):
            found = (await adminGet(stack, "requests?" + query))["requests"]
            assert rid in [r["request_id"] for r in found], query

        explained = await adminGet(stack, "explain?key=log&model=gpt-5.5&session=s-1")
        response, _ = await stack.postJSON("/v1/responses", {"model": "gpt-5.5", "input": "x"},
                                           key="sk-log", headers={"session_id": ["s-1"]})
        rid = response.headers.getRawHeaders("x-request-id")[0]
        [record] = (await adminGet(stack, f"requests?request_id={rid}"))["requests"]
        assert explained["decision"]["account"] == record["account"] == "first"

        usage = await adminGet(stack, "usage?group_by=key")
        [row] = usage["rows"]
        assert row["cost_usd"] == round(2 * cost("gpt-5.5"), 9)
        metrics = stack.app.extras["metrics"].registry
        assert metrics.get_sample_value("relay_cost_usd_total", {
            "key": "log", "account": "second", "model": "gpt-5.5"}) == cost("gpt-5.5")
    finally:
        await stack.stop()
