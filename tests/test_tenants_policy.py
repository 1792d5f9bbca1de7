"""
Tests for the per-key policy (issue 22, behaviour.md R102): L{KeyPolicy}'s
refusals, the sliding rate windows (L{MemoryRateLimiter}, and
L{RedisRateLimiter}'s calls without a server; the real server is in
tests/integration/test_tenants.py), the engine's check before every turn,
the account-group narrowing at selection, money budgets, and the
configuration keys.
"""

from __future__ import annotations

import json

from twisted.internet.defer import fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from relay.configuration.parse import settingsFromString
from relay.entry.wssink import WebSocketSink
from relay.interfaces import IRateLimiter
from relay.base.records import ConfigError
from relay.wire.redisclient import RedisUnavailable
from relay.tenants.keypolicy import formatReset, rateLimitHeaders
from relay.tenants.ratelimit import (
    MemoryRateLimiter,
    RateDecision,
    RateLimitUnavailable,
    RedisRateLimiter,
)
from tests.tenantsrig import TenantsRig, account, key
from tests.test_runner import T0, status

DAY = 86400


class KeyRefusalTests(SynchronousTestCase):
    """
    Checks 1-4: refused before any slot or upstream request, in OpenAI's
    error format naming the limit; on the WebSocket per R113.
    """

    def setUp(self):
        self.rig = TenantsRig([account("a1"), account("a2")])

    def refused(self, client, model="gpt-5.5", **kw):
        sink, outcome = self.rig.go(self.rig.turn(client, model, **kw))
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(self.rig.dialer.ids(), [], "an upstream request was made")
        self.assertEqual(self.rig.load("a1", "a2"), {"a1": (0, 0), "a2": (0, 0)})
        [error] = sink.errors
        return error

    def test_expired(self):
        """
        After C{expires_at}: 401 saying the key expired and when; close
        1008. Before it, the key works.
        """
        client = key(expires_at=T0 + 10)
        _, outcome = self.rig.go(self.rig.turn(client))
        self.assertEqual(outcome, ["completed"])
        self.rig.clock.advance(10)
        self.rig.dialer.calls.clear()
        error = self.refused(client)
        self.assertEqual((error.status, error.code), (401, "api_key_expired"))
        self.assertIn("expired at 2023-11-14T22:13:30Z", error.message)
        self.assertIn("expires_at", error.message)
        self.assertEqual(error.wsClose, (1008, "api key expired"))

    def test_disabled(self):
        """
        A disabled key: 401, close 1008.
        """
        error = self.refused(key(disabled=True))
        self.assertEqual((error.status, error.code, error.wsClose[0]),
                         (401, "api_key_disabled", 1008))

    def test_model_allow_and_deny_lists(self):
        """
        A model outside C{models} or inside C{deny_models}: 403
        C{model_not_found} naming the model and the list; close 1008. A
        model on the list goes through.
        """
        client = key(models=("gpt-5.4",))
        error = self.refused(client, "gpt-5.5")
        self.assertEqual((error.status, error.type, error.code, error.param),
                         (403, "invalid_request_error", "model_not_found", "model"))
        self.assertIn("`gpt-5.5`", error.message)
        self.assertIn("allow-list is gpt-5.4", error.message)
        self.assertEqual(error.wsClose[0], 1008)
        denied = self.refused(key(deny_models=("gpt-5.5",)), "gpt-5.5")
        self.assertIn("deny_models", denied.message)
        _, outcome = self.rig.go(self.rig.turn(client, "gpt-5.4"))
        self.assertEqual(outcome, ["completed"])

    def test_money_budget_needs_a_price(self):
        """
        A key with a money budget may not use a model without a price
        (its cost could not be counted): 403 C{model_not_priced}. A model
        priced through every account's mapping is priced.
        """
        client = key(daily_usd=5.0)
        error = self.refused(client, "my-model")
        self.assertEqual((error.status, error.code), (403, "model_not_priced"))
        rig = TenantsRig([account("m", model_mapping={"my-model": "gpt-5.5"})])
        _, outcome = rig.go(rig.turn(client, "my-model"))
        self.assertEqual(outcome, ["completed"])

    def test_websocket_refusals(self):
        """
        R113 (changes R102's old close for a model): on the WebSocket an
        expired key closes 1008 with its reason; a model the key may not
        use is a status-bearing C{error} event (403, C{model_not_found})
        and the socket stays open.
        """

        class Conn:
            def __init__(self):
                self.sent, self.closed = [], None

            def isOpen(self):
                return self.closed is None

            def sendText(self, data):
                self.sent.append(data)

            def closeWith(self, code, reason):
                self.closed = (code, reason)

        conn = Conn()
        sink = WebSocketSink(conn)
        self.rig.go(self.rig.turn(key(expires_at=T0 - 1), "gpt-5.5", entrypoint="ws",
                                  wsMode="ctx_pool"), sink)
        self.assertEqual(conn.closed, (1008, "api key expired"))
        for mode in ("ctx_pool", "passthrough", "http_bridge"):
            conn = Conn()
            sink = WebSocketSink(conn)
            self.rig.go(self.rig.turn(key(models=("x",)), "gpt-5.5", entrypoint="ws",
                                      wsMode=mode), sink)
            self.assertIsNone(conn.closed, mode)
            [event] = [json.loads(data) for data in conn.sent]
            self.assertEqual((event["type"], event["status"], event["error"]["code"],
                              event["error"]["param"]),
                             ("error", 403, "model_not_found", "model"))
            self.assertIn("does not have access to model `gpt-5.5`", event["error"]["message"])


