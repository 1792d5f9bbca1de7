"""
Unit tests of L{relay.process} (issue 14) on a L{Clock}: the live
accounts registry and its change hook, the key ring swap, the reload
(validate first, refuse restart-only keys, apply the rest, keep live
settings overrides), the retirement of a changed account's pooled
upstream connections, the graceful drain (grace, relay-cancelled turns,
slot release) and its HTTP gate, and the C{SIGHUP} edge.
"""

from __future__ import annotations

import json
import os
import signal

from attrs import evolve
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from zope.interface.verify import verifyObject

from relay.admission.memory import MemorySlotAdmission
from relay.entry.http import HealthResource, KeyRing
from relay.interfaces import ILiveAccounts, ISlotAdmission, ISlotDrain
from relay.base.records import Account, ClientKey, GatewaySettings
from relay.process.drain import (
    RESTART_CLOSE,
    DrainGate,
    GracefulDrain,
    shuttingDown,
)
from relay.process.live import AccountRegistry, AccountSetChange, LiveConfiguration
from relay.process.reload import ConfigReloader, refusedChanges
from relay.state.settings import RuntimeSettings
from relay.tap import ReloadOnHangup
from relay.upstream.ws import UpstreamPool
from tests.test_runner import OK_STREAM, T0, Rig, account, hang, sse


def events(logs, name):
    """
    @return: the captured log events named C{name}.
    """
    return [e for e in logs if e.get("event") == name]


def acct(id, **kw):
    """
    An API-key account.
    """
    return Account(id=id, type="apikey", base_url="http://u/v1", credential="c-" + id, **kw)


class RegistryTests(SynchronousTestCase):
    """
    The accounts' one home and its "account set changed" hook.
    """

    def test_interface(self):
        """
        L{AccountRegistry} provides L{ILiveAccounts}.
        """
        self.assertTrue(verifyObject(ILiveAccounts, AccountRegistry()))

    def test_readsLikeATuple(self):
        """
        Consumers iterate, index, count and look up by id.
        """
        a, b = acct("a"), acct("b")
        registry = AccountRegistry([a, b])
        self.assertEqual(list(registry), [a, b])
        self.assertEqual(len(registry), 2)
        self.assertIs(registry[1], b)
        self.assertIs(registry.byId("a"), a)
        self.assertIsNone(registry.byId("zz"))

    def test_replaceTellsSubscribersIds(self):
        """
        A replace puts the new set in force, then calls every subscriber
        with the ids added, removed and changed.
        """
        registry = AccountRegistry([acct("a"), acct("b"), acct("c")])
        seen = []
        registry.subscribe(lambda change: seen.append((change, [x.id for x in registry])))
        change = registry.replace([acct("a"), acct("b", priority=1), acct("d")])
        self.assertEqual(
            change,
            AccountSetChange(
                added=frozenset({"d"}), removed=frozenset({"c"}), changed=frozenset({"b"})
            ),
        )
        self.assertEqual(seen, [(change, ["a", "b", "d"])])
        self.assertEqual(
            change.asDict(),
            {"added": ["d"], "removed": ["c"], "changed": ["b"], "renewed": []},
        )

    def test_credentialChangeIsAChange(self):
        """
        A rotated credential is a change (the secret itself is never in it).
        """
        registry = AccountRegistry([acct("a")])
        change = registry.replace([evolve(acct("a"), credential="rotated")])
        self.assertEqual(change.changed, frozenset({"a"}))
        self.assertEqual(change.renewed, frozenset({"a"}))
        self.assertNotIn("rotated", repr(change))

    def test_renewedOnlyForIdentity(self):
        """
        A new credential, endpoint, ChatGPT account or proxy renews an
        account; priority, concurrency, models or mapping alone do not.
        """
        from relay.configuration.parse import parseProxyURL

        base = acct("a")
        registry = AccountRegistry([base])
        quiet = registry.replace([evolve(base, priority=1, concurrency=9, models=("m",),
                                         model_mapping={"x": "m"})])
        self.assertEqual((quiet.changed, quiet.renewed), (frozenset({"a"}), frozenset()))
        for renewed in (
            evolve(base, base_url="http://v/v1"),
            evolve(base, proxy=parseProxyURL("socks5://127.0.0.1:1080", "p", "proxy")),
        ):
            registry = AccountRegistry([base])
            self.assertEqual(registry.replace([renewed]).renewed, frozenset({"a"}))

    def test_noChangeNoCall(self):
        """
        Replacing with an equal set calls nobody.
        """
        registry = AccountRegistry([acct("a")])
        seen = []
        registry.subscribe(seen.append)
        self.assertFalse(registry.replace([acct("a")]))
        self.assertEqual(seen, [])

    def test_failingSubscriberIsLoggedOthersRun(self):
        """
        One subscriber's exception is logged; the others are still told.
        """
        registry = AccountRegistry([acct("a")])
        seen = []

        def broken(change):
            raise RuntimeError("boom")

        registry.subscribe(broken)
        registry.subscribe(seen.append)
        with capturedLogs() as logs:
            registry.replace([])
        self.assertEqual(len(seen), 1)
        self.assertEqual(len(events(logs, "relay.config_listener_failed")), 1)
        self.flushLoggedErrors(RuntimeError)

    def test_unsubscribe(self):
        """
        The callable C{subscribe} returns stops the calls.
        """
        registry = AccountRegistry([acct("a")])
        seen = []
        unsubscribe = registry.subscribe(seen.append)
        unsubscribe()
        registry.replace([])
        self.assertEqual(seen, [])


