"""
Issue 22 item 1 end to end: client keys issued, disabled and revoked over
the admin API of real relay processes (L{tests.integration.relayproc}) on
loopback, with the bundled emulator as upstream:

  - an issued key serves every entrypoint (HTTP SSE, JSON, chat,
    C{/v1/models}, the three WebSocket modes); the digest stored in the
    SQLite file (what a stolen database holds) is refused on every one of
    them; revoking the key refuses the next HTTP request (401) and the next
    C{response.create} of each open socket (close 1008) in all three modes;
  - a file key disabled through the API stays disabled across a reload and
    a restart until enabled; an issued key survives a restart;
  - two relay processes on one real C{redis-server}: a key issued, edited,
    disabled, enabled and revoked on one is in force on the other within a
    second (the change feed), including on the other's open sockets; prices
    set on one are the other's;
  - no issued secret in any answer (but the one that issued it), log line,
    the request log, the audit or the database file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
from types import SimpleNamespace

import pytest_twisted
import treq
from twisted.internet import reactor

from relay.emulator import Emulator
from tests.integration.harness import sseEvents
from tests.integration.oauthstack import sleep
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.relayproc import ADMIN, KEY, RelayProcess, writeConfig
from tests.integration.test_ws_turns import connect

#: entrypoint -> the model that routes it (a WebSocket's mode follows the
#: account that serves the model).
MODELS = {"ws_ctx_pool": "gpt-5.5", "ws_passthrough": "gpt-4.1",
          "ws_http_bridge": "gpt-5.4-mini"}


def accountsFor(emulator):
    base = emulator.baseURL("apikey")
    return [
        {"id": "api", "type": "apikey", "api_key": "sk-keys-api", "base_url": base,
         "models": ["gpt-5.5"], "concurrency": 0},
        {"id": "pass", "type": "apikey", "api_key": "sk-keys-pass", "base_url": base,
         "models": ["gpt-4.1"], "ws_mode": "passthrough", "concurrency": 0},
        {"id": "bridge", "type": "apikey", "api_key": "sk-keys-bridge", "base_url": base,
         "models": ["gpt-5.4-mini"], "ws_mode": "http_bridge", "concurrency": 0},
    ]


class Relays:
    """
    The emulator and one or two relay processes (one SQLite file, or one
    Redis), every answer kept for the secret check.
    """

    def __init__(self):
        self.answers = []
        self.processes = []
        self.sockets = []

    async def start(self, count=1, state=""):
        self.emulator = Emulator(reactor=reactor, config={"accounts": [
            {"name": n, "credential": f"sk-keys-{n}"} for n in ("api", "pass", "bridge")]})
        await self.emulator.listen(reactor)
        self.tmp = tempfile.mkdtemp(prefix="relay-keys-")
        self.database = os.path.join(self.tmp, "relay.sqlite")
        for i in range(count):
            path = os.path.join(self.tmp, f"relay{i}.yaml")
            process = RelayProcess(config=path, log=os.path.join(self.tmp, f"relay{i}.log"))
            writeConfig(path, process.port, accountsFor(self.emulator),
                        extra=f"database: {json.dumps(self.database)}\n{state}")
            process.start()
            self.processes.append(process)
        for process in self.processes:
            await process.waitHealthy()
        return self

    async def stop(self):
        for client in self.sockets:
            client.bye()
        for process in self.processes:
            await process.shutdown()
        await self.emulator.stop()

    async def admin(self, method, path, body=None, process=None):
        process = process or self.processes[0]
        r = await treq.request(
            method, process.url + "/admin/" + path,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": [f"Bearer {ADMIN}"], "Content-Type": ["application/json"]},
            persistent=False)
        raw = await r.content()
        self.answers.append(raw)
        return r.code, json.loads(raw) if raw else None

    async def issue(self, name, process=None, **policy):
        code, body = await self.admin("POST", "keys", dict({"name": name}, **policy), process)
        assert code == 201, body
        # The one answer that holds the secret is not kept for the check.
        self.answers.pop()
        return body["secret"]

    async def http(self, entry, secret, process=None, header="authorization"):
        """
        One HTTP turn. @return: C{(status, body)}.
        """
        process = process or self.processes[0]
        headers = {"Content-Type": ["application/json"]}
        if header == "authorization":
            headers["Authorization"] = [f"Bearer {secret}"]
        else:
            headers["x-api-key"] = [secret]
        if entry == "models":
            r = await treq.get(process.url + "/v1/models", headers=headers, persistent=False)
        elif entry == "retrieve":
            r = await treq.get(process.url + "/v1/responses/resp_abc", headers=headers,
                               persistent=False)
        elif entry == "chat":
            r = await treq.post(process.url + "/v1/chat/completions", json.dumps(
                {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}],
                 "stream": True}).encode(), headers=headers, persistent=False)
        else:
            r = await treq.post(process.url + "/v1/responses", json.dumps(
                {"model": "gpt-5.5", "input": "hi", "stream": entry == "http_sse"}).encode(),
                headers=headers, persistent=False)
        raw = await r.content()
        self.answers.append(raw)
        if r.code == 200 and entry == "http_sse":
            assert sseEvents(raw)[-1][0] == "response.completed", raw[-300:]
        return r.code, raw

    async def socket(self, secret, process=None):
        process = process or self.processes[0]
        at = SimpleNamespace(port=SimpleNamespace(getHost=lambda: SimpleNamespace(
            port=process.port)))
        client = await connect(at, key=secret)
        self.sockets.append(client)
        return client

    async def wsTurn(self, client, entry) -> tuple:
        """
        @return: C{("ok", None)} or C{("closed", (code, reason))}.
        """
        events = await client.turn({"type": "response.create", "model": MODELS[entry],
                                    "input": "hi"}, timeout=10)
        self.answers.append(json.dumps(events).encode())
        last = events[-1]
        if last["type"] == "error" and not last.get("status"):
            # R81: information without a status, then the close.
            last = await client.next(10)
        if last["type"] == "response.completed":
            return ("ok", None)
        if last["type"] == "__closed__":
            return ("closed", (last["code"], last["reason"]))
        return ("other", last)

    async def upgradeRefused(self, secret, process=None) -> bool:
        try:
            client = await self.socket(secret, process)
        except Exception as e:
            return "401" in str(e) or "handshake" in str(e)
        client.bye()
        return False

    async def within(self, check, what, limit=1.0):
        """
        Poll C{check} until it is true; it must be within C{limit} seconds.

        @return: the seconds it took.
        """
        started = reactor.seconds()
        while True:
            if await check():
                elapsed = reactor.seconds() - started
                assert elapsed < limit, f"{what} took {elapsed:.2f} s"
                return elapsed
            if reactor.seconds() - started > limit + 3:
                raise AssertionError(f"{what} never happened")
            await sleep(0.02)

    def assertNoSecret(self, *secrets):
        logs = ""
        for process in self.processes:
            with open(process.log, "rb") as f:
                logs += f.read().decode("utf-8", "replace")
        answers = b"\n".join(self.answers).decode("utf-8", "replace")
        stored = b""
        if os.path.exists(self.database):
            with open(self.database, "rb") as f:
                stored = f.read()
        assert secrets
        for secret in secrets:
            assert secret not in answers, f"{secret[:12]}... in an answer"
            assert secret not in logs, f"{secret[:12]}... in a log line"
            assert secret.encode() not in stored, f"{secret[:12]}... in the database file"


HTTP_ENTRIES = ("http_sse", "http_json", "chat", "models")


@pytest_twisted.ensureDeferred
async def test_issued_key_serves_stolen_digest_refused_revoked_everywhere():
    """
    An issued key serves HTTP (SSE, JSON, chat, models) and the three
    WebSocket modes; the digest the database holds is a 401 on each (and a
    refused upgrade); once revoked, the next HTTP request is a 401 and the
    next turn of every open socket a close 1008; no secret anywhere.
    """
    relays = await Relays().start()
    try:
        secret = await relays.issue("alice", label="alice's laptop")
        for entry in HTTP_ENTRIES:
            code, raw = await relays.http(entry, secret)
            assert code == 200, (entry, raw[:300])
        sockets = {}
        for entry in MODELS:
            sockets[entry] = await relays.socket(secret)
            assert await relays.wsTurn(sockets[entry], entry) == ("ok", None), entry

        with sqlite3.connect(relays.database) as db:
            [(data,)] = db.execute(
                "SELECT data FROM control_records WHERE kind = 'key'").fetchall()
        digest = json.loads(data)["digest"]
        assert len(digest) == 64
        for stolen in (digest, digest.upper()):
            for entry in HTTP_ENTRIES + ("retrieve",):
                code, raw = await relays.http(entry, stolen)
                assert code == 401, (entry, raw[:200])
                assert json.loads(raw)["error"]["code"] == "invalid_api_key"
            code, _ = await relays.http("http_json", stolen, header="x-api-key")
            assert code == 401
            assert await relays.upgradeRefused(stolen)

        code, body = await relays.admin("DELETE", "keys/alice")
        assert (code, body) == (200, {"deleted": "alice"})
        for entry in HTTP_ENTRIES:
            code, raw = await relays.http(entry, secret)
            assert code == 401, (entry, raw[:200])
        for entry, client in sockets.items():
            result = await relays.wsTurn(client, entry)
            assert result == ("closed", (1008, "api key is no longer valid")), (entry, result)
        assert await relays.upgradeRefused(secret)

        code, body = await relays.admin("GET", "audit")
        actions = [e["action"] for e in body["audit"]]
        assert actions[:2] == ["key.delete", "key.create"], actions
        await relays.admin("GET", "requests?key=alice")
        await relays.admin("GET", "keys")
        r = await treq.get(relays.processes[0].url + "/admin/", persistent=False)
        relays.answers.append(await r.content())
        relays.assertNoSecret(secret)
    finally:
        await relays.stop()


@pytest_twisted.ensureDeferred
async def test_file_key_disable_survives_reload_and_restart():
    """
    A file key disabled through the API is refused (401 saying so) after a
    reload and after a restart, until enabled; an issued key and its
    policy, the API's prices and groups survive the restart.
    """
    relays = await Relays().start()
    try:
        secret = await relays.issue("bob", models=["gpt-5.5"])
        code, _ = await relays.admin("POST", "keys/proc/disable", {"reason": "rotating"})
        assert code == 200
        code, raw = await relays.http("http_json", KEY)
        assert code == 401 and json.loads(raw)["error"]["code"] == "api_key_disabled", raw
        code, body = await relays.admin("POST", "reload")
        assert code == 200, body
        assert (await relays.http("http_json", KEY))[0] == 401
        assert (await relays.admin("PUT", "prices/o3", {"input": 3, "output": 4}))[0] == 200
        assert (await relays.admin("PUT", "groups/ws", {"accounts": ["pass", "bridge"]}))[0] == 201
        process = relays.processes[0]
        process.stop()
        process.start()
        await process.waitHealthy()
        code, raw = await relays.http("http_json", KEY)
        assert code == 401 and b"disabled" in raw, raw
        assert (await relays.http("http_json", secret))[0] == 200
        code, body = await relays.admin("GET", "keys/bob")
        assert body["key"]["policy"]["models"] == ["gpt-5.5"]
        assert body["key"]["usage"]["today"]["requests"] == 1, body
        code, body = await relays.admin("GET", "prices")
        assert body["prices"]["o3"] == {"input": 3, "cached_input": 3, "output": 4,
                                        "reasoning": 4, "source": "admin"}
        code, body = await relays.admin("GET", "groups/ws")
        assert (body["group"]["source"], body["group"]["accounts"]) == ("admin",
                                                                       ["pass", "bridge"])
        code, _ = await relays.admin("POST", "keys/proc/enable")
        assert code == 200
        assert (await relays.http("http_json", KEY))[0] == 200
        relays.assertNoSecret(secret)
    finally:
        await relays.stop()


@pytest_twisted.ensureDeferred
async def test_two_relays_on_one_redis_apply_key_changes_within_a_second(redisServer):  # noqa: F811
    """
    A key issued on one relay serves on the other within a second; a
    policy edit, a disable, an enable and a revocation too -- the revoked
    key's open sockets on the other relay (all three modes) are closed 1008
    on their next turn; prices set on one are the other's.
    """
    redisServer.command("FLUSHALL")
    state = f"state: {{backend: redis, redis_url: '{redisServer.url}'}}\n"
    relays = await Relays().start(count=2, state=state)
    first, second = relays.processes
    timings = {}
    try:
        secret = await relays.issue("carol", process=first)

        async def serves():
            return (await relays.http("http_json", secret, second))[0] == 200

        timings["issue"] = await relays.within(serves, "the new key on the other relay")
        sockets = {}
        for entry in MODELS:
            sockets[entry] = await relays.socket(secret, second)
            assert await relays.wsTurn(sockets[entry], entry) == ("ok", None), entry

        await relays.admin("PATCH", "keys/carol", {"models": ["gpt-4.1"]}, first)

        async def narrowed():
            return (await relays.http("http_json", secret, second))[0] == 403

        timings["edit"] = await relays.within(narrowed, "the edit on the other relay")
        await relays.admin("PATCH", "keys/carol", {"models": None}, first)
        await relays.admin("POST", "keys/carol/disable", {}, first)

        async def refused():
            return (await relays.http("http_json", secret, second))[0] == 401

        timings["disable"] = await relays.within(refused, "the disable on the other relay")
        await relays.admin("POST", "keys/carol/enable", {}, first)
        timings["enable"] = await relays.within(serves, "the enable on the other relay")

        await relays.admin("DELETE", "keys/carol", process=first)
        timings["revoke"] = await relays.within(refused, "the revocation on the other relay")
        for entry, client in sockets.items():
            result = await relays.wsTurn(client, entry)
            assert result == ("closed", (1008, "api key is no longer valid")), (entry, result)

        code, _ = await relays.admin("PUT", "prices/o3", {"input": 3, "output": 4}, first)
        assert code == 200

        async def priced():
            code, body = await relays.admin("GET", "prices", process=second)
            return body["prices"]["o3"]["source"] == "admin"

        timings["prices"] = await relays.within(priced, "the prices on the other relay")
        code, body = await relays.admin("GET", "audit", process=second)
        assert [e["action"] for e in body["audit"]][:6] == [
            "prices.set", "key.delete", "key.enable", "key.disable", "key.update", "key.update"]
        print("propagation to the other relay (s):",
              json.dumps({k: round(v, 3) for k, v in timings.items()}))
        relays.assertNoSecret(secret)
    finally:
        await relays.stop()
