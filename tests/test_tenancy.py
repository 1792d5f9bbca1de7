"""
Issue 19 items 5-7: tenant isolation (R104), a clean start (R105) and the
smaller defects, each with its own test.
"""

from __future__ import annotations

import json
import os
import tempfile

from twisted.internet.defer import Deferred, succeed
from twisted.logger import formatEvent  # noqa: F401
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import ClientKey, ConfigError, Turn
from relay.scheduling.selection import NoAccountAvailable
from tests.test_scheduler import SchedulerMixin, account
from tests.test_runner import Rig, status
from tests.test_runner import account as raccount

ALICE = ClientKey(name="alice", key="sk-alice", concurrency=0)
BOB = ClientKey(name="bob", key="sk-bob", concurrency=0)


def wsTurn(client, previous=None, entrypoint="ws"):
    return Turn(entrypoint=entrypoint, endpoint="responses", client=client, model="gpt-5.5",
                body={"model": "gpt-5.5"}, stream=True, previousResponseId=previous,
                wsMode="ctx_pool" if entrypoint == "ws" else None, requestId="r")


class OwnershipTests(SchedulerMixin, SynchronousTestCase):
    """
    Item 5 (R104): a key never reaches another key's conversation.
    """

    def test_foreignChainRefusedOnEveryEntrypoint(self):
        """
        Key B naming key A's response is refused over HTTP and over the
        WebSocket (today the WebSocket routes it to A's context).
        """
        self.build([account("a")])
        self.successResultOf(self.scheduler.recordResponse(wsTurn(ALICE), "resp_a", self.accounts[0]))
        for entrypoint in ("http", "ws"):
            error = self.selectFails(wsTurn(BOB, "resp_a", entrypoint))
            self.assertEqual(error.status, 400)
            self.assertEqual(error.message, "previous_response_id is not available for this user")
            if entrypoint == "ws":
                self.assertEqual(error.wsClose[0], 1008)
        self.assertEqual(self.select(wsTurn(ALICE, "resp_a")).account.id, "a")

    def test_unknownIdFailsClosed(self):
        """
        An id relay holds no owner for is C{previous_response_not_found}
        (today it is sent upstream on whatever account is chosen).
        """
        self.build([account("a")])
        for entrypoint in ("http", "ws"):
            error = self.selectFails(wsTurn(BOB, "resp_nobody", entrypoint))
            self.assertEqual(error.code, "previous_response_not_found")

    def test_ownerOutlivesTheRoutingBinding(self):
        """
        The owner record lives C{response_owner_ttl_seconds} (default 30
        days), not the routing binding's 3,600 s: after an hour key B is
        still refused and key A still owns its chain.
        """
        self.build([account("a")])
        self.successResultOf(self.scheduler.recordResponse(wsTurn(ALICE), "resp_a", self.accounts[0]))
        self.clock.advance(3601)
        self.assertEqual(self.successResultOf(self.scheduler.lookupResponse("resp_a")),
                         ("a", "alice"))
        self.assertEqual(self.selectFails(wsTurn(BOB, "resp_a", "http")).status, 400)
        self.clock.advance(30 * 86400)
        self.assertIsNone(self.successResultOf(self.scheduler.lookupResponse("resp_a")))

    def test_ownerTtlConfigurable(self):
        self.build([account("a")], response_owner_ttl_seconds=7200)
        self.successResultOf(self.scheduler.recordResponse(wsTurn(ALICE), "resp_a", self.accounts[0]))
        self.clock.advance(7201)
        self.assertIsNone(self.successResultOf(self.scheduler.lookupResponse("resp_a")))

    def test_recordsSurviveARestartWithTheEmbeddedStore(self):
        """
        With the memory backend, owner records are persisted in the SQLite
        database: a new store (a restarted relay) still knows the owner.
        """
        from twisted.python.threadpool import ThreadPool  # noqa: F401

        from relay.state.settingsdb import SQLiteSettingsStore
        from relay.state.durable import SQLiteValues
        from relay.state.memory import MemoryStateStore
        from tests.test_settings import synchronousPool as syncPool

        path = os.path.join(tempfile.mkdtemp(), "relay.sqlite")
        database = SQLiteSettingsStore(path=path, pool=syncPool(path))
        self.build([account("a")])
        self.store.durable = SQLiteValues(database)
        self.successResultOf(self.scheduler.recordResponse(wsTurn(ALICE), "resp_a", self.accounts[0]))
        restarted = MemoryStateStore(clock=self.clock)
        restarted.durable = SQLiteValues(database)
        self.scheduler._bindings._store = restarted
        self.scheduler._bindings._localOwners.clear()
        self.assertEqual(self.successResultOf(self.scheduler.lookupResponse("resp_a")),
                         ("a", "alice"))


