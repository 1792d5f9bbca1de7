"""
Live reload through a real relay on loopback against the real emulator
(issue 14): C{POST /admin/reload} re-reads the file; new accounts and keys
serve at once, removed ones take no new turn while their running turns
finish, a bad file changes nothing, a changed credential applies to the
next attempt while account state survives, a changed account's pooled
upstream WebSockets are retired and an unchanged one's kept, and a
WebSocket opened with a removed key takes no new turn. C{SIGHUP} on a real
C{twistd} subprocess does the same.
"""

from __future__ import annotations

import json
import os
import sys

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.error import ProcessDone
from twisted.internet.task import deferLater

from relay.process.app import buildApplication
from relay.configuration.parse import loadConfig
from relay.emulator import Emulator
from tests.integration.harness import Stack, sseEvents
from tests.integration.test_twistd import Collector, environment
from tests.integration.test_ws_turns import connect
from tests.integration.test_ws_turns import drain as closeWebSockets

ADMIN = "sk-admin-reload-test-0000"
K1 = "sk-relay-reload-one"
K2 = "sk-relay-reload-two"


def configText(emulator, database, accounts, keys, gateway="{}", extra="") -> str:
    """
    A relay configuration whose accounts point at C{emulator}.

    @param accounts: C{(id, credential, extra fields)} tuples.
    @param keys: C{(name, secret)} tuples.
    """
    rendered = [
        {"id": i, "type": "apikey", "base_url": emulator.baseURL("apikey"), "api_key": c, **more}
        for i, c, more in accounts
    ]
    return (
        'listen: "tcp:0:interface=127.0.0.1"\n'
        f"admin_key: {ADMIN}\n"
        f"database: {json.dumps(database)}\n"
        f"keys: {json.dumps([{'name': n, 'key': k, 'concurrency': 0} for n, k in keys])}\n"
        f"accounts: {json.dumps(rendered)}\n"
        f"gateway: {gateway}\n"
        f"{extra}"
    )


class Reloadable:
    """
    A relay built from a file, listening on loopback, and its emulator.
    """

    def __init__(self, directory):
        self.directory = str(directory)
        self.path = os.path.join(self.directory, "relay.yaml")
        self.database = os.path.join(self.directory, "settings.sqlite")
        self.stack = None

    def write(self, accounts, keys=(("one", K1),), gateway="{}", extra="", text=None):
        """
        (Re)write the configuration file.
        """
        if text is None:
            text = configText(
                self.stack.emulator, self.database, accounts, keys, gateway, extra
            )
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(text)

    def read(self) -> str:
        """
        @return: the configuration file's text.
        """
        with open(self.path, encoding="utf-8") as f:
            return f.read()

    async def start(self, accounts, keys=(("one", K1),), gateway="{}", extra="",
                    emulatorConfig=None):
        emulator = Emulator(reactor=reactor, config=emulatorConfig or {})
        await emulator.listen(reactor)
        self.stack = Stack(emulator=emulator)
        self.write(accounts, keys, gateway, extra)
        app = buildApplication(loadConfig(self.path), reactor, configPath=self.path)
        self.stack.app = app
        await app.extras["credentials"].start()  # as the service does at start-up
        self.stack.port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            app.site
        )
        return self

    async def reload(self):
        """
        C{POST /admin/reload}.

        @return: C{(status, JSON answer)}.
        """
        response = await treq.post(
            self.stack.url + "/admin/reload",
            headers={"Authorization": [f"Bearer {ADMIN}"]},
            persistent=False,
        )
        return response.code, json.loads(await response.content())

    async def ask(self, key=K1, stream=True, text="hi"):
        """
        One Responses turn.

        @return: C{(status, body bytes)}.
        """
        response, data = await self.stack.postJSON(
            "/v1/responses", {"model": "gpt-5.5", "input": text, "stream": stream}, key=key,
            persistent=False,
        )
        return response.code, data


async def waitFor(predicate, timeout=5.0, step=0.02) -> None:
    """
    Poll C{predicate} on the reactor until it holds (bounded).
    """
    deadline = reactor.seconds() + timeout
    while not predicate():
        if reactor.seconds() > deadline:
            raise AssertionError("condition not reached")
        await deferLater(reactor, step, lambda: None)


