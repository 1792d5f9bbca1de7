"""
Issue 24: the fast paths of a turn's end (after the upstream's answer) give
what the general paths give, on the same inputs: the owner records of
L{AccountScheduler.recordResponse} written straight to a store with
C{setValues} against the coroutine path of a store without it, and the
memory store's C{setValues} against one C{setValue} per key (persisted rows
included).
"""

from __future__ import annotations

import json
import random

from twisted.internet.defer import fail
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from relay.admission.memory import MemorySlotAdmission
from relay.base.eager import eagerDeferred
from relay.base.records import Account, ClientKey, GatewaySettings, SchedulingSettings, Turn
from relay.scheduling.itemowners import itemOwnerKey
from relay.scheduling.scheduler import (
    AccountScheduler,
    ownerRecord,
    responseKey,
    responseKeys,
    responseOwnerKey,
)
from relay.state.settings import RuntimeSettings
from relay.state.durable import SQLiteValues
from relay.state.memory import MemoryStateStore
from relay.base.requestnotes import notesOf
from tests.test_durable import _Database

ALICE = ClientKey(name="alice", key="sk-alice")
IDS = ["resp_1", "resp_\u00e9\u4e2d", "", "r" * 300]


class _NoSetValues:
    """
    A store without C{setValues} (an operator's component): the scheduler's
    general path, one C{setValue} per record.
    """

    def __init__(self, store):
        self._inner = store

    def __getattr__(self, name):
        if name == "setValues":
            raise AttributeError(name)
        return getattr(self._inner, name)


class _Failing(MemoryStateStore):
    """
    A memory store whose C{setValues} fails: synchronously (C{raises}) or
    through its Deferred.
    """

    raises = False

    def setValues(self, pairs, ttl):
        if self.raises:
            raise RuntimeError("store down")
        return fail(RuntimeError("store down"))


def _turn(items=()):
    t = Turn(entrypoint="http", endpoint="responses", client=ALICE, model="gpt-5",
             body={}, stream=False, requestId="req_1")
    t.outputItemIds = tuple(items)
    return t


class DigestTests(SynchronousTestCase):

    def test_responseKeys(self):
        """
        L{responseKeys} (one digest) is L{responseKey} and
        L{responseOwnerKey} (one digest each).
        """
        for responseId in IDS:
            self.assertEqual(responseKeys(responseId),
                             (responseKey(responseId), responseOwnerKey(responseId)))

    def test_ownerRecord(self):
        """
        The cached owner record is the compact JSON the scheduler wrote per
        turn, the first time and every time after.
        """
        for key, account in [("alice", "a"), ('q"uote', "\u00e9"), ("k#2", "acct\\1")]:
            expected = json.dumps({"key": key, "account": account}, separators=(",", ":"))
            self.assertEqual(ownerRecord(key, account), expected)
            self.assertEqual(ownerRecord(key, account), expected)