class PoolLendingTests(SynchronousTestCase):
    """
    Item 5: a pooled upstream WebSocket dialled for one key's turn is
    never lent to another key's turn.
    """

    def test_perKey(self):
        from tests.test_ws import PoolTests

        rig = PoolTests("test_capacity")
        rig.setUp()
        acquire = lambda key: self.successResultOf(Deferred.fromCoroutine(  # noqa: E731
            rig.pool.acquire(rig.account, {}, ownerKey=key)))
        a = acquire("alice")
        rig.pool.release(a)
        b = acquire("bob")
        self.assertIsNot(a, b)
        self.assertEqual(len(rig.dialled), 2)
        rig.pool.release(b)
        self.assertIs(acquire("alice"), a)
        # At capacity (2): bob's idle connection is closed, not lent.
        carol = acquire("carol")
        self.assertIsNot(carol, b)
        self.assertTrue(b.broken)
        self.assertIsNone(rig.pool.findByResponse("a", "resp_x", "bob"))


class CleanStartTests(SynchronousTestCase):
    """
    Item 6 (R105): no turn before the stores are loaded; /readyz.
    """

    def test_tokensLoadingBeforeStart(self):
        """
        An OAuth account whose tokens were not read yet is blocked even
        before the store load began (today: dialled with the file's).
        """
        from relay.oauth.credentials import OAuthCredentials
        from relay.oauth.store import MemoryTokenStore
        from relay.base.records import Account
        from relay.state.settings import RuntimeSettings
        from relay.base.records import GatewaySettings
        from twisted.internet.task import Clock

        clock = Clock()
        oauth = Account(id="o", type="oauth", base_url="http://x", credential="tok",
                        chatgpt_account_id="c", refresh_token="rt")
        credentials = OAuthCredentials(
            clock=clock, settings=RuntimeSettings(GatewaySettings()),
            store=MemoryTokenStore(clock=clock), endpoint=None, accounts=[oauth],
        )
        self.assertEqual(credentials.blockReason(oauth, 5)[0], "tokens_loading")

    def test_turnWaitsForTheGate(self):
        from relay.process.readiness import StartupGate

        rig = Rig([raccount("a")])
        gate = StartupGate()
        rig.runner.startupGate = gate
        _, _, outcome = rig.run()
        self.assertEqual((rig.dialer.ids(), outcome), ([], []))
        gate.mark(gate.settings)()
        self.assertEqual(rig.dialer.ids(), [])
        gate.mark(gate.tokens)()
        self.assertEqual((rig.dialer.ids(), outcome), (["a"], ["completed"]))

    def test_readyz(self):
        from twisted.web.test.requesthelper import DummyRequest

        from relay.process.readiness import Readiness, ReadinessResource

        readiness = Readiness()
        flag = []
        readiness.addCheck("tokens", lambda: bool(flag))
        readiness.addCheck("redis", lambda: 1 / 0)
        request = DummyRequest([b""])
        body = ReadinessResource(readiness).render_GET(request)
        self.assertEqual(request.responseCode, 503)
        self.assertEqual(json.loads(body), {"status": "not_ready", "waiting": ["tokens", "redis"]})
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        flag.append(1)
        readiness.addCheck("redis", lambda: True)
        request = DummyRequest([b""])
        self.assertEqual(json.loads(ReadinessResource(readiness).render_GET(request)),
                         {"status": "ready"})

    def test_appNotReadyUntilLoadedAndWhileDraining(self):
        from twisted.internet.testing import MemoryReactorClock

        from relay.process.app import _Startup, buildApplication
        from relay.configuration.parse import settingsFromString

        config = settingsFromString(
            'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
            "keys: [{name: t, key: sk-t}]\naccounts: [{id: a1, type: apikey, api_key: k}]\n")
        app = buildApplication(config, MemoryReactorClock())
        readiness = app.extras["readiness"]
        self.assertEqual(readiness.ready(), (True, []))
        startup = _Startup(app)
        from relay.state.settings import RuntimeSettings

        pending = Deferred()
        self.patch(RuntimeSettings, "start", lambda self: pending)
        startup.startService()
        self.assertEqual(readiness.ready(), (False, ["settings", "tokens"]))
        pending.callback({})
        self.assertEqual(readiness.ready(), (True, []))
        # The control plane was not started here (no child services): its
        # flag does not hold the one start-up gate (issue 21 merged).
        self.assertTrue(app.extras["startupGate"].isOpen)
        app.drain.draining = True
        self.assertEqual(readiness.ready(), (False, ["draining"]))

    def test_controlPlaneJoinsTheGate(self):
        """
        R105 with issue 21: the control plane's first read is a flag of the
        one start-up gate the runner waits on; the gate opens once the
        settings, the tokens and that read are in.
        """
        from twisted.internet.testing import MemoryReactorClock

        from relay.process.app import _Startup, buildApplication
        from relay.configuration.parse import settingsFromString

        config = settingsFromString(
            'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
            "keys: [{name: t, key: sk-t}]\naccounts: [{id: a1, type: apikey, api_key: k}]\n")
        app = buildApplication(config, MemoryReactorClock())
        parts = app.extras["controlParts"]
        held = []
        # A store read over the network (Redis): no read before listening.
        self.patch(type(parts.store), "readNow", None)
        self.patch(type(parts.store), "list",
                   lambda this, kind: held.append(Deferred()) or held[-1])
        from relay.state.settings import RuntimeSettings

        self.patch(RuntimeSettings, "start", lambda self: succeed({}))
        startup = _Startup(app)
        parts.service.setServiceParent(startup)
        startup.startService()
        gate = app.extras["startupGate"]
        self.assertIs(app.runner.startupGate, gate)
        self.assertTrue(gate.settings() and gate.tokens())
        self.assertFalse(gate.isOpen)
        self.assertTrue(app.keys.pending)
        while held:
            held.pop(0).callback([])
        self.assertTrue(gate.isOpen)
        self.assertFalse(app.keys.pending)