@pytest_twisted.ensureDeferred
async def test_reload_swaps_accounts_and_keys_running_turn_finishes(tmp_path):
    """
    A reload that removes a1, adds a2 and a second key: the turn running
    on a1 finishes normally; the next turns use a2; the new key works at
    once and a removed one gets 401.
    """
    relay = await Reloadable(tmp_path).start([("a1", "sk-emu-a1", {})])
    try:
        relay.stack.emulator.setScript("sk-emu-a1", {"delay": 0.15, "deltas": 6})
        running = Deferred.fromCoroutine(relay.ask())
        await waitFor(lambda: relay.stack.emulator.inflight("sk-emu-a1") == 1)
        relay.write([("a2", "sk-emu-a2", {})], keys=(("two", K2),))
        status, answer = await relay.reload()
        assert status == 200, answer
        assert answer["applied"] is True
        assert answer["changes"]["accounts"] == {
            "added": ["a2"], "removed": ["a1"], "changed": [], "renewed": []
        }
        assert answer["changes"]["keys"] == {"added": ["two"], "removed": ["one"], "changed": []}
        assert "sk-emu-a2" not in json.dumps(answer)

        code, data = await running
        assert code == 200
        assert [e for e, _ in sseEvents(data)][-1] == "response.completed"

        code, data = await relay.ask(key=K2)
        assert code == 200, data
        assert len(relay.stack.emulator.requestsFor("sk-emu-a2", "request")) == 1
        assert len(relay.stack.emulator.requestsFor("sk-emu-a1", "request")) == 1
        code, _ = await relay.ask(key=K1)
        assert code == 401

        models = await treq.get(
            relay.stack.url + "/v1/models", headers={"Authorization": [f"Bearer {K2}"]},
            persistent=False,
        )
        assert models.code == 200
        await models.content()
    finally:
        await relay.stack.stop()


@pytest_twisted.ensureDeferred
async def test_reload_adds_an_oauth_account_with_managed_tokens(tmp_path):
    """
    Issues 12 + 14: an OAuth account a reload adds, whose access token has
    already expired, is refreshed before its first dial (its tokens are
    managed from the moment it exists) and serves at once.
    """
    from tests.integration.harness import accountsYAML
    from tests.integration.oauthstack import emulatorConfig, oauthAccount, oauthStats

    relay = await Reloadable(tmp_path).start(
        [("a1", "sk-emu-a1", {})], emulatorConfig=emulatorConfig(("o1",))
    )
    try:
        emulator = relay.stack.emulator
        oauth = oauthAccount(emulator, "o1", accessTtl=-60, priority=1)
        text = relay.read().replace(
            "accounts: ",
            "accounts: " + accountsYAML(emulator, [oauth])[:-1] + ", ",
            1,
        ).replace('[{"id": "a1"', '{"id": "a1"', 1)
        relay.write(None, text=text)
        status, answer = await relay.reload()
        assert status == 200, answer
        assert answer["changes"]["accounts"]["added"] == ["o1"], answer
        credentials = relay.stack.app.extras["credentials"]
        o1 = next(a for a in relay.stack.app.live.accounts if a.id == "o1")
        await waitFor(lambda: credentials.blockReason(o1, reactor.seconds()) is None)
        code, data = await relay.ask(stream=False)
        assert code == 200, data
        assert oauthStats(emulator, "o1")["refreshes"] == 1
        assert len(emulator.requestsFor("o1", "request")) == 1
        assert emulator.requestsFor("sk-emu-a1", "request") == []
    finally:
        await relay.stack.stop()


@pytest_twisted.ensureDeferred
async def test_bad_file_changes_nothing(tmp_path):
    """
    A file that does not validate: 400 in OpenAI's format with one line
    per problem; the relay keeps serving with what it had.
    """
    relay = await Reloadable(tmp_path).start([("a1", "sk-emu-a1", {})])
    try:
        text = relay.read()
        relay.write(None, text=text + "gateway2: {}\n")
        status, answer = await relay.reload()
        assert status == 400
        assert answer["error"]["code"] == "invalid_configuration"
        assert answer["applied"] is False
        assert len(answer["problems"]) == 1
        assert "gateway2" in answer["problems"][0]
        code, _ = await relay.ask()
        assert code == 200
    finally:
        await relay.stack.stop()