class GroupTests(SynchronousTestCase):
    """
    Account groups: selection, failover and waits only consider the
    group's accounts; with every group account cooling the key gets the
    group's own R83 answer, never another account.
    """

    def setUp(self):
        self.accounts = [account("pro", priority=0), account("c1", priority=1),
                         account("c2", priority=2)]
        self.rig = TenantsRig(self.accounts, groups={"contractors": ("c1", "c2")})

    def test_group_key_never_reaches_other_accounts(self):
        """
        The preferred account C{pro} is outside the group: a grouped key is
        served by C{c1}; a key bound by C{accounts:} likewise; an unbound
        key gets C{pro}.
        """
        for client, served in ((key(group="contractors"), "c1"), (key(accounts=("c2",)), "c2"),
                               (key(name="free"), "pro")):
            self.rig.dialer.calls.clear()
            turn = self.rig.turn(client)
            _, outcome = self.rig.go(turn)
            self.assertEqual((outcome, self.rig.dialer.ids()), (["completed"], [served]))

    def test_failover_stays_in_the_group(self):
        """
        Both group accounts fail with 5xx: the turn fails over c1 -> c2,
        finds no third account and ends 502; C{pro} is never tried.
        """
        for accountId in ("c1", "c2"):
            self.rig.script(accountId, status(503))
        sink, outcome = self.rig.go(self.rig.turn(key(group="contractors")))
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(self.rig.dialer.ids(), ["c1", "c2"])
        [record] = self.rig.records()
        self.assertEqual([(a.account, a.status, a.decision) for a in record.attempts],
                         [("c1", 503, "switch"), ("c2", 503, "switch")])
        self.assertEqual((record.outcome, record.status), ("failed", 502))

    def test_all_cooling_gets_the_groups_answer(self):
        """
        Every group account rate-limited: 429 with Retry-After from the
        group's earliest reset (R83), though C{pro} is healthy.
        """
        for accountId in ("c1", "c2"):
            self.successResultOf(self.rig.store.markAccount(
                accountId, "rate_limited", T0 + 30, "rate_limited"))
        sink, outcome = self.rig.go(self.rig.turn(key(group="contractors")))
        self.assertEqual(outcome, ["failed"])
        [error] = sink.errors
        self.assertEqual((error.status, dict(error.headers)["Retry-After"]), (429, "30"))
        self.assertIn("All 2 accounts for gpt-5.5 are rate-limited", error.message)
        self.assertEqual(self.rig.dialer.ids(), [])

    def test_busy_group_waits_on_the_group(self):
        """
        Every group slot taken: the turn waits on a group account (the
        fallback plan), not on the idle C{pro}.
        """
        rig = TenantsRig([account("pro", priority=0), account("c1", priority=1, concurrency=1)],
                         groups={"g": ("c1",)})
        held = self.successResultOf(rig.admission.tryAcquire("account", "c1", 1))
        sink, outcome = rig.go(rig.turn(key(group="g")))
        self.assertEqual(outcome, [])
        self.assertEqual(rig.load("c1", "pro"), {"c1": (1, 1), "pro": (0, 0)})
        held.release()
        rig.clock.advance(1)
        self.assertEqual((outcome, rig.dialer.ids()), (["completed"], ["c1"]))

    def test_model_outside_the_group(self):
        """
        A model only accounts outside the group serve is not found for
        the key (404 before routing).
        """
        rig = TenantsRig([account("pro", models=("gpt-5.5",)), account("c1", models=("o3",))],
                         groups={"g": ("c1",)})
        sink, outcome = rig.go(rig.turn(key(group="g"), "gpt-5.5"))
        self.assertEqual(sink.errors[0].status, 404)
        self.assertEqual(rig.dialer.ids(), [])

    def test_group_read_live(self):
        """
        The groups are read per turn: a reload that moves the group's
        accounts applies to the next turn.
        """
        from attrs import evolve

        client = key(group="contractors")
        self.rig.live.config = evolve(self.rig.live.config, groups={"contractors": ("c2",)})
        self.rig.go(self.rig.turn(client))
        self.assertEqual(self.rig.dialer.ids(), ["c2"])