class KeyRingTests(SynchronousTestCase):
    """
    The one key ring every entrypoint authenticates with.
    """

    def test_replaceAndCurrent(self):
        """
        After a replace the new keys authenticate; C{current} maps an
        earlier key to its reloaded version, or L{None} once its secret is
        gone.
        """
        old = ClientKey("alice", "sk-a", 5)
        ring = KeyRing([old, ClientKey("bob", "sk-b")])
        ring.replace([ClientKey("alice", "sk-a", 9), ClientKey("carol", "sk-c")])
        self.assertEqual(ring.current(old).concurrency, 9)
        self.assertIsNone(ring.current(ClientKey("bob", "sk-b")))
        self.assertEqual(ring.authenticateSecret(b"sk-c").name, "carol")
        self.assertIsNone(ring.authenticateSecret(b"sk-b"))


CONFIG = """
listen: "tcp:0:interface=127.0.0.1"
admin_key: admin-one-0123456789
database: {database}
keys: {keys}
accounts: {accounts}
gateway: {gateway}
{extra}
"""


class _Pool:
    """
    Records retirements (an L{UpstreamPool} stand-in).
    """

    def __init__(self):
        self.retired = []

    def retire(self, accountId):
        self.retired.append(accountId)
        return 1


class ReloaderTests(SynchronousTestCase):
    """
    L{ConfigReloader}: validate completely first, refuse what needs a
    restart, apply the rest.
    """

    def setUp(self):
        self.dir = self.mktemp()
        os.makedirs(self.dir)
        self.path = os.path.join(self.dir, "relay.yaml")
        self.keys = [{"name": "alice", "key": "sk-relay-alice", "concurrency": 2}]
        self.accounts = [
            {"id": "a1", "type": "apikey", "api_key": "sk-up-1", "priority": 10},
            {"id": "a2", "type": "apikey", "api_key": "sk-up-2"},
        ]
        self.write()
        from relay.configuration.parse import loadConfig

        config = loadConfig(self.path)
        self.live = LiveConfiguration.fromConfig(config)
        self.settings = RuntimeSettings(current=config.gateway)
        self.pool = _Pool()
        self.live.accounts.subscribe(
            lambda change: [self.pool.retire(i) for i in sorted(change.changed | change.removed)]
        )
        self.reloader = ConfigReloader(path=self.path, live=self.live, settings=self.settings)

    def read(self) -> str:
        """
        @return: the configuration file's text.
        """
        with open(self.path, encoding="utf-8") as f:
            return f.read()

    def write(self, gateway="{}", extra="", keys=None, accounts=None, text=None):
        """
        Write the configuration file.
        """
        if text is None:
            text = CONFIG.format(
                database=json.dumps(os.path.join(self.dir, "s.sqlite")),
                keys=json.dumps(keys if keys is not None else self.keys),
                accounts=json.dumps(accounts if accounts is not None else self.accounts),
                gateway=gateway,
                extra=extra,
            )
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(text)

    def test_badFileChangesNothing(self):
        """
        A file that does not validate changes nothing; its problem is one
        line, logged as C{relay.config_reload_failed}.
        """
        before = (self.live.config, tuple(self.live.accounts), self.live.keys.keys)
        self.write(gateway="{max_account_switches: lots}")
        with capturedLogs() as logs:
            result = self.reloader.reload("sighup")
        self.assertFalse(result.applied)
        self.assertEqual(len(result.problems), 1)
        self.assertIn("gateway.max_account_switches", result.problems[0])
        self.assertNotIn("\n", result.problems[0])
        failed = events(logs, "relay.config_reload_failed")
        self.assertEqual([e["problem"] for e in failed], list(result.problems))
        self.assertEqual((self.live.config, tuple(self.live.accounts), self.live.keys.keys), before)
        self.assertEqual(self.pool.retired, [])
        self.assertEqual(result.asDict()["applied"], False)

    def test_syntaxErrorAndMissingFile(self):
        """
        A YAML syntax error and a missing file are problems too.
        """
        self.write(text="keys: [\n")
        self.assertIn("YAML syntax error", self.reloader.reload().problems[0])
        os.remove(self.path)
        self.assertIn("cannot read", self.reloader.reload().problems[0])

    def test_startupChecksEachOneLine(self):
        """
        The start-up component and database checks run too; each problem
        is its own line and nothing is applied.
        """
        self.write(text=(
            'listen: "tcp:0:interface=127.0.0.1"\n'
            f"database: {json.dumps(os.path.join(self.dir, 'missing', 'x.sqlite'))}\n"
            "components: {classifier: nowhere.Classifier}\n"
        ))
        result = self.reloader.reload()
        self.assertFalse(result.applied)
        self.assertEqual(len(result.problems), 2)
        self.assertTrue(result.problems[0].startswith("components.classifier:"))
        self.assertTrue(result.problems[1].startswith("database:"))
        self.assertEqual(len(self.live.accounts), 2)

    def test_appliesAccountsAndKeys(self):
        """
        New keys and accounts are in force at once, removed ones are gone,
        changed ones replaced; the change names ids, never secrets.
        """
        self.write(
            keys=[{"name": "bob", "key": "sk-relay-bob"}],
            accounts=[
                {"id": "a1", "type": "apikey", "api_key": "sk-up-1-rotated", "priority": 10},
                {"id": "a3", "type": "apikey", "api_key": "sk-up-3"},
            ],
        )
        with capturedLogs() as logs:
            result = self.reloader.reload("admin")
        self.assertTrue(result.applied)
        self.assertEqual(result.refused, ())
        self.assertEqual([a.id for a in self.live.accounts], ["a1", "a3"])
        self.assertEqual(self.live.accounts.byId("a1").credential, "sk-up-1-rotated")
        self.assertIsNone(self.live.keys.authenticateSecret(b"sk-relay-alice"))
        self.assertEqual(self.live.keys.authenticateSecret(b"sk-relay-bob").name, "bob")
        self.assertEqual(
            result.asDict()["changes"]["accounts"],
            {"added": ["a3"], "removed": ["a2"], "changed": ["a1"], "renewed": ["a1"]},
        )
        self.assertEqual(
            result.keys, {"added": ["bob"], "removed": ["alice"], "changed": []}
        )
        self.assertEqual(self.pool.retired, ["a1", "a2"])
        [done] = events(logs, "relay.config_reloaded")
        self.assertEqual(done["added"], ["a3"])
        self.assertEqual(done["keys_added"], ["bob"])
        text = json.dumps(result.asDict()) + repr(done)
        for secret in ("sk-up-1-rotated", "sk-relay-bob", "sk-up-3"):
            self.assertNotIn(secret, text)

    def test_unchangedAccountsKeepTheirObjects(self):
        """
        A reload that changes only the gateway retires nothing.
        """
        self.write(gateway="{max_account_switches: 3}")
        result = self.reloader.reload()
        self.assertTrue(result.applied)
        self.assertFalse(result.accounts)
        self.assertEqual(self.pool.retired, [])
        self.assertEqual(self.settings.current.max_account_switches, 3)
        self.assertIn("max_account_switches", result.gateway)

    def test_nothingChangedSaysSo(self):
        """
        A reload of the same file (e.g. a forwarded SIGHUP reaching a worker
        that already read it) logs "nothing changed", not empty lists;
        a change is listed.
        """
        with capturedLogs() as logs:
            self.reloader.reload("sighup")
        [same] = events(logs, "relay.config_reloaded")
        self.assertIn("nothing changed", formatEvent(same))
        self.write(gateway="{max_account_switches: 3}")
        with capturedLogs() as logs:
            self.reloader.reload("sighup")
        [changed] = events(logs, "relay.config_reloaded")
        self.assertIn("max_account_switches", formatEvent(changed))

    def test_refusedKeysKeptRestApplied(self):
        """
        C{listen}, C{state.*}, C{components.*}, C{database} and
        C{log.format} changes are refused, one line each; the rest applies.
        """
        self.write(
            accounts=self.accounts[:1],
            extra=(
                "state: {on_redis_error: fail_closed}\n"
                "log: {format: json}\n"
            ),
        )
        text = self.read().replace("tcp:0:", "tcp:1234:")
        self.write(text=text)
        with capturedLogs() as logs:
            result = self.reloader.reload()
        self.assertTrue(result.applied)
        self.assertEqual(result.refused, ("listen", "log.format", "state.on_redis_error"))
        self.assertEqual(self.live.config.listen, "tcp:0:interface=127.0.0.1")
        self.assertEqual(self.live.config.state.on_redis_error, "fail_open")
        self.assertEqual(self.live.config.log_format, "text")
        self.assertEqual([a.id for a in self.live.accounts], ["a1"])
        self.assertEqual(
            [e["key"] for e in events(logs, "relay.config_reload_refused")],
            ["listen", "log.format", "state.on_redis_error"],
        )
        refused = result.asDict()["refused"]
        self.assertEqual(refused[0]["key"], "listen")
        self.assertIn("restart", refused[0]["message"])

    def test_refusedChangesNeverCarryValues(self):
        """
        A changed Redis URL is named, its value (which may hold a password)
        is not.
        """
        from relay.configuration.parse import settingsFromString

        old = settingsFromString("state: {backend: redis, redis_url: 'redis://:pw1@h:1/0'}")
        new = settingsFromString("state: {backend: redis, redis_url: 'redis://:pw2@h:1/0'}")
        self.assertEqual(refusedChanges(old, new), ("state.redis_url",))

    def test_listenOverrideIsNotAChange(self):
        """
        With C{--listen} given at start-up, the file's C{listen} is
        overridden on reload too, so it is not reported as refused.
        """
        overridden = evolve(self.live.config, listen="tcp:9999")
        self.live.config = overridden
        self.reloader.listenOverride = "tcp:9999"
        result = self.reloader.reload()
        self.assertEqual(result.refused, ())

    def test_adminKeyRotates(self):
        """
        A changed admin key is in force at once (read per request).
        """
        self.write(text=self.read().replace("admin-one-0123456789", "admin-two-0123456789"))
        result = self.reloader.reload()
        self.assertTrue(result.adminKeyChanged)
        self.assertEqual(self.live.adminKey(), "admin-two-0123456789")
        self.assertNotIn("admin-two-0123456789", json.dumps(result.asDict()))

    def test_liveOverrideWinsOverFile(self):
        """
        A value set with C{PUT /admin/settings} (an override) still wins
        after a reload; the file changes the base of the others.
        """
        self.successResultOf(self.settings.update({"retry_interval_ms": 250}))
        self.write(gateway="{retry_interval_ms: 1000, max_account_switches: 4,"
                           " shutdown_grace_seconds: 7}")
        result = self.reloader.reload()
        self.assertEqual(self.settings.current.retry_interval_ms, 250)
        self.assertEqual(self.settings.current.max_account_switches, 4)
        self.assertEqual(self.settings.current.shutdown_grace_seconds, 7)
        self.assertNotIn("retry_interval_ms", result.gateway)
        self.assertIn("shutdown_grace_seconds", result.gateway)

    def test_noPath(self):
        """
        A relay built without a file reports that, changing nothing.
        """
        self.reloader.path = None
        result = self.reloader.reload()
        self.assertFalse(result.applied)
        self.assertIn("no configuration file", result.problems[0])

    def test_secretsRegisteredForRedaction(self):
        """
        A secret that arrives in a reload is redacted from logs afterwards.
        """
        from relay.base.logs import observerFor

        self.write(keys=[{"name": "new", "key": "sk-relay-brand-new-secret-0001"}])
        self.reloader.reload()
        import io

        out = io.StringIO()
        observer = observerFor("json", out)
        observer({"log_format": "{x}", "x": "sk-relay-brand-new-secret-0001", "log_level": None,
                  "log_namespace": "t", "log_time": 0.0})
        self.assertNotIn("sk-relay-brand-new-secret-0001", out.getvalue())