class SmallDefectTests(SynchronousTestCase):
    """
    Item 7, one test each.
    """

    def test_textLogRedactsTracebacks(self):
        from relay.base.logs import observerFor
        import io

        out = io.StringIO()
        observer = observerFor("text", out, secrets=["sk-very-secret-token"], worker=None)
        try:
            raise RuntimeError("failed with sk-very-secret-token")
        except RuntimeError:
            failure = Failure()
        observer({"log_format": "boom", "log_failure": failure, "log_level": None,
                  "log_namespace": "t", "log_time": 0})
        self.assertNotIn("sk-very-secret-token", out.getvalue())
        self.assertIn("RuntimeError", out.getvalue())

    def test_memoryStoreStaysBounded(self):
        """
        Distinct client-chosen sessions never grow the store past its cap;
        expired ones go on the injected clock.
        """
        from twisted.internet.task import Clock

        from relay.state.memory import MemoryStateStore

        clock = Clock()
        store = MemoryStateStore(clock=clock, maxValues=10000)
        for i in range(200_000):
            store.setValue(f"sticky_session:0:openai:{i:016x}", "a1", 3600)
        self.assertEqual(len(store._values), 10000)
        clock.advance(3601)
        self.assertEqual(store.prune(), 10000)
        self.assertEqual(len(store._values), 0)

    def test_operatorKeys(self):
        from relay.configuration.parse import settingsFromString

        base = "keys: [{name: t, key: sk-client-key-0123456789}]\n"
        for text, word in (
            ("admin_key: short\n", "at least 16"),
            ("admin_key: sk-client-key-0123456789\n", "differ from every client key"),
            ("metrics_key: sk-client-key-0123456789\n", "differ from every client key"),
            ("admin_key: admin-0123456789abcdef\nmetrics_key: admin-0123456789abcdef\n",
             "differ from admin_key"),
        ):
            with self.assertRaises(ConfigError) as e:
                settingsFromString(base + text)
            self.assertIn(word, str(e.exception))
            self.assertNotIn("0123456789", str(e.exception).split(":", 1)[0])

    def test_metricsKeyOpensMetricsOnly(self):
        from tests.test_intake import METRICS, Conn, head, relaySite

        app, _ = relaySite()
        auth = b"Authorization: Bearer " + METRICS.encode() + b"\r\n"
        self.assertEqual(Conn(app.site).send(head(b"/metrics", b"GET", auth)).status(), 200)
        for path in (b"/admin/metrics", b"/admin/accounts", b"/admin/settings"):
            self.assertEqual(Conn(app.site).send(head(path, b"GET", auth)).status(), 401, path)

    def test_envFileTemporaryIsUnpredictable(self):
        """
        A file planted under the old predictable name (a symlink to a
        victim) is never followed.
        """
        from relay.oauth.authfile import writeEnvFile

        directory = tempfile.mkdtemp()
        path = os.path.join(directory, "relay.env")
        victim = os.path.join(directory, "victim")
        with open(victim, "w") as f:
            f.write("keep me\n")
        os.symlink(victim, f"{path}.{os.getpid()}.tmp")
        writeEnvFile(path, {"RELAY_TOKEN": "secret"}, ())
        with open(victim) as f:
            self.assertEqual(f.read(), "keep me\n")
        with open(path) as f:
            self.assertEqual(f.read(), "RELAY_TOKEN=secret\n")
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)

    def test_exhausted429CarriesRetryAfter(self):
        """
        Every account answered 429 (no Retry-After upstream): relay's 429
        says when the earliest cooldown ends.
        """
        rig = Rig([raccount("a", priority=1), raccount("b", priority=2)])
        rig.script("a", status(429))
        rig.script("b", status(429))
        _, sink, outcome = rig.run(stream=False)
        self.assertEqual(outcome, ["failed"])
        [error] = sink.errors
        self.assertEqual(error.status, 429)
        headers = dict((k.lower(), v) for k, v in error.headers)
        self.assertIn("retry-after", headers)
        self.assertGreaterEqual(int(headers["retry-after"]), 1)

    def test_chatToolIdsMustBeStrings(self):
        from relay.translate.chatrequest import ChatRequestError, checkChatRequest

        for messages, param in (
            ([{"role": "tool", "tool_call_id": {"x": 1}, "content": "r"}],
             "messages[0].tool_call_id"),
            ([{"role": "assistant", "tool_calls": [{"id": {"x": 1}, "type": "custom",
                                                    "custom": {"name": "c"}}]}],
             "messages[0].tool_calls[0].id"),
        ):
            with self.assertRaises(ChatRequestError) as e:
                checkChatRequest({"model": "m", "messages": messages})
            self.assertEqual(e.exception.param, param)