class RecordResponseTests(SynchronousTestCase):
    """
    C{recordResponse} on a store with C{setValues} (no coroutine) writes
    what the general path writes.
    """

    def scheduler(self, store, clock):
        account = Account(id="a", type="apikey", base_url="https://api.example/v1", credential="c")
        settings = RuntimeSettings(GatewaySettings(scheduling=SchedulingSettings(
            previous_response_ttl_seconds=10, response_owner_ttl_seconds=50)))
        return AccountScheduler(
            accounts=[account], admission=MemorySlotAdmission(clock=clock), store=store,
            clock=clock, settings=settings, random=random.Random(1),
        ), account

    def test_sameRecords(self):
        """
        The same keys, values and expiry times, with and without output
        items, and the same local owner map.
        """
        for items in [(), ("msg_1", "fc_2")]:
            clock = Clock()
            clock.advance(1000)
            fast, general = MemoryStateStore(clock=clock), MemoryStateStore(clock=clock)
            fastScheduler, account = self.scheduler(fast, clock)
            generalScheduler, _ = self.scheduler(_NoSetValues(general), clock)
            for responseId in ["resp_1", "resp_2"]:
                self.assertIsNone(self.successResultOf(
                    fastScheduler.recordResponse(_turn(items), responseId, account)))
                self.assertIsNone(self.successResultOf(
                    generalScheduler.recordResponse(_turn(items), responseId, account)))
            self.assertEqual(fast._values, general._values)
            self.assertEqual(len(fast._values), 4 + len(items))  # the items: one record each
            self.assertEqual(fast._values[itemOwnerKey("msg_1")][0] if items else None,
                             '{"key":"alice","account":"a"}' if items else None)
            self.assertEqual(fastScheduler._bindings._localOwners,
                             generalScheduler._bindings._localOwners)

    def test_sameAsCoroutine(self):
        """
        The fast path writes what the coroutine path
        (C{_recordResponse}, still used without C{setValues}) writes on
        the same store type.
        """
        clock = Clock()
        fast, slow = MemoryStateStore(clock=clock), MemoryStateStore(clock=clock)
        fastScheduler, account = self.scheduler(fast, clock)
        slowScheduler, _ = self.scheduler(slow, clock)
        self.successResultOf(fastScheduler.recordResponse(_turn(["rs_1"]), "resp_9", account))
        self.successResultOf(eagerDeferred(
            slowScheduler._bindings._recordResponse(_turn(["rs_1"]), "resp_9", account)))
        self.assertEqual(fast._values, slow._values)

    def test_failureLoggedAlike(self):
        """
        A store write that fails (at once or through its Deferred) is
        logged as the coroutine path logs it, and the Deferred fires with
        L{None} (R35 fail-open).
        """
        for raises in (False, True):
            clock = Clock()
            lines = []
            for path in ("fast", "coroutine"):
                store = _Failing(clock=clock)
                store.raises = raises
                scheduler, account = self.scheduler(store, clock)
                with capturedLogs() as logs:
                    if path == "fast":
                        d = scheduler.recordResponse(_turn(["msg_1"]), "resp_1", account)
                    else:
                        d = eagerDeferred(
                            scheduler._bindings._recordResponse(_turn(["msg_1"]), "resp_1", account))
                    self.assertIsNone(self.successResultOf(d))
                lines.append([(e["event"], e["op"], e["key"], e["error"], e["log_level"])
                              for e in logs if e.get("event") == "openai.sticky_write_failed"])
            self.assertEqual(len(lines[0]), 1)
            self.assertEqual(lines[0], lines[1])

    def test_pendingWrite(self):
        """
        A write still on its way (a remote store) fires the Deferred with
        L{None} when it lands, not with the store's result.
        """
        from twisted.internet.defer import Deferred

        clock = Clock()
        pending = Deferred()

        class Remote(MemoryStateStore):
            def setValues(self, pairs, ttl):
                return pending

        scheduler, account = self.scheduler(Remote(clock=clock), clock)
        d = scheduler.recordResponse(_turn(), "resp_1", account)
        self.assertNoResult(d)
        pending.callback(["OK"])
        self.assertIsNone(self.successResultOf(d))

    def test_noResponseId(self):
        """
        No id, nothing written.
        """
        clock = Clock()
        store = MemoryStateStore(clock=clock)
        scheduler, account = self.scheduler(store, clock)
        self.assertIsNone(self.successResultOf(scheduler.recordResponse(_turn(), None, account)))
        self.assertEqual(store._values, {})


class SaveManyTests(SynchronousTestCase):
    """
    L{SQLiteValues.saveMany} with C{onFailure} (no Deferred) writes what
    one L{SQLiteValues.save} per row writes, and tells only a failure.
    """

    ROWS = (("k1", "v1", 100.0), ("k2", "v2", 100.0), ("k1", "v1b", 100.0))

    def test_sameRows(self):
        fastDb, oneDb = _Database(), _Database()
        failures = []
        self.assertIsNone(SQLiteValues(fastDb).saveMany(self.ROWS, failures.append))
        one = SQLiteValues(oneDb)
        waits = [one.save(*row) for row in self.ROWS]
        for db in (fastDb, oneDb):
            while db.queued:
                db.finish()
        for d in waits:
            self.successResultOf(d)
        self.assertEqual(fastDb.rows(), oneDb.rows())
        self.assertEqual(fastDb.rows(), [("k1", "v1b"), ("k2", "v2")])
        self.assertEqual(failures, [])

    def test_failureTold(self):
        db = _Database()
        failures = []
        values = SQLiteValues(db)
        values.saveMany(self.ROWS, failures.append)
        plain = values.saveMany([("k3", "v3", 100.0)])
        for _ in range(2):
            # The first write carries the first call's rows; the second call's wait for the next.
            _, _, d = db.queued.pop(0)
            d.errback(RuntimeError("disk"))
            self.assertEqual([f.type for f in failures], [RuntimeError])
        self.failureResultOf(plain, RuntimeError)