class RebaseTests(SynchronousTestCase):
    """
    L{RuntimeSettings.rebase}: the file is the base; live overrides win.
    """

    def test_overridesFromStoreWin(self):
        """
        Values loaded from the settings store at start-up stay in force
        over a reloaded file.
        """

        class Store:
            def load(self):
                return succeed({"breaker.failures": 9})

        settings = RuntimeSettings(current=GatewaySettings(), store=Store())
        self.successResultOf(settings.start())
        changed = settings.rebase(
            evolve(GatewaySettings(), breaker=evolve(GatewaySettings().breaker, failures=2),
                   first_output_timeout_seconds=60)
        )
        self.assertEqual(settings.current.breaker.failures, 9)
        self.assertEqual(settings.current.first_output_timeout_seconds, 60)
        self.assertEqual(changed, {"first_output_timeout_seconds": 60})
        self.assertEqual(settings.overrides, {"breaker.failures": 9})


class _Proto:
    closed = False

    def __init__(self):
        self.listener = None

    def close(self):
        self.closed = True


class _Settings:
    current = GatewaySettings()


class PoolRetireTests(SynchronousTestCase):
    """
    A changed account's pooled upstream connections are retired when
    idle; other accounts' stay.
    """

    def setUp(self):
        self.clock = Clock()

        async def dial(account, headers):
            return _Proto()

        self.pool = UpstreamPool(reactor=self.clock, settings=_Settings(), dial=dial)

    def acquire(self, account):
        return self.successResultOf(Deferred.fromCoroutine(self.pool.acquire(account, {})))

    def test_retire(self):
        """
        Idle connections close at once, busy ones when given back and are
        never lent again; the other account's connection is untouched.
        """
        a, b = acct("a", concurrency=2), acct("b")
        idle, busy, other = self.acquire(a), self.acquire(a), self.acquire(b)
        self.pool.release(idle)
        self.pool.release(other)
        with capturedLogs() as logs:
            self.assertEqual(self.pool.retire("a"), 2)
        self.assertEqual(len(events(logs, "relay.ws_upstream_retired")), 1)
        self.assertTrue(idle.proto.closed)
        self.assertFalse(busy.proto.closed)
        self.pool.release(busy)
        self.assertTrue(busy.proto.closed)
        self.assertEqual(self.pool.counts("a"), (0, 0, 0))
        fresh = self.acquire(a)
        self.assertNotIn(fresh, (idle, busy))
        self.assertFalse(other.proto.closed)
        self.assertIs(self.acquire(b), other)
        self.assertEqual(self.pool.retire("nobody"), 0)