class NoCredentialInAdminAnswersTests(SynchronousTestCase):
    """
    R99, R100: no admin answer -- views, settings, history, usage,
    metrics (labels included), a reload's answer, applied or refused --
    and no log line contains a credential: proxy userinfo (plain or as
    the base64 of C{Proxy-Authorization}), userinfo in an upstream
    C{base_url}, a Redis password, account and client keys; a client key
    opens no admin route and the metrics key only C{/metrics}.
    """

    SECRETS = ("pw-proxy-secret", "puser-name", "up-url-secret", "upuser-name",
               "redis-pw-secret", "sk-up-account-credential", "sk-team-intake",
               "admin-intake-0123456789", "metrics-intake-0123456789", "pw-proxy-rotated")

    def config(self, password="pw-proxy-secret", broken=False):
        proxy = f"http://puser-name:{password}@127.0.0.1:3128"
        if broken:
            proxy = f"ftp://puser-name:{password}@127.0.0.1:3128"
        return (
            'listen: "tcp:0:interface=127.0.0.1"\ndatabase: ":memory:"\n'
            "admin_key: admin-intake-0123456789\nmetrics_key: metrics-intake-0123456789\n"
            "keys: [{name: team, key: sk-team-intake, concurrency: 0}]\n"
            f"proxies: [{{id: egress-1, url: '{proxy}'}}]\n"
            "accounts: [{id: a1, type: apikey, api_key: sk-up-account-credential,"
            " proxy_id: egress-1, base_url: 'http://upuser-name:up-url-secret@127.0.0.1:2/v1'}]\n"
            "state: {redis_url: 'redis://:redis-pw-secret@127.0.0.1:6379/0'}\n"
        )

    def assertClean(self, text, where):
        import base64

        forms = self.SECRETS + tuple(
            base64.b64encode(f"puser-name:{p}".encode()).decode()
            for p in ("pw-proxy-secret", "pw-proxy-rotated"))
        for secret in forms:
            self.assertNotIn(secret, text, where)

    def test_everyAdminAnswerAndLogLine(self):
        from twisted.internet.testing import MemoryReactorClock
        from twisted.logger import globalLogPublisher

        from relay.process.app import buildApplication
        from relay.configuration.parse import secretsOf, settingsFromString
        from relay.base.logs import SecretRedactor, formatTextLine
        from tests.test_intake import Conn, head

        path = os.path.join(tempfile.mkdtemp(), "relay.yaml")
        with open(path, "w") as f:
            f.write(self.config())
        config = settingsFromString(self.config())
        lines = []
        redactor = SecretRedactor(lambda e: lines.append(formatTextLine(e)), secretsOf(config))
        globalLogPublisher.addObserver(redactor)
        self.addCleanup(globalLogPublisher.removeObserver, redactor)
        app = buildApplication(config, MemoryReactorClock(), configPath=path)
        admin = b"Authorization: Bearer admin-intake-0123456789\r\n"

        def ask(target, method=b"GET", auth=admin):
            conn = Conn(app.site, clock=app.reactor).send(head(target, method, auth, length=0))
            app.reactor.advance(0)
            return conn

        # (/admin/usage reads the SQLite ledger in a thread: not on this
        # reactor; it holds token counts by key name and model only.)
        routes = [b"/admin/settings", b"/admin/accounts", b"/admin/history",
                  b"/admin/metrics", b"/metrics", b"/readyz"]
        for target in routes:
            conn = ask(target)
            self.assertEqual(conn.status(), 200, (target, conn.value[:200]))
            self.assertClean(conn.value.decode("latin-1"), target)
        accounts = ask(b"/admin/accounts").value
        self.assertIn(b"egress-1", accounts)  # the proxy is named by its id
        for password, broken, status in (("pw-proxy-rotated", False, 200),
                                         ("pw-proxy-rotated", True, 400)):
            with open(path, "w") as f:
                f.write(self.config(password, broken))
            conn = ask(b"/admin/reload", b"POST")
            self.assertEqual(conn.status(), status, conn.value[-400:])
            self.assertClean(conn.value.decode("latin-1"), b"reload")
        # R99: a client key reaches no admin route; the metrics key /metrics only.
        client = b"Authorization: Bearer sk-team-intake\r\n"
        metrics = b"Authorization: Bearer metrics-intake-0123456789\r\n"
        for target in routes[:-2] + [b"/admin/accounts/a1/clear", b"/admin/reload"]:
            for auth in (client, metrics, b"x-api-key: admin-intake-0123456789\r\n"):
                method = b"POST" if target.endswith((b"clear", b"reload")) else b"GET"
                conn = ask(target, method, auth)
                self.assertEqual(conn.status(), 401, (target, auth))
                self.assertClean(conn.value.decode("latin-1"), target)
        self.assertEqual(ask(b"/metrics", auth=client).status(), 401)
        self.assertEqual(ask(b"/metrics", auth=metrics).status(), 200)
        self.assertGreater(len(lines), 0)
        self.assertClean("\n".join(lines), "log")