class SetValuesTests(SynchronousTestCase):
    """
    The memory store's C{setValues} (persisted rows in one change) against
    one C{setValue} per key.
    """

    PAIRS = (("sticky_session:0:openai:response:x", "a", 10),
             ("openai:http-response-owner:key:x", "{}", 50),
             ("openai:http-response-owner:item:y", "{}", 50),
             ("plain", "v"))

    def stores(self, **kw):
        clock = Clock()
        clock.advance(100)
        out = []
        for _ in range(2):
            db = _Database()
            store = MemoryStateStore(clock=clock, **kw)
            store.durable = SQLiteValues(db)
            out.append((store, db))
        return out

    def test_same(self):
        """
        The same values, expiry times and persisted rows.
        """
        (fast, fastDb), (one, oneDb) = self.stores()
        self.successResultOf(fast.setValues(self.PAIRS, 7))
        for pair in self.PAIRS:
            self.successResultOf(one.setValue(pair[0], pair[1], pair[2] if len(pair) > 2 else 7))
        self.assertEqual(fast._values, one._values)
        while oneDb.queued:
            oneDb.finish()
        while fastDb.queued:
            fastDb.finish()
        self.assertEqual(fastDb.rows(), oneDb.rows())
        self.assertEqual(len(fastDb.rows()), 2)

    def test_evictionSame(self):
        """
        Over C{maxValues}, the same values are kept.
        """
        (fast, _), (one, _) = self.stores(maxValues=2)
        self.successResultOf(fast.setValues(self.PAIRS, 7))
        for pair in self.PAIRS:
            self.successResultOf(one.setValue(pair[0], pair[1], pair[2] if len(pair) > 2 else 7))
        self.assertEqual(fast._values, one._values)

    def test_failureLoggedPerKey(self):
        """
        A failed persist logs one line per key, as a failed C{setValue}.
        """

        class Broken:
            def saveMany(self, rows, onFailure):
                from twisted.python.failure import Failure

                onFailure(Failure(RuntimeError("disk")))

            def save(self, key, value, expires):
                return fail(RuntimeError("disk"))

        lines = []
        for fastPath in (True, False):
            store = MemoryStateStore(clock=Clock())
            store.durable = Broken()
            with capturedLogs() as logs:
                if fastPath:
                    store.setValues(self.PAIRS, 7)
                else:
                    for pair in self.PAIRS:
                        store.setValue(pair[0], pair[1], pair[2] if len(pair) > 2 else 7)
            lines.append([(e["log_format"], e["key"]) for e in logs])
            self.flushLoggedErrors(RuntimeError)
        self.assertEqual(len(lines[0]), 2)
        self.assertEqual(lines[0], lines[1])

    def test_noDurable(self):
        """
        Without a durable store, the values alone.
        """
        clock = Clock()
        fast, one = MemoryStateStore(clock=clock), MemoryStateStore(clock=clock)
        self.assertIsNone(self.successResultOf(fast.setValues(self.PAIRS, 7)))
        for pair in self.PAIRS:
            one.setValue(pair[0], pair[1], pair[2] if len(pair) > 2 else 7)
        self.assertEqual(fast._values, one._values)



