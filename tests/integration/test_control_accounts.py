"""
Issue 21 over loopback with real relay processes and the emulator:

  - an API-key and an OAuth account added through the API while a stream
    runs on another account: the stream is untouched, the new accounts
    serve the next turns;
  - a paused account is never selected, and stays paused across a reload
    and a restart until enabled;
  - an admin account deleted during its running turn: the turn completes,
    the account takes no new one;
  - two relays on one Redis see every change (add, edit, pause, resume,
    delete) within a second;
  - no secret used in any of it shows in an answer or a log line.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred

from relay.emulator import Emulator
from tests.integration.harness import sseEvents
from tests.integration.oauthstack import sleep
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.relayproc import ADMIN, RelayProcess, writeConfig

SLOW = {"text": "a slow answer in many pieces", "delay": 0.06, "deltas": 30}
"""About two seconds of streaming."""

ADMIN_API_KEY = "sk-admin-added-secret-4b1e"
OAUTH_REFRESH = "rt-o-added-0"


def emulatorFor():
    return Emulator(reactor=reactor, config={
        "oauth": {"access_token_ttl": 3600},
        "accounts": [
            {"name": "slow", "credential": "sk-file-slow-secret", "script": SLOW},
            {"name": "fast", "credential": "sk-file-fast-secret"},
            {"name": "added", "credential": ADMIN_API_KEY},
            {"name": "slow-added", "credential": "sk-admin-slow-secret-9", "script": SLOW},
            {"name": "o-added", "type": "oauth", "refresh_token": OAUTH_REFRESH,
             "chatgpt_account_id": "acct-o-added"},
        ]})


class Relays:
    """
    One emulator and one or two relay processes sharing a config shape.
    """

    def __init__(self):
        self.answers = []
        self.processes = []
        self.turns = 0

    async def start(self, accounts, count=1, state=""):
        self.emulator = emulatorFor()
        await self.emulator.listen(reactor)
        self.tmp = tempfile.mkdtemp(prefix="relay-control-")
        for i in range(count):
            path = os.path.join(self.tmp, f"relay{i}.yaml")
            process = RelayProcess(config=path, log=os.path.join(self.tmp, f"relay{i}.log"))
            database = json.dumps(os.path.join(self.tmp, "relay.sqlite"))
            writeConfig(path, process.port, accounts(self.emulator),
                        extra=f"database: {database}\n{state}")
            process.start()
            self.processes.append(process)
        for process in self.processes:
            await process.waitHealthy()
        return self

    @property
    def relay(self):
        return self.processes[0]

    async def stop(self):
        for process in self.processes:
            process.stop()
        await self.emulator.stop()

    async def admin(self, method, path, body=None, process=None):
        process = process or self.relay
        r = await treq.request(
            method, process.url + "/admin/" + path,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": [f"Bearer {ADMIN}"], "Content-Type": ["application/json"]},
            persistent=False)
        raw = await r.content()
        self.answers.append(raw)
        return r.code, json.loads(raw) if raw else None

    async def view(self, process=None):
        code, body = await self.admin("GET", "accounts", process=process)
        assert code == 200, body
        return {a["id"]: a for a in body["accounts"]}

    async def turn(self, process=None):
        self.turns += 1
        code, raw = await (process or self.relay).post(
            {"model": "gpt-5.5", "input": f"conversation {self.turns}", "stream": True})
        self.answers.append(raw)
        return code, raw

    def served(self, name):
        return len([r for r in self.emulator.requestsFor(name) if r.kind == "request"])

    def assertNoSecret(self, *secrets):
        logs = ""
        for process in self.processes:
            with open(process.log, "rb") as f:
                logs += f.read().decode("utf-8", "replace")
        answers = b"\n".join(self.answers).decode("utf-8", "replace")
        secrets = [s for s in secrets if s]
        assert secrets
        for secret in secrets:
            assert secret not in answers, f"{secret[:8]}... in an answer"
            assert secret not in logs, f"{secret[:8]}... in a log line"


def fileAccounts(*names):
    def build(emulator):
        return [{"id": name, "type": "apikey", "api_key": f"sk-file-{name}-secret",
                 "base_url": emulator.baseURL("apikey"), "priority": 10 * (i + 1)}
                for i, name in enumerate(names)]
    return build


def completed(raw) -> bool:
    events = sseEvents(raw)
    return bool(events) and events[-1][0] == "response.completed"


@pytest_twisted.ensureDeferred
async def test_accounts_added_while_a_stream_runs():
    """
    While a stream runs on the file account, an API-key account and an
    OAuth account are added through the API: the stream completes
    untouched, each new account serves the next turn (the OAuth one
    refreshing its token through the emulator first), and neither the key
    nor a token shows in an answer or the log.
    """
    relays = await Relays().start(fileAccounts("slow"))
    try:
        stream = Deferred.fromCoroutine(relays.turn())
        await sleep(0.5)
        assert relays.served("slow") == 1
        code, body = await relays.admin("POST", "accounts", {
            "id": "added", "type": "apikey", "api_key": ADMIN_API_KEY, "priority": 1,
            "base_url": relays.emulator.baseURL("apikey")})
        assert code == 201, body
        code, body = await relays.admin("POST", "accounts", {
            "id": "o-added", "type": "oauth", "refresh_token": OAUTH_REFRESH, "priority": 2,
            "chatgpt_account_id": "acct-o-added", "base_url": relays.emulator.baseURL("oauth"),
            "auth_base_url": relays.emulator.baseURL("root")})
        assert code == 201, body
        assert not stream.called, "the stream should still be running"
        code, raw = await stream
        assert code == 200 and completed(raw), raw[-300:]
        assert b"response.failed" not in raw
        code, raw = await relays.turn()
        assert code == 200 and completed(raw)
        assert relays.served("added") == 1
        code, body = await relays.admin("POST", "accounts/added/disable")
        code, raw = await relays.turn()
        assert code == 200 and completed(raw), raw[-300:]
        assert relays.served("o-added") == 1
        view = await relays.view()
        assert (view["added"]["source"], view["o-added"]["source"], view["slow"]["source"]) == (
            "admin", "admin", "file")
        tokens = list(relays.emulator.oauth.accounts["o-added"].refreshTokens)
        bearers = [r.headers.get("authorization", "")[7:]
                   for r in relays.emulator.requestsFor("o-added")]
        relays.assertNoSecret(ADMIN_API_KEY, "sk-file-slow-secret", *tokens, *bearers)
    finally:
        await relays.stop()


@pytest_twisted.ensureDeferred
async def test_pause_is_never_selected_and_survives_reload_and_restart():
    """
    A paused file account (the preferred one) is never selected; after a
    reload and after a restart it is still paused; once enabled it serves.
    """
    relays = await Relays().start(fileAccounts("fast", "slow"))
    # Which account serves is the point here, not a running stream: "slow" answers at
    # once (its 2 s script cost 10 s over the five turns it serves).
    relays.emulator.setScript("slow", None)
    try:
        code, body = await relays.admin("POST", "accounts/fast/disable", {"reason": "maintenance"})
        assert code == 200 and body["account"]["paused"], body
        for _ in range(3):
            code, raw = await relays.turn()
            assert code == 200 and completed(raw)
        assert relays.served("fast") == 0
        code, body = await relays.admin("POST", "reload")
        assert code == 200 and body["applied"], body
        code, raw = await relays.turn()
        assert relays.served("fast") == 0
        relays.relay.stop()
        relays.relay.start()
        await relays.relay.waitHealthy()
        view = await relays.view()
        assert view["fast"]["paused"] and not view["fast"]["schedulable"], view["fast"]
        assert "maintenance" in view["fast"]["reason"]
        code, raw = await relays.turn()
        assert code == 200 and relays.served("fast") == 0
        code, body = await relays.admin("POST", "accounts/fast/enable")
        assert code == 200
        code, raw = await relays.turn()
        assert relays.served("fast") == 1
    finally:
        await relays.stop()


@pytest_twisted.ensureDeferred
async def test_delete_during_a_running_turn():
    """
    An admin account deleted while its turn streams: the turn completes,
    the account is gone, the next turn goes elsewhere.
    """
    relays = await Relays().start(fileAccounts("fast"))
    try:
        code, body = await relays.admin("POST", "accounts", {
            "id": "slow-added", "type": "apikey", "api_key": "sk-admin-slow-secret-9",
            "priority": 1, "base_url": relays.emulator.baseURL("apikey")})
        assert code == 201, body
        stream = Deferred.fromCoroutine(relays.turn())
        await sleep(0.5)
        assert relays.served("slow-added") == 1
        code, body = await relays.admin("DELETE", "accounts/slow-added")
        assert code == 200, body
        assert "slow-added" not in await relays.view()
        assert not stream.called
        code, raw = await stream
        assert code == 200 and completed(raw), raw[-300:]
        code, raw = await relays.turn()
        assert code == 200 and relays.served("slow-added") == 1 and relays.served("fast") == 1
        relays.assertNoSecret("sk-admin-slow-secret-9")
    finally:
        await relays.stop()


@pytest_twisted.ensureDeferred
async def test_two_relays_on_one_redis_see_every_change_within_a_second(redisServer):  # noqa: F811
    """
    Changes made through one relay reach the other within a second
    (pub/sub): an added account, an edit, a pause, a resume, a delete;
    the audit is shared.
    """
    redisServer.command("FLUSHALL")
    state = f"state: {{backend: redis, redis_url: '{redisServer.url}'}}\n"
    relays = await Relays().start(fileAccounts("fast"), count=2, state=state)
    first, second = relays.processes
    try:
        async def seen(predicate, what):
            started = reactor.seconds()
            while True:
                view = await relays.view(second)
                if predicate(view):
                    elapsed = reactor.seconds() - started
                    assert elapsed < 1.0, f"{what} took {elapsed:.2f} s to reach the other relay"
                    return elapsed
                if reactor.seconds() - started > 3:
                    raise AssertionError(f"{what} never reached the other relay")
                await sleep(0.02)

        timings = {}
        code, body = await relays.admin("POST", "accounts", {
            "id": "added", "type": "apikey", "api_key": ADMIN_API_KEY,
            "base_url": relays.emulator.baseURL("apikey"), "priority": 1}, process=first)
        assert code == 201, body
        timings["add"] = await seen(lambda v: "added" in v, "the new account")
        await relays.admin("PATCH", "accounts/added", {"priority": 7}, process=first)
        timings["edit"] = await seen(lambda v: v["added"]["priority"] == 7, "the edit")
        await relays.admin("POST", "accounts/fast/disable", process=first)
        timings["pause"] = await seen(lambda v: v["fast"]["paused"], "the pause")
        code, raw = await relays.turn(process=second)
        assert code == 200 and relays.served("fast") == 0 and relays.served("added") == 1
        await relays.admin("POST", "accounts/fast/enable", process=first)
        timings["resume"] = await seen(lambda v: not v["fast"]["paused"], "the resume")
        await relays.admin("DELETE", "accounts/added", process=first)
        timings["delete"] = await seen(lambda v: "added" not in v, "the delete")
        code, body = await relays.admin("GET", "audit", process=second)
        assert [e["action"] for e in body["audit"]][:5] == [
            "account.delete", "account.enable", "account.disable", "account.update",
            "account.create"]
        print("propagation to the other relay (s):", json.dumps(
            {k: round(v, 3) for k, v in timings.items()}))
        relays.assertNoSecret(ADMIN_API_KEY)
    finally:
        await relays.stop()


@pytest_twisted.ensureDeferred
async def test_idle_oauth_account_usage_is_probed():
    """
    An idle OAuth account's windows are read from the emulator's
    C{wham/usage} by the relay process itself (no traffic on it), with
    their resets, and shown in the view with source C{probe}.
    """
    def accounts(emulator):
        emulator.setUsage("o-added", {"primary_used_percent": 37, "secondary_used_percent": 5})
        return [{"id": "o-idle", "type": "oauth", "base_url": emulator.baseURL("oauth"),
                 "access_token": emulator.mintAccessToken("o-added", 3600),
                 "chatgpt_account_id": "acct-o-added",
                 "auth_base_url": emulator.baseURL("root")}]

    relays = await Relays().start(accounts)
    try:
        for _ in range(100):
            usage = (await relays.view())["o-idle"].get("usage")
            if usage:
                break
            await sleep(0.1)
        assert usage and usage["source"] == "probe", usage
        assert (usage["primary"]["used_percent"], usage["secondary"]["used_percent"]) == (37, 5)
        assert usage["primary"]["reset_at"] > reactor.seconds()
        probes = [r for r in relays.emulator.requestsFor("o-added")
                  if r.path == "/backend-api/wham/usage"]
        assert len(probes) == 1
        assert probes[0].headers["chatgpt-account-id"] == "acct-o-added"
    finally:
        await relays.stop()