class RateWindowTests(SynchronousTestCase):
    """
    L{MemoryRateLimiter}: sliding 60-second windows.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        self.limiter = MemoryRateLimiter(clock=self.clock)

    def admit(self, rpm=None, tpm=None):
        return self.successResultOf(self.limiter.admit("k", rpm, tpm))

    def test_interface(self):
        """
        Both providers provide L{IRateLimiter}.
        """
        self.assertTrue(verifyObject(IRateLimiter, self.limiter))
        self.assertTrue(verifyObject(IRateLimiter, RedisRateLimiter(redis=None)))

    def test_rpm_sliding(self):
        """
        C{rpm} turns in any 60 s; the next is refused until the oldest
        leaves the window, and a refused turn counts nothing.
        """
        for i in range(3):
            self.assertTrue(self.admit(rpm=3).allowed)
            self.clock.advance(10)
        refused = self.admit(rpm=3)
        self.assertEqual((refused.allowed, refused.refusedBy, refused.requests), (False, "rpm", 3))
        self.assertAlmostEqual(refused.retryAfter, 30)
        self.assertAlmostEqual(refused.resetRequests, 50)
        self.clock.advance(29.9)
        self.assertFalse(self.admit(rpm=3).allowed)
        self.clock.advance(0.2)
        decision = self.admit(rpm=3)
        self.assertTrue(decision.allowed)
        self.assertEqual(decision.requests, 3)

    def test_tpm(self):
        """
        Tokens of finished turns count for 60 s; at C{tpm} the next turn is
        refused until enough tokens leave the window.
        """
        self.successResultOf(self.limiter.addTokens("k", 600))
        self.clock.advance(20)
        self.successResultOf(self.limiter.addTokens("k", 500))
        refused = self.admit(tpm=1000)
        self.assertEqual((refused.allowed, refused.refusedBy, refused.tokens),
                         (False, "tpm", 1100))
        self.assertAlmostEqual(refused.retryAfter, 40)
        self.clock.advance(40.1)
        self.assertTrue(self.admit(tpm=1000).allowed)

    def test_peek_counts_nothing(self):
        """
        L{MemoryRateLimiter.peek} says what L{admit} would, counting nothing.
        """
        self.admit(rpm=2)
        for _ in range(3):
            self.assertEqual(self.successResultOf(self.limiter.peek("k", 2, None)).requests, 1)

    def test_headers(self):
        """
        The OpenAI headers: limit, remaining and reset for requests and
        tokens, and, when refused, Retry-After (whole seconds) and
        retry-after-ms.
        """
        decision = RateDecision(allowed=False, refusedBy="rpm", requests=60, tokens=1500,
                                rpm=60, tpm=2000, retryAfter=1.2, resetRequests=59.5,
                                resetTokens=0.02)
        self.assertEqual(dict(rateLimitHeaders(decision)), {
            "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "59.5s", "x-ratelimit-limit-tokens": "2000",
            "x-ratelimit-remaining-tokens": "500", "x-ratelimit-reset-tokens": "20ms",
            "Retry-After": "2", "retry-after-ms": "1200",
        })
        self.assertEqual(formatReset(360), "6m0s")
        self.assertNotIn("Retry-After", dict(rateLimitHeaders(RateDecision(True, rpm=5))))


class RedisRateLimiterTests(SynchronousTestCase):
    """
    L{RedisRateLimiter} without a server: one C{EVAL} per admission, its
    reply read, Redis errors per C{on_redis_error}.
    """

    def setUp(self):
        self.calls, self.replies = [], []

        class FakeRedis:
            def execute(fake, timeout, method, *args):
                self.calls.append((method,) + args)
                reply = self.replies.pop(0)
                return fail(reply) if isinstance(reply, Exception) else succeed(reply)

        self.redis = FakeRedis()

    def test_admit(self):
        """
        The script gets the key's two window keys and its limits; a refusal
        is read with its retry time in seconds.
        """
        limiter = RedisRateLimiter(redis=self.redis)
        self.replies.append([b"rpm", 5, 0, 1500, 59000, 0])
        decision = self.successResultOf(limiter.admit("bob", 5, None))
        self.assertEqual((decision.allowed, decision.refusedBy, decision.requests,
                          decision.retryAfter, decision.resetRequests),
                         (False, "rpm", 5, 1.5, 59.0))
        method, script, keys, args = self.calls[0]
        self.assertEqual((method, keys), ("eval", ["relay:rl:bob:r", "relay:rl:bob:t"]))
        self.assertIn("TIME", script)
        self.assertEqual((args[0], args[1], args[2], args[4]), ("5", "0", "60000", "1"))

    def test_redis_down(self):
        """
        C{fail_open} lets the turn through (degraded); C{fail_closed}
        raises L{RateLimitUnavailable} (a 503).
        """
        self.replies.append(RedisUnavailable("eval", "down"))
        decision = self.successResultOf(RedisRateLimiter(redis=self.redis).admit("k", 1, None))
        self.assertEqual((decision.allowed, decision.degraded), (True, True))
        self.replies.append(RedisUnavailable("eval", "down"))
        self.failureResultOf(
            RedisRateLimiter(redis=self.redis, onRedisError="fail_closed").admit("k", 1, None),
            RateLimitUnavailable,
        )


class EngineRateTests(SynchronousTestCase):
    """
    The engine counts each turn in its key's windows and refuses over
    them with a 429 carrying the headers an OpenAI SDK backs off on.
    """

    def test_rpm_refusal(self):
        """
        With C{rpm: 2} the third turn within a minute is refused before any
        upstream request: 429 C{rate_limit_exceeded} naming RPM, Retry-After
        and the x-ratelimit headers; close 1013 on the WebSocket.
        """
        rig = TenantsRig([account("a")])
        client = key(rpm=2)
        for _ in range(2):
            self.assertEqual(rig.go(rig.turn(client))[1], ["completed"])
            rig.clock.advance(5)
        sink, outcome = rig.go(rig.turn(client))
        self.assertEqual(outcome, ["failed"])
        [error] = sink.errors
        self.assertEqual((error.status, error.type, error.code),
                         (429, "rate_limit_error", "rate_limit_exceeded"))
        self.assertIn("requests per min (RPM): Limit 2, Used 2", error.message)
        headers = dict(error.headers)
        self.assertEqual(headers["Retry-After"], "50")
        self.assertEqual(headers["x-ratelimit-remaining-requests"], "0")
        self.assertEqual(error.wsClose[0], 1013)
        self.assertEqual(len(rig.dialer.calls), 2)

    def test_tpm_counts_finished_turns(self):
        """
        Each completed turn's tokens count in the window: with C{tpm: 3}
        and 2 tokens per turn the third turn is refused.
        """
        rig = TenantsRig([account("a")])
        client = key(tpm=3)
        outcomes = [rig.go(rig.turn(client))[1] for _ in range(3)]
        self.assertEqual(outcomes, [["completed"], ["completed"], ["failed"]])

    def test_prewarm_not_counted_by_rpm(self):
        """
        R113: a WebSocket prewarm (C{generate: false}) is neither counted
        nor refused by C{rpm}; on HTTP the same field is an ordinary
        request (it generates) and counts.
        """
        rig = TenantsRig([account("a")])
        client = key(rpm=1)

        def prewarm(entrypoint):
            turn = rig.turn(client, entrypoint=entrypoint)
            turn.body["generate"] = False
            return turn

        self.assertEqual(rig.go(prewarm("ws"))[1], ["completed"])
        decision = self.successResultOf(rig.limiter.peek("bob", 1, None))
        self.assertEqual(decision.requests, 0)
        self.assertEqual(rig.go(rig.turn(client, entrypoint="ws"))[1], ["completed"])
        self.assertEqual(rig.go(prewarm("ws"))[1], ["completed"])
        self.assertEqual(rig.go(prewarm("http"))[1], ["failed"])

    def test_order_expiry_before_rate(self):
        """
        A refused turn counts nothing: an expired key's turns never fill
        its request window.
        """
        rig = TenantsRig([account("a")])
        client = key(rpm=1, expires_at=T0 - 1)
        rig.go(rig.turn(client))
        decision = self.successResultOf(rig.limiter.peek("bob", 1, None))
        self.assertEqual(decision.requests, 0)


class MoneyBudgetTests(SynchronousTestCase):
    """
    C{daily_usd} / C{monthly_usd}: priced turns count, checked before every
    turn like the token budgets; at most the turn that crosses overshoots.
    """

    def test_daily_usd(self):
        """
        Each turn costs 35,000 nano-dollars at the shipped gpt-5.5 price
        (1 input, 1 output token); a budget of $0.00007 admits two turns,
        then 429 C{insufficient_quota} naming daily_usd, close 1013.
        """
        client = key(daily_usd=0.00007)
        rig = TenantsRig([account("a")], keys=[client])
        outcomes = [rig.go(rig.turn(client))[1] for _ in range(3)]
        self.assertEqual(outcomes, [["completed"], ["completed"], ["failed"]])
        sink, _ = rig.go(rig.turn(client))
        [error] = sink.errors
        self.assertEqual((error.status, error.code), (429, "insufficient_quota"))
        self.assertIn("daily_usd is $0.00", error.message)
        self.assertIn("$0.0001 was spent", error.message)
        self.assertEqual(error.wsClose[0], 1013)
        [row] = rig.ledger.budgetView(rig.clock.seconds())
        self.assertEqual((row["daily_usd"], row["daily_spent_usd"]), (0.00007, 0.00007))

    def test_monthly_usd_with_overrides(self):
        """
        The file's prices win over the shipped ones.
        """
        from relay.tenants.prices import Price

        client = key(monthly_usd=0.001)
        rig = TenantsRig([account("a")], keys=[client],
                         prices={"gpt-5.5": Price(input=500.0, output=500.0)})
        outcomes = [rig.go(rig.turn(client))[1] for _ in range(2)]
        self.assertEqual(outcomes, [["completed"], ["failed"]])


class ConfigTests(SynchronousTestCase):
    """
    The configuration keys (config.md C{keys:}, C{groups:}, C{prices:},
    C{request_log:}); bad values are one line naming the key.
    """

    def test_parse(self):
        config = settingsFromString(
            "keys:\n"
            "  - {name: bob, key: sk-1, models: [gpt-5.5], expires_at: 2027-03-01T00:00:00Z,"
            " rpm: 60, tpm: 200000, group: contractors, daily_usd: 20.0, monthly_usd: 100}\n"
            "  - {name: al, key: sk-2, accounts: [a1], deny_models: [o3], disabled: true}\n"
            "accounts: [{id: a1, type: apikey, api_key: x}, {id: a3, type: apikey, api_key: y}]\n"
            "groups: {contractors: [a3]}\n"
            "prices: {gpt-5.5: {input: 1.25, cached_input: 0.125, output: 10.0}}\n"
            "request_log: {max_records: 1000, retention_days: 2, sample_rate: 0.5}\n"
        )
        bob, al = config.keys
        self.assertEqual((bob.models, bob.expires_at, bob.rpm, bob.tpm, bob.group,
                          bob.daily_usd, bob.monthly_usd),
                         (("gpt-5.5",), 1803859200.0, 60, 200000, "contractors", 20.0, 100))
        self.assertEqual((al.accounts, al.deny_models, al.disabled), (("a1",), ("o3",), True))
        self.assertEqual(config.groups, {"contractors": ("a3",)})
        self.assertEqual(config.prices["gpt-5.5"].cached_input, 0.125)
        self.assertEqual((config.request_log.max_records, config.request_log.sample_rate),
                         (1000, 0.5))
        self.assertEqual(settingsFromString(
            'keys: [{name: a, key: b, expires_at: "2027-03-01"}]').keys[0].expires_at,
            1803859200.0)

    def test_errors(self):
        accounts = "accounts: [{id: a1, type: apikey, api_key: x}]\n"
        for text, message in (
            ("keys: [{name: a, key: b, group: g}]", "keys[0].group: unknown group 'g'"),
            (accounts + "keys: [{name: a, key: b, accounts: [zz]}]",
             "keys[0].accounts[0]: unknown account id 'zz'"),
            (accounts + "groups: {g: [a1]}\nkeys: [{name: a, key: b, accounts: [a1], group: g}]",
             "give accounts or group, not both"),
            (accounts + "groups: {g: [nope]}", "groups.g[0]: unknown account id 'nope'"),
            ("prices: {m: {input: 1}}", "prices.m: output is required"),
            ("prices: {m: {input: 1, output: 2, extra: 1}}", "unknown key prices.m.extra"),
            ("keys: [{name: a, key: b, expires_at: soon}]", "keys[0].expires_at"),
            ("keys: [{name: a, key: b, expires_at: 1969-12-31T00:00:00Z}]",
             "keys[0].expires_at: must be at or after 1970-01-01T00:00:00Z"),
            ("keys: [{name: a, key: b, expires_at: '0001-01-01'}]",
             "keys[0].expires_at: must be at or after 1970-01-01T00:00:00Z"),
            ("keys: [{name: a, key: b, rpm: 0}]", "keys[0].rpm: must be at least 1"),
            ("request_log: {sample_rate: 2}", "request_log.sample_rate"),
        ):
            with self.assertRaises(ConfigError) as caught:
                settingsFromString(text)
            self.assertIn(message, str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))


class ModelsListTests(SynchronousTestCase):
    """
    C{/v1/models} lists only what the key may use, on the accounts it may
    reach.
    """

    def test_models(self):
        from relay.engine.catalog import ModelCatalog
        from relay.entry.http import KeyRing
        from relay.entry.models import ModelsResource
        from tests.test_admin import makeRequest, render

        rig = TenantsRig([account("pro", models=("gpt-5.5", "o3")),
                          account("c1", models=("gpt-5.4", "o3"))], groups={"g": ("c1",)})
        keys = [key("all"), key("grouped", group="g"), key("listed", models=("o3", "nope")),
                key("denied", deny_models=("o3",))]
        resource = ModelsResource(
            KeyRing(keys), ModelCatalog(runner=rig.runner, accounts=rig.live.accounts))
        listed = {}
        for client in keys:
            request = makeRequest("", key=client.key)
            render(resource, request)
            body = json.loads(b"".join(request.written))
            listed[client.name] = [m["id"] for m in body["data"]]
        self.assertEqual(listed, {"all": ["gpt-5.4", "gpt-5.5", "o3"],
                                  "grouped": ["gpt-5.4", "o3"], "listed": ["o3"],
                                  "denied": ["gpt-5.4", "gpt-5.5"]})


class AccountViewTests(SynchronousTestCase):
    """
    What a budgeted key's turn asks of the accounts it may reach (served
    names, OAuth among them, priced) is worked out once per accounts
    snapshot, not by a walk of the pool on every read (R108, R109), and
    follows every change of the accounts or of the key's reach.
    """

    def setUp(self):
        from relay.base.records import Account

        self.walked = []
        serves = Account.servesModel

        def counting(account, model):
            self.walked.append(account.id)
            return serves(account, model)

        self.patch(Account, "servesModel", counting)

    def test_walkedOncePerSnapshot(self):
        """
        Reading the served names, the output-limit answer and the estimate
        twice walks the 50 accounts once.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account(f"a{i}") for i in range(50)], keys=[client])
        for _ in range(2):
            rig.policy.estimate(client, "gpt-5.5", {}, 10, 10)
            rig.policy.outputLimitHonoured(client, "gpt-5.5")
            self.assertIsNone(rig.policy.refusal(client, "gpt-5.5", T0))
        self.assertEqual(len(self.walked), 50)

    def test_followsTheAccounts(self):
        """
        Replacing the accounts (a reload, the admin API) is seen by the next
        read: an OAuth account serving the model makes the output limit not
        honoured, a mapping changes the served name.
        """
        client = key(daily_usd=5.0)
        rig = TenantsRig([account("a")], keys=[client])
        self.assertTrue(rig.policy.outputLimitHonoured(client, "gpt-5.5"))
        self.assertEqual(rig.policy._serving(client, "gpt-5.5"), ["gpt-5.5"])
        rig.live.accounts.replace([account("a", model_mapping={"gpt-5.5": "gpt-5.4"}),
                                   account("o", type="oauth")])
        self.assertFalse(rig.policy.outputLimitHonoured(client, "gpt-5.5"))
        self.assertEqual(sorted(rig.policy._serving(client, "gpt-5.5")), ["gpt-5.4", "gpt-5.5"])

    def test_followsTheKeysReach(self):
        """
        A key's group, changed through the admin API while the accounts
        stay, is seen by the next read.
        """
        client = key(daily_usd=5.0, group="g")
        rig = TenantsRig([account("a"), account("o", type="oauth")], keys=[client])
        rig.policy.adminGroups["g"] = ["a"]
        self.assertTrue(rig.policy.outputLimitHonoured(client, "gpt-5.5"))
        rig.policy.adminGroups["g"] = ["a", "o"]
        self.assertFalse(rig.policy.outputLimitHonoured(client, "gpt-5.5"))
        self.assertEqual([a.id for a in rig.policy.reachable(client, rig.live.accounts)],
                         ["a", "o"])