class AccessLineTests(SynchronousTestCase):
    """
    The access line (L{relay.process.app._Site.log}) skips L{relay.base.logs.redactQuery}
    for a target without a query: the same C{path} and format either way.
    """

    def line(self, uri, started):
        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import globalLogPublisher
        from twisted.web.resource import Resource
        from twisted.web.test.requesthelper import DummyRequest

        from relay.process.app import _Site

        site = _Site(Resource())
        site.clock = Clock()
        site.clock.advance(5)
        request = DummyRequest([b"v1"])
        request.method = b"POST"
        request.uri = uri
        request.code = 200
        request.sentLength = 3
        if started is not None:
            notesOf(request).startedAt = started
        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        site.log(request)
        [event] = [e for e in events if e.get("event") == "relay.http_access"]
        return event

    def test_sameAsRedacted(self):
        """
        Every target's C{path} is what L{redactQuery} gives (cut at 512),
        and the format names C{duration_ms} exactly when it was measured.
        """
        from relay.base.logs import redactQuery

        for uri in [b"/v1/responses", b"/v1/responses?api_key=sk-1&stream=true",
                    b"/x?", b"/caf\xe9/" + b"p" * 600, b"/a?token=" + b"t" * 600]:
            for started in (None, 4.5):
                event = self.line(uri, started)
                self.assertEqual(event["path"], redactQuery(uri.decode("latin-1"))[:512])
                self.assertEqual(
                    event["log_format"],
                    '{client} "{method} {path}" {status} {bytes}'
                    + (" in {duration_ms}ms" if started is not None else ""))
                self.assertEqual(event["duration_ms"],
                                 None if started is None else 500.0)


class TurnFinishedTests(SynchronousTestCase):
    """
    C{relay.turn_finished}'s token fields, inlined in
    L{relay.engine.record.finished}, are L{_usageFields}' and
    keep their place among the fields.
    """

    def finished(self, stream):
        from tests.test_runner import Rig, account, sse

        rig = Rig([account("a")])
        rig.script("a", sse(*stream))
        with capturedLogs() as logs:
            turn, _, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        [event] = [e for e in logs if e.get("event") == "relay.turn_finished"]
        return turn, event

    def test_sameFields(self):
        """
        With usage and without: the four token fields are
        L{_usageFields}' values, between C{first_output_ms} and
        C{upstream_request_id}.
        """
        from relay.engine.record import usageFields as _usageFields
        from tests.test_runner import (
            CREATED,
            DELTA,
            IN_PROGRESS,
            ITEM_ADDED,
            OK_STREAM,
            frame,
        )

        bare = frame("response.completed", response={
            "id": "resp_1", "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi"}]}]})
        for stream, counted in [(OK_STREAM, True),
                                ([CREATED, IN_PROGRESS, ITEM_ADDED, DELTA, bare], False)]:
            turn, event = self.finished(stream)
            self.assertEqual(turn.usage is not None, counted)
            fields = _usageFields(turn.usage)
            self.assertEqual({k: event[k] for k in fields}, fields)
            names = list(event)
            start = names.index("first_output_ms") + 1
            self.assertEqual(names[start:start + 5], list(fields) + ["upstream_request_id"])


class TurnFinishedTextTests(SynchronousTestCase):
    """
    C{relay.turn_finished}'s text names the account a turn ended on, and
    says when it had none (never C{on None}).
    """

    def test_noAccount(self):
        from twisted.logger import formatEvent

        from tests.test_runner import Rig

        rig = Rig([])
        with capturedLogs() as logs:
            rig.run()
        [event] = [e for e in logs if e.get("event") == "relay.turn_finished"]
        text = formatEvent(event)
        self.assertIsNone(event["account_id"])
        self.assertNotIn("None", text)
        self.assertIn("with no account after 0 attempt(s)", text)

    def test_account(self):
        from twisted.logger import formatEvent

        from tests.test_runner import OK_STREAM, Rig, account, sse

        rig = Rig([account("a")])
        rig.script("a", sse(*OK_STREAM))
        with capturedLogs() as logs:
            rig.run()
        [event] = [e for e in logs if e.get("event") == "relay.turn_finished"]
        self.assertIn(" on a after 1 attempt(s)", formatEvent(event))


class CountTests(SynchronousTestCase):
    """
    L{relay.usage.tokens._count}'s fast path for a plain C{int} gives what
    its general path gives.
    """

    def test_sameAsGeneral(self):
        from relay.usage.tokens import _count

        def general(value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return 0
            return max(0, int(value))

        for value in [0, 1, 7, -3, 10 ** 20, -(10 ** 20), True, False, 2.9, -1.5, None, "5", [1]]:
            self.assertEqual((_count(value), type(_count(value))),
                             (general(value), type(general(value))), value)
