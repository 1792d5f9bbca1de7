"""
The console's admin API on a real relay and the emulator: usage over time
and its CSV (the buckets sum to the totals), the request log as CSV, the
overview, health that tells the truth (an account that failed 7 times and
whose cooldown lapsed is "failing", and explain says so; a client's 400 is
never the account's last error), the credential test (API key and OAuth),
the duplicate identity warning, and the console's polling logged at debug.
"""

from __future__ import annotations

import csv
import io
import json

import pytest_twisted
import treq
from twisted.logger import LogLevel, globalLogPublisher

from tests.integration.harness import closedPort, startStack
from tests.integration.oauthstack import emulatorConfig, oauthAccount
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)

ADMIN = "adm-console-key-0000"
EXTRA = f"admin_key: {ADMIN}\n"


async def admin(stack, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    r = await treq.request(method, stack.url + path, data=data,
                           headers={"Authorization": [f"Bearer {ADMIN}"]})
    return r, await r.content()


async def adminJSON(stack, method, path, body=None):
    r, raw = await admin(stack, method, path, body)
    return r.code, json.loads(raw)


async def turn(stack, key=None, **body):
    body = dict({"model": "gpt-5.5", "input": "hi", "stream": False}, **body)
    kw = {"key": key} if key else {}
    r, data = await stack.postJSON("/v1/responses", body, **kw)
    return r.code, data


def sums(body):
    """
    Every series' points sum to its total; the totals to the answer's.
    """
    fields = [n for n in body["total"] if n not in ("failures", "cost_usd")]
    for series in body["series"]:
        assert len(series["points"]) == len(body["buckets"])
        for name in fields:
            assert sum(p[name] for p in series["points"]) == series["total"][name], name
    for name in fields:
        assert sum(s["total"][name] for s in body["series"]) == body["total"][name], name


@pytest_twisted.ensureDeferred
async def test_usage_series_csv_and_overview_after_traffic():
    """
    Traffic of two keys, one failed turn: the series per key sums to its
    totals and matches C{/admin/usage}; its CSV and the request log's CSV
    parse; the overview counts the attempts and the spend.
    """
    keys = json.dumps([{"name": "alice", "key": "sk-relay-alice", "concurrency": 0},
                       {"name": "bob", "key": "sk-relay-bob", "concurrency": 0}])
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], keys=keys, extra=EXTRA)
    try:
        for key in ("sk-relay-alice", "sk-relay-alice", "sk-relay-bob"):
            code, _ = await turn(stack, key)
            assert code == 200
        stack.emulator.setFault("sk-a1", {"kind": "status", "preset": "server_error",
                                          "times": 1})
        stack.app.settings.apply({"max_account_switches": 0})
        code, _ = await turn(stack, "sk-relay-bob")
        assert code >= 500
        code, body = await adminJSON(stack, "GET", "/admin/usage/series?group_by=key")
        assert code == 200, body
        assert len(body["buckets"]) == 24
        sums(body)
        byKey = {s["group"]: s["total"] for s in body["series"]}
        assert byKey["alice"]["requests"] == 2 and byKey["alice"]["usage_requests"] == 2
        assert byKey["bob"]["requests"] == 2 and byKey["bob"]["failed"] == 1
        assert body["total"]["failed"] == 1 and sum(body["total"]["failures"].values()) == 1
        code, totals = await adminJSON(stack, "GET", "/admin/usage?group_by=key")
        assert {r["key"]: r["input_tokens"] for r in totals["rows"]} == {
            k: v["input_tokens"] for k, v in byKey.items()}
        r, raw = await admin(stack, "GET", "/admin/usage/series?group_by=key&format=csv")
        assert r.headers.getRawHeaders(b"content-type") == [b"text/csv; charset=utf-8"]
        rows = list(csv.DictReader(io.StringIO(raw.decode())))
        assert sum(int(row["requests"]) for row in rows) == 4
        assert sum(int(row["input_tokens"]) for row in rows) == body["total"]["input_tokens"]
        r, raw = await admin(stack, "GET", "/admin/requests?format=csv")
        rows = list(csv.DictReader(io.StringIO(raw.decode())))
        assert len(rows) == 4 and {row["key"] for row in rows} == {"alice", "bob"}
        assert sorted(row["outcome"] for row in rows).count("completed") == 3
        code, overview = await adminJSON(stack, "GET", "/admin/overview")
        assert code == 200, overview
        assert overview["capacity"]["accounts"] == 1
        assert sum(m["requests"] for m in overview["per_minute"]) == 4
        assert sum(m["failed"] for m in overview["per_minute"]) == 1
        assert overview["tokens_today"] == body["total"]["total_tokens"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_failing_account_shown_failing_and_explained():
    """
    An account that failed 7 times and whose cooldown lapsed is
    schedulable but shown C{failing}, not C{ok}; explain picks it only with
    a warning saying so; the breaker shows what it counts now.
    """
    accounts = [{"id": "flaky", "credential": "sk-flaky", "priority": 1},
                {"id": "good", "credential": "sk-good", "priority": 50}]
    stack = await startStack(accounts, extra=EXTRA)
    try:
        stack.emulator.setFault("sk-flaky", {"kind": "status", "preset": "server_error"})
        for n in range(7):
            # A new conversation each time (no session binding to "good").
            code, _ = await turn(stack, input=f"question {n}")
            assert code == 200
            # The cooldown lapses (as it would with time).
            await stack.app.health.clear("flaky")
        code, body = await adminJSON(stack, "GET", "/admin/accounts")
        rows = {r["id"]: r for r in body["accounts"]}
        flaky = rows["flaky"]
        assert flaky["schedulable"] is True
        assert flaky["health"]["state"] == "failing", flaky["health"]
        assert (flaky["health"]["failed"], flaky["health"]["succeeded"]) == (7, 0)
        assert "7 of 7 attempts failed" in flaky["health"]["why"]
        assert rows["good"]["health"]["state"] == "ok"
        code, answer = await adminJSON(stack, "GET", "/admin/explain?key=test&model=gpt-5.5")
        assert code == 200, answer
        assert answer["decision"]["account"] == "flaky"
        assert answer["decision"]["health_state"] == "failing"
        assert [w["code"] for w in answer["warnings"]] == ["chosen_failing"]
        explained = {r["id"]: r for r in answer["accounts"]}
        assert "failing" in explained["flaky"]["why"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_client_400_is_not_the_accounts_last_error():
    """
    An upstream 400 about the client's request goes to the client and is
    counted as a client fault: the account's C{last_error} stays empty and
    it stays C{ok}.
    """
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], extra=EXTRA)
    try:
        code, _ = await turn(stack)
        assert code == 200
        stack.emulator.setFault("sk-a1", {"kind": "status", "code": 400, "times": 1, "body": {
            "error": {"message": "Invalid value for 'temperature': must be at most 2.",
                      "type": "invalid_request_error", "param": "temperature",
                      "code": "invalid_value"}}})
        code, _ = await turn(stack, temperature=3)
        assert code == 400
        code, body = await adminJSON(stack, "GET", "/admin/accounts")
        [row] = body["accounts"]
        assert row["last_error"] is None, row["last_error"]
        assert row["health"]["client_faults"] == 1
        assert row["health"]["state"] == "ok"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_credential_test_action():
    """
    C{POST /admin/accounts/{id}/test}: an API key lists the emulator's
    models, an unreachable one says so, an OAuth account reads its usage;
    each is audited.
    """
    def accounts(emulator):
        return [{"id": "k1", "credential": "sk-k1"},
                {"id": "dead", "credential": "sk-dead",
                 "base_url": f"http://127.0.0.1:{closedPort()}/v1"},
                oauthAccount(emulator, "o1")]

    stack = await startStack(accounts, emulatorConfig=emulatorConfig(("o1",)), extra=EXTRA)
    try:
        code, body = await adminJSON(stack, "POST", "/admin/accounts/k1/test")
        assert code == 200, body
        assert (body["ok"], body["check"], body["status"]) == (True, "models", 200)
        assert "gpt-5.5" in body["models"]
        code, body = await adminJSON(stack, "POST", "/admin/accounts/dead/test")
        assert (code, body["ok"], body["error"]["code"]) == (200, False, "unreachable")
        code, body = await adminJSON(stack, "POST", "/admin/accounts/o1/test")
        assert (code, body["ok"], body["check"]) == (200, True, "usage"), body
        assert body["usage"]["primary"] is not None
        assert "sk-k1" not in json.dumps(body)
        code, _ = await adminJSON(stack, "POST", "/admin/accounts/nope/test")
        assert code == 404
        code, audit = await adminJSON(stack, "GET", "/admin/audit")
        assert [e["action"] for e in audit["audit"]][:3] == ["account.test"] * 3
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_duplicate_identity_and_pause_reason():
    """
    Adding an OAuth account whose ChatGPT identity is in the pool answers
    a C{duplicate_identity} warning; a pause keeps and shows its reason.
    """
    def accounts(emulator):
        return [oauthAccount(emulator, "o1")]

    stack = await startStack(accounts, emulatorConfig=emulatorConfig(("o1",)), extra=EXTRA)
    try:
        token = stack.emulator.mintAccessToken("o1", 600)
        code, body = await adminJSON(stack, "POST", "/admin/accounts", {
            "id": "again", "type": "oauth", "access_token": token,
            "base_url": stack.emulator.baseURL("oauth")})
        assert code == 201, body
        [warning] = body["warnings"]
        assert (warning["code"], warning["accounts"]) == ("duplicate_identity", ["o1"])
        assert warning["email"] == "o1@emulator.invalid"
        code, body = await adminJSON(stack, "POST", "/admin/accounts/o1/disable",
                                     {"reason": "billing review"})
        assert code == 200, body
        code, body = await adminJSON(stack, "GET", "/admin/accounts")
        row = {r["id"]: r for r in body["accounts"]}["o1"]
        assert (row["paused_reason"], row["health"]["state"]) == ("billing review", "paused")
        code, audit = await adminJSON(stack, "GET", "/admin/audit?account=o1")
        assert audit["audit"][0]["detail"]["reason"] == "billing review"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_console_polling_is_debug():
    """
    The console's reads are access-logged at debug; a client turn at info.
    """
    events = []
    globalLogPublisher.addObserver(events.append)
    stack = await startStack([{"id": "a1", "credential": "sk-a1"}], extra=EXTRA)
    try:
        for path in ("/admin/accounts", "/admin/overview", "/admin/usage/series"):
            r, _ = await admin(stack, "GET", path)
            assert r.code == 200
        await turn(stack)
    finally:
        await stack.stop()
        globalLogPublisher.removeObserver(events.append)
    access = [e for e in events if e.get("event") == "relay.http_access"]
    levels = {e["path"]: e["log_level"] for e in access}
    assert levels["/admin/accounts"] == LogLevel.debug
    assert levels["/admin/usage/series"] == LogLevel.debug
    assert levels["/v1/responses"] == LogLevel.info