class _Conn:
    """
    A client WebSocket stand-in: records L{drain} calls.
    """

    def __init__(self):
        self.drained = 0

    def drain(self):
        self.drained += 1


class _Factory:
    """
    The client WebSocket factory's drain surface.
    """

    def __init__(self, *connections):
        self.openConnections = set(connections)
        self.draining = False


class DrainTests(SynchronousTestCase):
    """
    L{GracefulDrain} with the real engine on a L{Clock}.
    """

    def setUp(self):
        self.rig = Rig([account("a")], shutdown_grace_seconds=10)
        self.conn = _Conn()
        self.factory = _Factory(self.conn)
        self.drain = GracefulDrain(
            clock=self.rig.clock, runner=self.rig.runner, settings=self.rig.settings,
            admission=self.rig.admission, wsFactory=self.factory,
        )

    def test_admissionProvidesDrain(self):
        """
        Both admission providers can give everything back.
        """
        self.assertTrue(verifyObject(ISlotDrain, self.rig.admission))
        self.assertTrue(verifyObject(ISlotAdmission, self.rig.admission))

    def test_turnFinishingInGrace(self):
        """
        A turn that ends within the grace ends normally; nothing is
        cancelled; the drain ends when it does.
        """
        self.rig.script("a", sse(*OK_STREAM, delay=4))
        _, sink, outcome = self.rig.run()
        self.assertEqual(len(self.rig.runner.inflight), 1)
        d = self.drain.drain()
        self.assertTrue(self.drain.draining)
        self.assertTrue(self.factory.draining)
        self.assertEqual(self.conn.drained, 1)
        self.assertNoResult(d)
        self.rig.clock.advance(4)
        report = self.successResultOf(d)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(sink.errors, [])
        self.assertEqual((report.finished, report.cancelled, report.released), (1, 0, 0))
        self.assertEqual(self.rig.runner.inflight, {})

    def test_graceOverCancelsAsRelay(self):
        """
        When the grace runs out the turn is cancelled by relay: no account
        state is written (R2), the slot is free, and the client gets the
        503 / 1001 "server restarting" terminal error.
        """
        self.rig.script("a", hang())
        _, sink, outcome = self.rig.run()
        with capturedLogs() as logs:
            d = self.drain.drain()
            self.rig.clock.advance(9.9)
            self.assertNoResult(d)
            self.rig.clock.advance(0.1)
            report = self.successResultOf(d)
        self.assertEqual(outcome, ["relay_cancelled"])
        self.assertEqual(sink.errors, [shuttingDown()])
        self.assertEqual(sink.errors[0].wsClose, RESTART_CLOSE)
        self.assertIn((b"retry-after", b"1"), sink.errors[0].headers)
        self.assertEqual((report.finished, report.cancelled), (0, 1))
        self.assertEqual(self.rig.load("a"), {"a": (0, 0)})
        self.assertEqual(self.rig.state("a").blockedUntil, 0)
        self.assertEqual(self.rig.health._breakers, {})
        [finished] = events(logs, "relay.turn_finished")
        self.assertEqual(finished["outcome"], "relay_cancelled")
        self.assertEqual(len(events(logs, "relay.drain_cancelled")), 1)
        self.assertEqual(len(events(logs, "relay.drain_finished")), 1)

    def test_waitingTurnCancelledToo(self):
        """
        A turn waiting for a slot when the grace runs out leaves its queue
        and is told the same way.
        """
        self.rig = Rig([account("a", concurrency=1)], shutdown_grace_seconds=2)
        self.drain = GracefulDrain(
            clock=self.rig.clock, runner=self.rig.runner, settings=self.rig.settings,
            admission=self.rig.admission,
        )
        self.rig.script("a", hang())
        self.rig.run()
        _, waiting, outcome = self.rig.run()
        self.assertEqual(self.rig.load("a"), {"a": (1, 1)})
        d = self.drain.drain()
        self.rig.clock.advance(2)
        self.assertEqual(self.successResultOf(d).cancelled, 2)
        self.assertEqual(outcome, ["relay_cancelled"])
        self.assertEqual(waiting.errors[0].code, "server_restarting")
        self.assertEqual(self.rig.load("a"), {"a": (0, 0)})

    def test_leftoverLeasesReleased(self):
        """
        A lease nobody released (a bug elsewhere) is given back at the end
        and counted.
        """
        lease = self.successResultOf(self.rig.admission.tryAcquire("account", "a", 1))
        report = self.successResultOf(self.drain.drain(grace=0))
        self.assertEqual(report.released, 1)
        self.assertTrue(lease.released)
        self.assertEqual(self.rig.load("a"), {"a": (0, 0)})

    def test_idempotent(self):
        """
        A second drain call gets the same report.
        """
        first = self.successResultOf(self.drain.drain(grace=0))
        second = self.successResultOf(self.drain.drain(grace=0))
        self.assertIs(first, second)

    def test_memoryReleaseAllOnlyWhatIsHeld(self):
        """
        L{MemorySlotAdmission.releaseAll} releases held leases and leaves
        nothing queued.
        """
        admission = MemorySlotAdmission(clock=Clock())
        self.successResultOf(admission.tryAcquire("user", "k", 2))
        self.successResultOf(admission.tryAcquire("user", "k", 2))
        self.assertEqual(self.successResultOf(admission.releaseAll(1)), 2)
        self.assertEqual(self.successResultOf(admission.load("user", ["k"])), {"k": (0, 0)})