class IntakeLeaseTests(SynchronousTestCase):
    """
    The merge of issues 19 and 22: the key's slot the intake admitted
    (C{Turn.keyLease}) is given back however the turn ends, also when the
    key policy or a budget refuses it before any account (before the merge
    the lease was taken over only after those checks, so a refused turn
    left its key's slot held).
    """

    def test_refusedTurnReleasesTheIntakeLease(self):
        from relay.base.records import ClientError
        from tests.test_runner import FakeSink

        rig = Rig([raccount("a")])
        refusal = ClientError(401, "invalid_request_error", "disabled", code="api_key_disabled")

        class Policy:
            def allowedAccounts(self, key):
                return None

            def refusal(self, key, model, now):
                return refusal

        rig.runner.keyPolicy = Policy()
        held = []
        rig.admission.tryAcquire("user", "t", 1).addCallback(held.append)
        key = ClientKey(name="t", key="k", concurrency=1)
        turn = Turn(entrypoint="http", endpoint="responses", client=key, model="gpt-5.5",
                    body={"model": "gpt-5.5", "input": "hi"}, stream=False, requestId="req")
        turn.keyAdmitted, turn.keyLease = True, held[0]
        sink = FakeSink()
        outcome = []
        rig.door.enter(turn, sink).addCallback(outcome.append)
        self.assertEqual(outcome, ["failed"])
        again = []
        rig.admission.tryAcquire("user", "t", 1).addCallback(again.append)
        self.assertIsNotNone(again[0], "the key's only slot is still held")
        self.assertEqual(rig.dialer.ids(), [])