@pytest_twisted.ensureDeferred
async def test_changed_credential_applies_state_survives(tmp_path):
    """
    a1 cools down after a usage-limit 429; a reload rotates a2's
    credential and adds a3. a1 stays cooling (account state survives,
    /admin/accounts still shows it), and the next attempt on a2 uses its
    new credential.
    """
    relay = await Reloadable(tmp_path).start(
        [("a1", "sk-emu-a1", {"priority": 1}), ("a2", "sk-emu-a2", {"priority": 2})]
    )
    try:
        emulator = relay.stack.emulator
        emulator.setFault("sk-emu-a1", {"kind": "status", "preset": "usage_limit", "times": 1})
        code, _ = await relay.ask()
        assert code == 200
        assert len(emulator.requestsFor("sk-emu-a2", "request")) == 1
        relay.write([
            ("a1", "sk-emu-a1", {"priority": 1}),
            ("a2", "sk-emu-a2-rotated", {"priority": 2}),
            ("a3", "sk-emu-a3", {"priority": 3}),
        ])
        status, answer = await relay.reload()
        assert status == 200, answer
        assert answer["changes"]["accounts"] == {
            "added": ["a3"], "removed": [], "changed": ["a2"], "renewed": ["a2"]
        }
        code, _ = await relay.ask()
        assert code == 200
        assert len(emulator.requestsFor("sk-emu-a1", "request")) == 1
        assert len(emulator.requestsFor("sk-emu-a2-rotated", "request")) == 1
        response = await treq.get(
            relay.stack.url + "/admin/accounts",
            headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False,
        )
        rows = {r["id"]: r for r in json.loads(await response.content())["accounts"]}
        assert set(rows) == {"a1", "a2", "a3"}
        assert rows["a1"]["schedulable"] is False
        assert rows["a2"]["schedulable"] is True
    finally:
        await relay.stack.stop()


@pytest_twisted.ensureDeferred
async def test_rotated_credential_starts_afresh_priority_change_keeps_state(tmp_path):
    """
    a1 and a2 both cool down after usage-limit 429s. A reload rotates a1's
    credential and changes only a2's priority: a1's cooldown (learnt about
    the old key) is cleared and the next turn uses its new key; a2 stays
    cooling.
    """
    relay = await Reloadable(tmp_path).start(
        [("a1", "sk-emu-a1", {"priority": 1}), ("a2", "sk-emu-a2", {"priority": 2}),
         ("a3", "sk-emu-a3", {"priority": 3})]
    )
    try:
        emulator = relay.stack.emulator
        for cred in ("sk-emu-a1", "sk-emu-a2"):
            emulator.setFault(cred, {"kind": "status", "preset": "usage_limit", "times": 1})
        code, _ = await relay.ask()
        assert code == 200
        assert len(emulator.requestsFor("sk-emu-a3", "request")) == 1
        relay.write([
            ("a1", "sk-emu-a1-rotated", {"priority": 1}),
            ("a2", "sk-emu-a2", {"priority": 0}),
            ("a3", "sk-emu-a3", {"priority": 3}),
        ])
        status, answer = await relay.reload()
        assert status == 200, answer
        assert answer["changes"]["accounts"]["renewed"] == ["a1"]
        assert answer["changes"]["accounts"]["changed"] == ["a1", "a2"]
        code, _ = await relay.ask(text="a new session, not bound to a3")
        assert code == 200
        assert len(emulator.requestsFor("sk-emu-a1-rotated", "request")) == 1
        assert len(emulator.requestsFor("sk-emu-a2", "request")) == 1
    finally:
        await relay.stack.stop()


@pytest_twisted.ensureDeferred
async def test_pool_connections_unchanged_kept_changed_retired(tmp_path):
    """
    ctx_pool: after a reload that changes a2 only, a1's pooled upstream
    WebSocket is the same connection (its client's next turn reuses it)
    and a2's is closed.
    """
    relay = await Reloadable(tmp_path).start(
        [("a1", "sk-emu-a1", {"priority": 1}), ("a2", "sk-emu-a2", {"priority": 2})],
        gateway="{websocket: {mode_default: ctx_pool}}",
    )
    client = None
    try:
        app = relay.stack.app
        pool = app.extras["wsPool"]
        client = await connect(relay.stack, key=K1)
        events = await client.turn({"type": "response.create", "model": "gpt-5.5", "input": "x"})
        assert events[-1]["type"] == "response.completed"
        a2 = app.live.accounts.byId("a2")
        conn = await Deferred.fromCoroutine(pool.acquire(a2, {}))
        pool.release(conn)
        assert pool.counts("a1")[0] == 1 and pool.counts("a2")[0] == 1
        [kept] = list(pool._pools["a1"].conns)
        relay.write(
            [("a1", "sk-emu-a1", {"priority": 1}), ("a2", "sk-emu-a2-new", {"priority": 2})],
            gateway="{websocket: {mode_default: ctx_pool}}",
        )
        status, answer = await relay.reload()
        assert status == 200, answer
        assert pool.counts("a2")[0] == 0
        assert conn.proto.closed or conn.broken
        assert pool._pools["a1"].conns == [kept]
        first = events[-1]["response"]["id"]
        events = await client.turn({
            "type": "response.create", "model": "gpt-5.5", "input": "y",
            "previous_response_id": first,
        })
        assert events[-1]["type"] == "response.completed"
        # The continuation ran on the kept connection: no new upstream dial.
        assert len(relay.stack.emulator.requestsFor("sk-emu-a1", "handshake")) == 1
    finally:
        await closeWebSockets(relay.stack, [client] if client else [])