class GateTests(SynchronousTestCase):
    """
    L{DrainGate}: requests on a kept-alive connection during the drain get
    503, C{Retry-After} and C{Connection: close}, in OpenAI's format.
    """

    def test_keptAliveConnectionRefusedDuringDrain(self):
        """
        Before the drain the request is served and the connection kept;
        during it the next request on the same connection gets the 503
        and the connection closes.
        """
        clock = Clock()
        clock.advance(T0)
        root = Resource()
        root.putChild(b"healthz", HealthResource())
        drain = GracefulDrain(clock=clock, runner=Rig([]).runner, settings=RuntimeSettings())
        site = Site(DrainGate(root, drain), reactor=clock)
        protocol = site.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        protocol.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"200 OK", transport.value())
        self.assertFalse(transport.disconnecting)
        transport.clear()
        drain.start()
        protocol.dataReceived(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 503"))
        headers = head.lower()
        self.assertIn(b"retry-after: 1", headers)
        self.assertIn(b"connection: close", headers)
        self.assertIn(b"transfer-encoding: chunked", headers)
        size, _, rest = body.partition(b"\r\n")
        error = json.loads(rest[: int(size, 16)])["error"]
        self.assertEqual(error["code"], "server_restarting")
        self.assertEqual(error["type"], "api_error")
        self.assertTrue(transport.disconnecting)
        protocol.connectionLost(None)

    def test_putChildMountsOnRoot(self):
        """
        Children added through the gate land on the real root.
        """
        root = Resource()
        gate = DrainGate(root, GracefulDrain(clock=Clock(), runner=None, settings=None))
        child = Resource()
        gate.putChild(b"admin", child)
        self.assertIs(root.children[b"admin"], child)


class _SignalReactor:
    """
    Records C{callFromThread}.
    """

    def __init__(self):
        self.calls = []

    def callFromThread(self, f, *args):
        self.calls.append((f, args))


class HangupTests(SynchronousTestCase):
    """
    C{SIGHUP} at the process edge (L{relay.tap.ReloadOnHangup}).
    """

    def test_installedWhileRunning(self):
        """
        Starting installs the handler; the signal schedules the reload on
        the reactor thread; once stopping (the drain) a C{SIGHUP} is logged
        and ignored, never the default action that would kill the process.
        """
        previous = signal.getsignal(signal.SIGHUP)
        self.addCleanup(signal.signal, signal.SIGHUP, previous)
        reloads = []
        reactor = _SignalReactor()
        service = ReloadOnHangup(reloads.append, reactor)
        service.startService()
        try:
            handler = signal.getsignal(signal.SIGHUP)
            self.assertNotEqual(handler, previous)
            handler(signal.SIGHUP, None)
            self.assertEqual(reloads, [])
            [(call, args)] = reactor.calls
            call(*args)
            self.assertEqual(reloads, ["sighup"])
        finally:
            service.stopService()
        handler = signal.getsignal(signal.SIGHUP)
        self.assertNotIn(handler, (signal.SIG_DFL, previous))
        reactor.calls.clear()
        handler(signal.SIGHUP, None)
        [(call, args)] = reactor.calls
        with capturedLogs() as logs:
            call(*args)
        self.assertEqual(len(events(logs, "relay.config_reload_ignored")), 1)
        self.assertEqual(reloads, ["sighup"])

    def test_reloadFailureIsLogged(self):
        """
        A reload that raises is logged; the process stays up.
        """

        def broken(source):
            raise RuntimeError("bug")

        service = ReloadOnHangup(broken, _SignalReactor())
        with capturedLogs() as logs:
            service._reloadNow()
        self.assertEqual(len(events(logs, "relay.config_reload_failed")), 1)
        self.flushLoggedErrors(RuntimeError)


class _ExitReactor:
    _exitSignal = None


class CleanExitTests(SynchronousTestCase):
    """
    L{relay.tap.CleanExitOnTerm}: a drained C{SIGTERM} stop exits 0.
    """

    def test_termForgotten(self):
        """
        After a C{SIGTERM} stop the reactor no longer asks twistd to
        re-raise it (exit status 0).
        """
        from relay.tap import CleanExitOnTerm

        reactor = _ExitReactor()
        reactor._exitSignal = signal.SIGTERM
        service = CleanExitOnTerm(reactor)
        service.startService()
        service.stopService()
        self.assertIsNone(reactor._exitSignal)

    def test_otherSignalsKept(self):
        """
        C{SIGINT} keeps twistd's behaviour.
        """
        from relay.tap import CleanExitOnTerm

        reactor = _ExitReactor()
        reactor._exitSignal = signal.SIGINT
        service = CleanExitOnTerm(reactor)
        service.startService()
        service.stopService()
        self.assertEqual(reactor._exitSignal, signal.SIGINT)


class _Redis:
    """
    A L{relay.wire.redisclient.RedisService} stand-in whose commands complete
    when the test says so.
    """

    def __init__(self):
        self.calls = []

    def execute(self, timeout, method, *args, **kwargs):
        d = Deferred()
        self.calls.append((method, args, d))
        return d


class RedisReleaseAllTests(SynchronousTestCase):
    """
    L{RedisSlotAdmission.releaseAll}: leftover leases are released and the
    drain waits (bounded) until the commands have landed.
    """

    def setUp(self):
        from relay.admission.redis import RedisSlotAdmission

        self.clock = Clock()
        self.redis = _Redis()
        self.admission = RedisSlotAdmission(redis=self.redis, clock=self.clock, prefix="p")

    def test_interfaces(self):
        """
        The Redis provider can give everything back.
        """
        self.assertTrue(verifyObject(ISlotDrain, self.admission))

    def test_waitsForReleaseToLand(self):
        """
        A held lease is released with a ZREM; the result waits for it.
        """
        lease = self.admission._lease("account", "a1", "p-1")
        d = self.admission.releaseAll(5)
        self.assertTrue(lease.released)
        [(method, args, zrem)] = self.redis.calls
        self.assertEqual((method, args[0]), ("execute_command", "ZREM"))
        self.assertNoResult(d)
        zrem.callback(1)
        self.assertEqual(self.successResultOf(d), 1)

    def test_inFlightQueueCommandsAwaited(self):
        """
        A wait-queue departure still in flight is awaited too, at most
        C{timeout} seconds; then the drain goes on, logging it.
        """
        from relay.base.records import WaitPlan

        self.admission._leave(WaitPlan("account", "a1", 1, 5, 5), "p-2", True)
        d = self.admission.releaseAll(2)
        self.assertNoResult(d)
        with capturedLogs() as logs:
            self.clock.advance(2)
        self.assertEqual(self.successResultOf(d), 0)
        self.assertEqual(
            [e["operation"] for e in events(logs, "relay.redis_admission_error")],
            ["release_all"],
        )