@pytest_twisted.ensureDeferred
async def test_usage_series_on_redis(redisServer):  # noqa: F811
    """
    With C{state.backend: redis} (a real C{redis-server}) the series reads
    the hour hashes and the request log stream in one aggregated read each:
    the buckets sum to the totals, and match C{/admin/usage}.
    """
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint

    from relay.configuration.parse import settingsFromString
    from relay.emulator import Emulator
    from relay.process.app import buildApplication
    from tests.integration.harness import RELAY_KEY, accountsYAML

    redisServer.command("FLUSHALL")
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    keys = json.dumps([{"name": "team", "key": RELAY_KEY, "concurrency": 0}])
    text = ('listen: "tcp:0:interface=127.0.0.1"\n'
            f"keys: {keys}\n"
            f"accounts: {accountsYAML(emulator, [{'id': 'api', 'credential': 'sk-api'}])}\n"
            f"{EXTRA}"
            f"state: {{backend: redis, redis_url: '{redisServer.url}'}}\n")
    app = buildApplication(settingsFromString(text), reactor)
    app.services[0].startService()
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(app.site)

    class _Stack:
        url = f"http://127.0.0.1:{port.getHost().port}"

    try:
        for n in range(3):
            r = await treq.post(_Stack.url + "/v1/responses", json.dumps(
                {"model": "gpt-5.5", "input": f"hi {n}"}).encode(),
                headers={"Authorization": [f"Bearer {RELAY_KEY}"],
                         "Content-Type": ["application/json"]}, persistent=False)
            await r.content()
            assert r.code == 200
        code, body = await adminJSON(_Stack, "GET", "/admin/usage/series?range=7d&group_by=model")
        assert code == 200, body
        sums(body)
        [series] = body["series"]
        assert (series["group"], series["total"]["requests"],
                series["total"]["usage_requests"]) == ("gpt-5.5", 3, 3)
        code, totals = await adminJSON(_Stack, "GET", "/admin/usage?group_by=model")
        assert totals["rows"][0]["input_tokens"] == series["total"]["input_tokens"] > 0
    finally:
        await port.stopListening()
        await app.services[0].stopService()
        await app.dialer.close()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_browser_login_paste_retry_and_duplicate_identity():
    """
    A browser login against the emulator: a paste without a code leaves it
    pending; the right paste completes it with a C{duplicate_identity}
    warning (the emulated login is in the pool already); another login is
    cancelled with C{POST .../cancel}.
    """
    from urllib.parse import parse_qsl, urlsplit

    def accounts(emulator):
        return [oauthAccount(emulator, "o1")]

    stack = await startStack(accounts, emulatorConfig=emulatorConfig(("o1",)), extra=EXTRA)
    try:
        root = stack.emulator.baseURL("root")
        code, body = await adminJSON(stack, "POST", "/admin/logins", {
            "flow": "browser", "account": {"id": "new1", "auth_base_url": root,
                                           "base_url": stack.emulator.baseURL("oauth")}})
        assert code == 201, body
        login = body["login"]
        code, body = await adminJSON(stack, "POST", f"/admin/logins/{login['id']}/complete",
                                     {"redirect_url": "http://localhost:1455/auth/callback?x=1"})
        assert (code, body["error"]["code"], body["login"]["status"]) == (
            400, "no_code", "pending")
        code, body = await adminJSON(stack, "GET", f"/admin/logins/{login['id']}")
        assert (body["login"]["status"], body["login"]["paste_attempts"]) == ("pending", 1)
        params = dict(parse_qsl(urlsplit(login["authorize_url"]).query))
        params["account"] = "o1"
        r = await treq.post(root + "/oauth/authorize/decision", data=params,
                            allow_redirects=False)
        await r.content()
        assert r.code == 302
        location = r.headers.getRawHeaders(b"location")[0].decode()
        code, body = await adminJSON(stack, "POST", f"/admin/logins/{login['id']}/complete",
                                     {"redirect_url": location})
        assert code == 200, body
        assert body["login"]["status"] == "completed"
        [warning] = body["warnings"]
        assert (warning["code"], warning["accounts"]) == ("duplicate_identity", ["o1"])
        code, body = await adminJSON(stack, "POST", "/admin/logins", {
            "flow": "browser", "account": {"id": "new2", "auth_base_url": root,
                                           "base_url": stack.emulator.baseURL("oauth")}})
        code, body = await adminJSON(stack, "POST", f"/admin/logins/{body['login']['id']}/cancel")
        assert (code, body["login"]["status"]) == (200, "cancelled")
    finally:
        await stack.stop()