@pytest_twisted.ensureDeferred
async def test_websocket_with_removed_key_takes_no_new_turn(tmp_path):
    """
    A client WebSocket opened with a key that a reload removed: its next
    response.create closes 1008 (after an information event without a
    status, R81); a new connection with the new key works.
    """
    relay = await Reloadable(tmp_path).start(
        [("a1", "sk-emu-a1", {})], gateway="{websocket: {mode_default: ctx_pool}}"
    )
    clients = []
    try:
        old = await connect(relay.stack, key=K1)
        clients.append(old)
        events = await old.turn({"type": "response.create", "model": "gpt-5.5", "input": "x"})
        assert events[-1]["type"] == "response.completed"
        relay.write([("a1", "sk-emu-a1", {})], keys=(("two", K2),),
                    gateway="{websocket: {mode_default: ctx_pool}}")
        status, _ = await relay.reload()
        assert status == 200
        events = await old.turn({"type": "response.create", "model": "gpt-5.5", "input": "y"})
        assert events[0]["type"] == "error" and "status" not in events[0]
        assert events[0]["error"]["code"] == "invalid_api_key"
        events = await old.collect()
        assert events[-1] == {
            "type": "__closed__", "code": 1008, "reason": "api key is no longer valid"
        }
        new = await connect(relay.stack, key=K2)
        clients.append(new)
        events = await new.turn({"type": "response.create", "model": "gpt-5.5", "input": "z"})
        assert events[-1]["type"] == "response.completed"
    finally:
        await closeWebSockets(relay.stack, clients)


async def healthy(url, key, timeout=15.0) -> None:
    """
    Wait until C{url} answers a Responses turn with C{key}.
    """
    deadline = reactor.seconds() + timeout
    while True:
        try:
            response = await treq.post(
                url + "/v1/responses",
                json.dumps({"model": "gpt-5.5", "input": "hi"}).encode(),
                headers={"Authorization": [f"Bearer {key}"],
                         "Content-Type": ["application/json"]},
                persistent=False,
            )
            await response.content()
            if response.code == 200:
                return
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        if reactor.seconds() > deadline:
            raise AssertionError(f"{url} did not serve {key[:12]}...")
        await deferLater(reactor, 0.1, lambda: None)


@pytest_twisted.ensureDeferred
async def test_sighup_reloads_a_twistd_relay(tmp_path):
    """
    The real plugin under twistd: SIGHUP applies a new key; a bad file on
    the next SIGHUP is logged one line per problem and the process stays
    up; SIGTERM then stops it with exit status 0.
    """
    emulator = Emulator(reactor=reactor)
    await emulator.listen(reactor)
    directory = str(tmp_path)
    path = os.path.join(directory, "relay.yaml")
    database = os.path.join(directory, "settings.sqlite")
    from tests.integration.harness import closedPort

    port = closedPort()

    def write(keys, tail=""):
        text = configText(emulator, database, [("a1", "sk-emu-a1", {})], keys) + tail
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    write((("one", K1),))
    collector = Collector()
    process = reactor.spawnProcess(
        collector, sys.executable,
        [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n",
         "--pidfile=", "relay", "--config", path,
         "--listen", f"tcp:{port}:interface=127.0.0.1"],
        env=environment(), path=directory,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await healthy(url, K1)
        write((("one", K1), ("two", K2)))
        process.signalProcess("HUP")
        await healthy(url, K2)
        assert "configuration reloaded (sighup)" in collector.text

        write((("one", K1),), tail="bogus_key: 1\n")
        process.signalProcess("HUP")
        await waitFor(lambda: "config reload failed" in collector.text, timeout=10)
        await healthy(url, K2)
        lines = [line for line in collector.text.splitlines() if "config reload failed" in line]
        assert len(lines) == 1 and "bogus_key" in lines[0]
    finally:
        if not collector.ended.called:
            process.signalProcess("TERM")
        reason = await collector.ended.addTimeout(20, reactor)
        await emulator.stop()
    assert isinstance(reason, ProcessDone), collector.text
    assert "Traceback" not in collector.text
