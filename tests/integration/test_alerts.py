"""
Webhook alerts end to end (relay.alerts, docs/operating.md "Alerts"): a
webhook receiver on 127.0.0.1 gets each alert exactly once, and its
resolution, from real traffic through relay against the emulator: a login
needing sign-in, an account disabled by its upstream's answers, the pool
unable to serve a model, a key crossing 80 % and 100 % of its budget, the
spend rate over a low threshold, and the capacity forecast before the
emulated 5-hour windows run out.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web.resource import Resource
from twisted.web.server import Site

from relay.emulator import Emulator
from tests.integration.harness import RELAY_KEY, sseEvents, startStack
from tests.integration.oauthstack import (
    RESPONSES,
    emulatorConfig,
    forgedToken,
    oauthAccount,
    sleep,
    turnBody,
    waitFor,
)
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)

ADMIN = "admin-alerts-test-9f3kq0xz7"


class Receiver(Resource):
    """
    The webhook: keeps every JSON body POSTed to it; answers 503 to the
    first C{failFirst} of them (relay tries again).
    """

    isLeaf = True

    def __init__(self, failFirst: int = 0):
        super().__init__()
        self.bodies = []
        self.refused = 0
        self.failFirst = failFirst

    def render_POST(self, request):
        body = json.loads(request.content.read())
        if self.refused < self.failFirst:
            self.refused += 1
            request.setResponseCode(503)
            return b"try later"
        self.bodies.append(body)
        return b"ok"

    def told(self):
        return [(b["status"], b["event"], b["subject"]) for b in self.bodies]


async def receiver(failFirst=0):
    hook = Receiver(failFirst)
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(hook))
    return hook, port


def alertsYAML(port, events, **extra) -> str:
    section = {
        "webhooks": [{"url": f"http://127.0.0.1:{port.getHost().port}/hook/t0ken",
                      "events": list(events)}],
        "evaluate_interval_seconds": 0.2, "cooloff_seconds": 600,
    }
    section.update(extra)
    return "alerts: " + json.dumps(section) + "\n"


async def start(accounts, hook, port, events, emulator, keys=None, **extra):
    relay = await startStack(accounts, emulator=emulator, keys=keys,
                             extra=f"admin_key: {ADMIN}\n" + alertsYAML(port, events, **extra))
    relay.app.extras["alerts"].startService()
    return relay


async def stop(relay, port):
    await relay.app.extras["alerts"].stopService()
    await relay.stop()
    await port.stopListening()


async def admin(relay, method, path, body=None):
    response = await treq.request(
        method, relay.url + path, data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": [f"Bearer {ADMIN}"], "Content-Type": ["application/json"]},
        persistent=False)
    return response.code, json.loads(await response.content() or b"null")


async def turn(relay, model="gpt-5.5", key=RELAY_KEY, text="hi"):
    response, data = await relay.postJSON(RESPONSES, dict(turnBody(text), model=model), key=key)
    return response.code, sseEvents(data) if response.code == 200 else data


@pytest_twisted.ensureDeferred
async def test_loginNeededAndAccountDisabled():
    """
    One turn: o1's token is refused (401) and its refresh token too
    (C{invalid_grant}): the login needs sign-in; k1 answers 402: disabled;
    k2 serves it. Each alert arrives once (the receiver's first answer is a
    503: delivered on the retry); an operator's new tokens and C{clear}
    resolve them.
    """
    hook, port = await receiver(failFirst=1)
    emulator = Emulator(reactor=reactor, config=emulatorConfig(
        ("o1",), apikeys=("sk-emu-k1", "sk-emu-k2")))
    await emulator.listen(reactor)
    emulator.oauth.setFault("o1", {"kind": "invalid_grant", "times": 1})
    emulator.setFault("sk-emu-k1", {"kind": "status", "code": 402, "body": {
        "error": {"message": "pay up", "type": "billing_error", "code": None}}})
    relay = await start(
        lambda e: [oauthAccount(e, "o1", priority=1, credential=forgedToken("o1")),
                   {"id": "k1", "credential": "sk-emu-k1", "priority": 2},
                   {"id": "k2", "credential": "sk-emu-k2", "priority": 3}],
        hook, port, ["login_needed", "account_disabled"], emulator)
    try:
        code, _ = await turn(relay)
        assert code == 200
        await waitFor(lambda: len(hook.bodies) == 2, timeout=15)
        assert sorted(hook.told()) == [("firing", "account_disabled", "k1"),
                                       ("firing", "login_needed", "o1")]
        assert hook.refused == 1
        login = next(b for b in hook.bodies if b["event"] == "login_needed")
        assert "needs sign-in" in login["summary"] and login["details"]["account"] == "o1"
        await sleep(1)
        assert len(hook.bodies) == 2, "once per condition"
        emulator.clearFaults()
        code, _ = await admin(relay, "PUT", "/admin/accounts/o1/tokens", {
            "access_token": emulator.mintAccessToken("o1", 600), "refresh_token": "rt-o1-0"})
        assert code == 200
        code, _ = await admin(relay, "POST", "/admin/accounts/k1/clear")
        assert code == 200
        await waitFor(lambda: len(hook.bodies) == 4, timeout=15)
        assert sorted(hook.told()[2:]) == [("resolved", "account_disabled", "k1"),
                                           ("resolved", "login_needed", "o1")]
        await sleep(1)
        assert len(hook.bodies) == 4
    finally:
        await stop(relay, port)


@pytest_twisted.ensureDeferred
async def test_poolExhaustedForAModel():
    """
    k1 alone serves gpt-5.4-mini; its 429s (Retry-After 4 s) leave the
    pool unable to serve that model: the alert arrives once, and is
    resolved when the account may be used again. gpt-5.5 (k2) is not
    concerned.
    """
    hook, port = await receiver()
    emulator = Emulator(reactor=reactor, config=emulatorConfig(
        (), apikeys=("sk-emu-k1", "sk-emu-k2")))
    await emulator.listen(reactor)
    emulator.setFault("sk-emu-k1", {"kind": "status", "preset": "rate_limit",
                                    "headers": {"retry-after": "4"}})
    relay = await start(
        [{"id": "k1", "credential": "sk-emu-k1", "models": ["gpt-5.4-mini"]},
         {"id": "k2", "credential": "sk-emu-k2", "models": ["gpt-5.5"]}],
        hook, port, ["pool_exhausted"], emulator)
    try:
        assert (await turn(relay))[0] == 200
        code, _ = await turn(relay, model="gpt-5.4-mini")
        assert code in (429, 503)
        emulator.clearFaults()
        await waitFor(lambda: len(hook.bodies) >= 1, timeout=10)
        assert hook.told() == [("firing", "pool_exhausted", "gpt-5.4-mini")]
        assert hook.bodies[0]["details"]["status"] in (429, 503)
        await waitFor(lambda: len(hook.bodies) >= 2, timeout=15)
        assert hook.told()[1:] == [("resolved", "pool_exhausted", "gpt-5.4-mini")]
        assert (await turn(relay, model="gpt-5.4-mini"))[0] == 200
        await sleep(1)
        assert len(hook.bodies) == 2
    finally:
        await stop(relay, port)


@pytest_twisted.ensureDeferred
async def test_keyBudgetAndSpendRate():
    """
    A key with a daily budget of five turns' tokens: the 80 % alert after
    its fourth turn, the 100 % one after its fifth (the sixth is refused);
    raising the budget resolves both. The spend rate (over $0.01/hour
    over 2 s) fires with the turns and is resolved once they stop.
    """
    hook, port = await receiver()
    emulator = Emulator(reactor=reactor, config=emulatorConfig((), apikeys=("sk-emu-k1",)))
    await emulator.listen(reactor)
    relay = await start(
        [{"id": "k1", "credential": "sk-emu-k1"}], hook, port, ["key_budget", "spend_rate"],
        emulator, spend_rate_usd_per_hour=0.01, spend_window_seconds=2)
    try:
        code, events = await turn(relay)
        assert code == 200
        perTurn = events[-1][1]["response"]["usage"]["total_tokens"]
        await waitFor(lambda: ("firing", "spend_rate", "pool") in hook.told(), timeout=10)
        await waitFor(lambda: ("resolved", "spend_rate", "pool") in hook.told(), timeout=10)
        code, body = await admin(relay, "POST", "/admin/keys",
                                 {"name": "bob", "daily_tokens": 5 * perTurn})
        assert code == 201, body
        secret = body["secret"]

        def budget():
            return [t for t in hook.told() if t[1] == "key_budget"]

        for i in range(1, 6):
            code, events = await turn(relay, key=secret)
            assert code == 200
            assert events[-1][1]["response"]["usage"]["total_tokens"] == perTurn
            if i < 4:
                await sleep(0.6)
                assert budget() == [], (i, budget())
            elif i == 4:
                await waitFor(lambda: budget(), timeout=10)
                assert budget() == [("firing", "key_budget", "bob daily_tokens 80%")]
            else:
                await waitFor(lambda: len(budget()) > 1, timeout=10)
                assert budget()[1:] == [("firing", "key_budget", "bob daily_tokens 100%")]
        assert (await turn(relay, key=secret))[0] == 429
        code, _ = await admin(relay, "PATCH", "/admin/keys/bob",
                              {"daily_tokens": 100 * perTurn})
        assert code == 200
        await waitFor(lambda: len(budget()) == 4, timeout=10)
        assert sorted(budget()[2:]) == [("resolved", "key_budget", "bob daily_tokens 100%"),
                                      ("resolved", "key_budget", "bob daily_tokens 80%")]
        # bob's turns brought the spend rate back within its 600 s cool-off:
        # not told again, and so never resolved again either.
        await sleep(2.5)
        spend = [t for t in hook.told() if t[1] == "spend_rate"]
        assert spend == [("firing", "spend_rate", "pool"), ("resolved", "spend_rate", "pool")]
    finally:
        await stop(relay, port)


@pytest_twisted.ensureDeferred
async def test_capacityForecastBeforeTheWindowsRunOut():
    """
    Two ChatGPT logins whose emulated 5-hour windows start at 10 % and
    fill with the tokens they serve: under a steady stream of turns the
    forecast ("at the current rate the pool's 5-hour windows for gpt-5.5
    run out in ~N min") arrives while both windows are still short of
    100 %, once; when the turns stop it is resolved.
    """
    hook, port = await receiver()
    names = ("o1", "o2")
    usage = {"primary_used_percent": 10, "primary_capacity_tokens": 4000}
    emulator = Emulator(reactor=reactor, config=emulatorConfig(names, usage=usage))
    await emulator.listen(reactor)
    relay = await start(lambda e: [oauthAccount(e, n) for n in names], hook, port,
                        ["capacity_forecast"], emulator, forecast_window_seconds=3,
                        capacity_forecast_minutes=60)

    def used():
        return [emulator.oauth.usage["oauth:" + n].percent("primary") for n in names]

    try:
        atFiring = None
        for i in range(400):
            code, _ = await turn(relay, text=f"turn {i}")
            assert code == 200
            await sleep(0.02)
            if hook.bodies:
                atFiring = used()
                break
        assert atFiring is not None, used()
        assert max(atFiring) < 100, atFiring
        assert hook.told() == [("firing", "capacity_forecast", "gpt-5.5")]
        body = hook.bodies[0]
        assert body["summary"].startswith(
            "at the current rate the pool's 5-hour windows for gpt-5.5 run out in ~")
        assert body["summary"].endswith(" min")
        assert body["details"]["accounts"] == ["o1", "o2"]
        assert 1 <= body["details"]["minutes"] <= 60
        await waitFor(lambda: len(hook.bodies) >= 2, timeout=10)
        assert hook.told()[1:] == [("resolved", "capacity_forecast", "gpt-5.5")]
        assert max(used()) < 100
    finally:
        await stop(relay, port)


@pytest_twisted.ensureDeferred
async def test_aRelayProcessSendsPlainAndSlackBodies(tmp_path):
    """
    relay run as C{twistd relay} (the service starts the monitor): one
    turn over a $0.01/hour spend threshold reaches a plain webhook and a
    Slack one (C{{"text": ...}}), then their resolution; the webhook URLs'
    token is nowhere in relay's log, which names the targets.
    """
    from tests.integration.relayproc import RelayProcess, writeConfig

    hook, port = await receiver()
    emulator = Emulator(reactor=reactor, config=emulatorConfig((), apikeys=("sk-emu-k1",)))
    await emulator.listen(reactor)
    base = f"http://127.0.0.1:{port.getHost().port}"
    section = {"webhooks": [{"url": base + "/plain/t0ken-plain", "events": ["spend_rate"]},
                            {"url": base + "/slack/t0ken-slack", "slack": True}],
               "spend_rate_usd_per_hour": 0.01, "spend_window_seconds": 2,
               "evaluate_interval_seconds": 0.2}
    relay = RelayProcess(config=str(tmp_path / "relay.yaml"), log=str(tmp_path / "relay.log"))
    writeConfig(relay.config, relay.port,
                [{"id": "k1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
                  "api_key": "sk-emu-k1"}],
                extra="alerts: " + json.dumps(section) + "\n")
    relay.start()
    try:
        await relay.waitHealthy()
        code, _ = await relay.post(turnBody())
        assert code == 200
        await waitFor(lambda: len(hook.bodies) == 4, timeout=20)
        plain = [b for b in hook.bodies if "event" in b]
        slack = [b for b in hook.bodies if "text" in b]
        assert [(b["status"], b["event"]) for b in plain] == [
            ("firing", "spend_rate"), ("resolved", "spend_rate")]
        assert [list(b) for b in slack] == [["text"], ["text"]]
        assert "spend_rate" in slack[0]["text"] and "resolved" in slack[1]["text"]
        await relay.shutdown()
        log = relay.tail(10**7)
        assert "t0ken" not in log
        assert "webhooks[0]" in log and "webhooks[1]" in log
    finally:
        await relay.shutdown()
        await emulator.stop()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_redisBackend(redisServer, tmp_path):
    """
    The same readings with the Redis backend, relay run as C{twistd
    relay}: k1's 402 disables it (the state is in Redis), and it alone
    served gpt-5.4-mini, so that pool is exhausted too; an operator's
    C{clear} resolves both.
    """
    from tests.integration.relayproc import ADMIN as PROC_ADMIN
    from tests.integration.relayproc import RelayProcess, writeConfig

    redisServer.command("FLUSHALL")
    hook, port = await receiver()
    emulator = Emulator(reactor=reactor, config=emulatorConfig(
        (), apikeys=("sk-emu-k1", "sk-emu-k2")))
    await emulator.listen(reactor)
    emulator.setFault("sk-emu-k1", {"kind": "status", "code": 402, "body": {
        "error": {"message": "pay up", "type": "billing_error", "code": None}}})
    section = {"webhooks": [{"url": f"http://127.0.0.1:{port.getHost().port}/hook",
                             "events": ["account_disabled", "pool_exhausted"]}],
               "evaluate_interval_seconds": 0.2}
    relay = RelayProcess(config=str(tmp_path / "relay.yaml"), log=str(tmp_path / "relay.log"))
    writeConfig(relay.config, relay.port,
                [{"id": "k1", "type": "apikey", "base_url": emulator.baseURL("apikey"),
                  "api_key": "sk-emu-k1", "models": ["gpt-5.4-mini"]},
                 {"id": "k2", "type": "apikey", "base_url": emulator.baseURL("apikey"),
                  "api_key": "sk-emu-k2", "models": ["gpt-5.5"]}],
                extra=f"state: {{backend: redis, redis_url: '{redisServer.url}'}}\n"
                      "alerts: " + json.dumps(section) + "\n")
    relay.start()
    try:
        await relay.waitHealthy()
        code, _ = await relay.post(dict(turnBody(), model="gpt-5.4-mini"))
        assert code != 200
        await waitFor(lambda: len(hook.bodies) == 2, timeout=20)
        assert sorted(hook.told()) == [("firing", "account_disabled", "k1"),
                                       ("firing", "pool_exhausted", "gpt-5.4-mini")]
        emulator.clearFaults()
        response = await treq.post(relay.url + "/admin/accounts/k1/clear",
                                   headers={"Authorization": [f"Bearer {PROC_ADMIN}"]},
                                   persistent=False)
        assert response.code == 200, await response.content()
        await waitFor(lambda: len(hook.bodies) == 4, timeout=20)
        assert sorted(hook.told()[2:]) == [("resolved", "account_disabled", "k1"),
                                           ("resolved", "pool_exhausted", "gpt-5.4-mini")]
        code, _ = await relay.post(dict(turnBody(), model="gpt-5.4-mini"))
        assert code == 200
        await sleep(1)
        assert len(hook.bodies) == 4
    finally:
        await relay.shutdown()
        await emulator.stop()
        await port.stopListening()
