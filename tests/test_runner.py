"""
Tests for L{relay.engine.runner.TurnRunner} on a L{Clock}: a fake
L{IUpstreamDialer} answers with scripted responses and failures; the
classifier, memory state store, memory admission, scheduler and account
health are the real ones (behaviour.md groups A-C, G, R-B1; issue 3).
"""

from __future__ import annotations

import json

from attrs import evolve
from twisted.internet import error as terror
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone
from zope.interface import implementer
from zope.interface.verify import verifyObject

from relay.admission.memory import MemorySlotAdmission
from relay.frontdoor.door import FrontDoor
from relay.policy.bookkeeping import AccountBookkeeping
from relay.policy.classify import DefaultClassifier
from relay.engine.pump import STAGING_CAP
from relay.engine.runner import TurnRunner
from relay.policy.health import AccountHealth
from relay.interfaces import ITurnSink, IUpstreamDialer, IUpstreamResponse
from relay.base.records import Account, ClientKey, GatewaySettings, Turn
from relay.scheduling.scheduler import AccountScheduler, responseKey, responseOwnerKey
from relay.state.settings import RuntimeSettings
from relay.state.memory import MemoryStateStore

#: a fixed start time, Unix seconds
T0 = 1_700_000_000.0


# -- upstream fakes -------------------------------------------------------------


def frame(kind: str, **fields) -> bytes:
    data = json.dumps({"type": kind, **fields})
    return f"event: {kind}\ndata: {data}\n\n".encode()


CREATED = frame("response.created", response={"id": "resp_1", "status": "in_progress"})
IN_PROGRESS = frame("response.in_progress", response={"id": "resp_1", "status": "in_progress"})
ITEM_ADDED = frame(
    "response.output_item.added",
    output_index=0,
    item={"type": "message", "id": "msg_1", "role": "assistant", "content": []},
)
DELTA = frame("response.output_text.delta", item_id="msg_1", output_index=0, delta="Hi")
COMPLETED = frame(
    "response.completed",
    response={
        "id": "resp_1",
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi"}]}],
        "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
    },
)
EMPTY_COMPLETED = frame(
    "response.completed", response={"id": "resp_1", "status": "completed", "output": []}
)
OK_STREAM = [CREATED, IN_PROGRESS, ITEM_ADDED, DELTA, COMPLETED]


class FakeTransport:
    """
    The body transport: an L{IPushProducer} whose C{stopProducing} ends the
    body like an aborted connection.
    """

    def __init__(self, response):
        self._response = response
        self.stopped = False

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        if not self.stopped:
            self.stopped = True
            self._response.lose(Failure(terror.ConnectionAborted()))


@implementer(IUpstreamResponse)
class FakeResponse:
    """
    A scripted upstream response: C{steps} are C{(delay seconds, bytes)}
    delivered on the clock; then the body ends C{"done"} (clean),
    C{"cut"} (connection lost) or C{"hang"} (never).
    """

    def __init__(self, clock, code=200, headers=None, steps=(), end="done"):
        self.clock = clock
        self.code = code
        self.headers = dict(headers or {})
        self.steps = list(steps)
        self.end = end
        self.protocol = None
        self.lost = False
        self.calls = []

    def deliverBody(self, protocol):
        self.protocol = protocol
        protocol.makeConnection(FakeTransport(self))
        self._next()

    def _next(self):
        if self.lost:
            return
        if self.steps:
            delay, data = self.steps.pop(0)
            if delay:
                self.calls.append(self.clock.callLater(delay, self._deliver, data))
            else:
                self._deliver(data)
            return
        if self.end == "done":
            self.lose(Failure(ResponseDone()))
        elif self.end == "cut":
            self.lose(Failure(terror.ConnectionLost()))

    def _deliver(self, data):
        if not self.lost:
            self.protocol.dataReceived(data)
            self._next()

    def lose(self, reason):
        if not self.lost:
            self.lost = True
            for call in self.calls:
                if call.active():
                    call.cancel()
            self.protocol.connectionLost(reason)

    def readBody(self, limit):
        return succeed(b"".join(d for _, d in self.steps)[:limit])

    def abort(self):
        if self.protocol is not None:
            self.lose(Failure(terror.ConnectionAborted()))


def sse(*events, end="done", delay=0.0):
    return lambda clock: succeed(
        FakeResponse(
            clock,
            headers={"content-type": "text/event-stream"},
            steps=[(delay if i == 0 else 0.0, e) for i, e in enumerate(events)],
            end=end,
        )
    )


def ok():
    return sse(*OK_STREAM)


def status(code, body=None, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body or {"error": {"message": "x"}}).encode()
    return lambda clock: succeed(
        FakeResponse(clock, code=code, headers=headers or {"content-type": "application/json"},
                     steps=[(0, raw)])
    )


def refused():
    return lambda clock: fail(terror.ConnectionRefusedError("Connection refused"))


def reset():
    return lambda clock: fail(terror.ConnectionLost("Connection reset by peer"))


def hang():
    return lambda clock: Deferred()


@implementer(IUpstreamDialer)
class FakeDialer:
    """
    Answers each account's requests from its script; the last action
    repeats. Records C{(account id, time)} per request.
    """

    def __init__(self, clock):
        self.clock = clock
        self.scripts = {}
        self.calls = []

    def request(self, account, method, path, body, headers, timeouts):
        self.calls.append((account.id, self.clock.seconds()))
        script = self.scripts.get(account.id) or [ok()]
        action = script.pop(0) if len(script) > 1 else script[0]
        return action(self.clock)

    def ids(self):
        return [c[0] for c in self.calls]


@implementer(ITurnSink)
class FakeSink:
    """
    Records what the engine wrote.
    """

    def __init__(self):
        self.committed = False
        self.events = []
        self.errors = []
        self.bodies = []
        self.keepalives = 0
        self.finished = False

    def keepalive(self):
        self.keepalives += 1

    def commit(self, headers):
        self.committed = True

    def writeEvent(self, event):
        self.events.append(event.type.decode())

    def writeBody(self, status, headers, body):
        self.bodies.append((status, body))

    def fail(self, error):
        self.errors.append(error)

    def finish(self):
        self.finished = True


class UnbindSpy:
    """
    Delegates to a scheduler, recording C{unbind} calls.
    """

    def __init__(self, scheduler, calls):
        self._scheduler = scheduler
        self._calls = calls

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def unbind(self, turn):
        self._calls.append(turn)
        return self._scheduler.unbind(turn)


# -- the rig --------------------------------------------------------------------


def account(id, type="apikey", priority=1, **kw):
    return Account(id=id, type=type, base_url="http://u/v1", credential="c-" + id,
                   priority=priority, concurrency=kw.pop("concurrency", 10), **kw)


class Rig:
    """
    A runner with real parts on a L{Clock}.
    """

    def __init__(self, accounts, **settings):
        self.clock = Clock()
        self.clock.advance(T0)
        self.settings = RuntimeSettings(current=evolve(GatewaySettings(), **settings))
        self.store = MemoryStateStore(clock=self.clock)
        self.admission = MemorySlotAdmission(clock=self.clock)
        self.health = AccountHealth(store=self.store, clock=self.clock, settings=self.settings)
        self.accounts = {a.id: a for a in accounts}
        self.scheduler = AccountScheduler(
            accounts=list(accounts), admission=self.admission, store=self.store,
            clock=self.clock, settings=self.settings,
            extraBlock=lambda a, now, model: self.health.localBlock(a.id, model),
        )
        self.dialer = FakeDialer(self.clock)
        self.runner = TurnRunner(
            clock=self.clock, scheduler=self.scheduler, admission=self.admission,
            dialer=self.dialer, classifier=DefaultClassifier(), settings=self.settings,
            bookkeeping=AccountBookkeeping(health=self.health, clock=self.clock),
        )
        self.door = FrontDoor(self.runner)  # the key's checks, then the engine

    def script(self, accountId, *actions):
        self.dialer.scripts[accountId] = list(actions)

    def run(self, stream=True, model="gpt-5.5", client=None):
        turn = Turn(entrypoint="http", endpoint="responses",
                    client=client or ClientKey(name="t", key="k", concurrency=0), model=model,
                    body={"model": model, "input": "hi", "stream": stream}, stream=stream,
                    requestId="req")
        sink = FakeSink()
        outcome = []
        self.door.enter(turn, sink).addCallback(outcome.append)
        return turn, sink, outcome

    def load(self, *ids):
        out = []
        self.admission.load("account", list(ids)).addCallback(out.append)
        return out[0]

    def state(self, id):
        out = []
        self.store.getAccountStates([id]).addCallback(out.append)
        return out[0][id]


def events(logs, name):
    return [e for e in logs if e.get("event") == name]


class FakesTests(SynchronousTestCase):
    """
    The fakes provide the interfaces the engine uses.
    """

    def test_interfaces(self):
        """
        L{FakeDialer}, L{FakeResponse} and L{FakeSink} provide
        L{IUpstreamDialer}, L{IUpstreamResponse} and L{ITurnSink}.
        """
        clock = Clock()
        self.assertTrue(verifyObject(IUpstreamDialer, FakeDialer(clock)))
        self.assertTrue(verifyObject(IUpstreamResponse, FakeResponse(clock)))
        self.assertTrue(verifyObject(ITurnSink, FakeSink()))

    def test_success(self):
        """
        A healthy account: one attempt, the events reach the sink.
        """
        rig = Rig([account("a")])
        _, sink, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(sink.events[-1], "response.completed")
        self.assertEqual(rig.dialer.ids(), ["a"])


class UserSlotWaitTests(SynchronousTestCase):
    """
    R26, R32: the wait for a per-key slot.
    """

    def test_logLinesNameTheKey(self):
        """
        The wait's start and end lines name the client key by its name
        (never C{None}, never the secret).
        """
        rig = Rig([account("a")])
        key = ClientKey(name="team-a", key="sk-secret-1", concurrency=1)
        held = []
        rig.admission.tryAcquire("user", "team-a", 1).addCallback(held.append)
        self.assertIsNotNone(held[0])
        with capturedLogs() as logs:
            turn, _, outcome = rig.run(client=key)
            turn.cancel.cancel("client_gone")
        self.assertEqual(outcome, ["client_gone"])
        lines = [
            formatEvent(e) for e in logs
            if e.get("event") in ("openai.account_wait_started", "openai.account_wait_finished")
        ]
        self.assertEqual(lines, [
            "waiting for a user slot on key team-a",
            "wait for key team-a finished: client_gone after 0 ms",
        ])
        self.assertFalse(any("sk-secret" in formatEvent(e) for e in logs))


class InflightTests(SynchronousTestCase):
    """
    L{TurnRunner.inflight}: the turns a graceful stop waits for.
    """

    def test_waitingTurnListedUntilItEnds(self):
        """
        A turn that waits is in C{inflight} while it runs and leaves it
        before its Deferred fires; one done at once is never listed.
        """
        rig = Rig([account("a")])
        rig.script("a", sse(*OK_STREAM, delay=1.0))
        turn, _sink, outcome = rig.run()
        self.assertEqual(list(rig.runner.inflight), [turn])
        seen = []
        rig.runner.inflight[turn].addCallback(lambda r: seen.append(dict(rig.runner.inflight)))
        rig.clock.advance(1.0)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(seen, [{}])
        rig.script("a", ok())
        _, _sink, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.runner.inflight, {})


class RetryIntervalTests(SynchronousTestCase):
    """
    R71, R73, R75: C{retry_interval_ms}.
    """

    def test_zero_is_immediate(self):
        """
        R71/R75: with an interval of 0 the switch happens at once.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", reset())
        _, _sink, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.calls, [("a", T0), ("b", T0)])

    def test_waits_the_interval_without_a_slot(self):
        """
        R71/R75: the next attempt waits the interval on the clock; the slot
        of the failed attempt is released before the sleep; the wait is
        logged as C{openai.retry_interval_wait}.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)], retry_interval_ms=2000)
        rig.script("a", reset())
        with capturedLogs() as logs:
            _, _sink, outcome = rig.run()
            self.assertEqual(outcome, [])
            self.assertEqual(rig.dialer.ids(), ["a"])
            self.assertEqual(rig.load("a", "b"), {"a": (0, 0), "b": (0, 0)})
            rig.clock.advance(1.999)
            self.assertEqual(rig.dialer.ids(), ["a"])
            rig.clock.advance(0.001)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.calls[1], ("b", T0 + 2.0))
        self.assertEqual([e["interval_ms"] for e in events(logs, "openai.retry_interval_wait")],
                         [2000])

    def test_cancel_during_wait_aborts(self):
        """
        R71/R75, R2: a cancellation during the wait ends the turn at once,
        with no further attempt.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)], retry_interval_ms=5000)
        rig.script("a", reset())
        turn, sink, outcome = rig.run()
        rig.clock.advance(1)
        turn.cancel.cancel("client_gone")
        self.assertEqual(outcome, ["client_gone"])
        rig.clock.advance(10)
        self.assertEqual(rig.dialer.ids(), ["a"])
        self.assertEqual(sink.errors, [])

    def test_already_cancelled(self):
        """
        R75: a turn already cancelled makes no attempt.
        """
        rig = Rig([account("a")])
        turn = Turn(entrypoint="http", endpoint="responses",
                    client=ClientKey(name="t", key="k", concurrency=0), model="gpt-5.5",
                    body={}, stream=True)
        turn.cancel.cancel("client_gone")
        outcome = []
        rig.runner.run(turn, FakeSink()).addCallback(outcome.append)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(rig.dialer.calls, [])

    def test_no_interval_after_first_output_timeout(self):
        """
        R71: the switch after a first-output timeout gets no extra interval.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)],
                  retry_interval_ms=5000, first_output_timeout_seconds=30)
        rig.script("a", sse(CREATED, end="hang"))
        _, _sink, outcome = rig.run()
        rig.clock.advance(30)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.calls, [("a", T0), ("b", T0 + 30)])

    def test_interval_longer_than_own_delay(self):
        """
        R73: the wait before a same-account retry is max(interval, the R14
        delay): an overload backs off 0.5 s, the interval of 2 s wins.
        """
        rig = Rig([account("a")], retry_interval_ms=2000)
        rig.script("a", status(503, {"error": {"code": "server_is_overloaded", "message": "o"}}),
                   ok())
        _, _sink, outcome = rig.run()
        rig.clock.advance(2)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.calls, [("a", T0), ("a", T0 + 2)])

    def test_own_delay_longer_than_interval(self):
        """
        R73: an OAuth 429 with C{Retry-After: 6} waits 6 s even with an
        interval of 1 s.
        """
        rig = Rig([account("a", type="oauth")], retry_interval_ms=1000)
        rig.script("a", status(429, {"error": {"message": "slow"}}, {"retry-after": "6"}), ok())
        _, _sink, outcome = rig.run()
        rig.clock.advance(6)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.calls, [("a", T0), ("a", T0 + 6)])


class SameAccountDelayTests(SynchronousTestCase):
    """
    R13, R14: same-account retry delays.
    """

    def test_pool_mode_fixed_delay(self):
        """
        R14: a pool-mode API-key account retries a listed status (401) on
        the same account after a fixed 500 ms, up to its retry count, then
        switches without cooling the account.
        """
        rig = Rig([account("a", pool_mode=True, priority=1), account("b", priority=2)])
        rig.script("a", status(401, {"error": {"message": "nope"}}))
        _, _sink, outcome = rig.run()
        for _ in range(3):
            rig.clock.advance(0.5)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.calls, [("a", T0), ("a", T0 + 0.5), ("a", T0 + 1.0),
                                            ("a", T0 + 1.5), ("b", T0 + 1.5)])
        self.assertFalse(rig.state("a").disabled)

    def test_oauth_429_retry_after_capped(self):
        """
        R13: an OAuth 429's C{Retry-After} is capped at 8 s.
        """
        rig = Rig([account("a", type="oauth")])
        rig.script("a", status(429, {"error": {"message": "slow"}}, {"retry-after": "30"}), ok())
        _, _sink, outcome = rig.run()
        rig.clock.advance(7.9)
        self.assertEqual(len(rig.dialer.calls), 1)
        rig.clock.advance(0.1)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.calls[1], ("a", T0 + 8))
        self.assertEqual(rig.state("a").rateLimitedUntil, 0)

    def test_oauth_429_window_then_switch(self):
        """
        R13: inside the 2-minute window the same account is retried (not
        limited by the pool retry count); the first 429 after the window
        marks it rate-limited and switches (no further same-account retry).
        """
        rig = Rig([account("a", type="oauth", priority=1), account("b", type="oauth", priority=2)])
        rig.script("a", status(429, {"error": {"message": "slow"}}, {"retry-after": "8"}))
        _, _sink, outcome = rig.run()
        for _ in range(16):
            rig.clock.advance(8)
        self.assertEqual(outcome, ["completed"])
        ids = rig.dialer.ids()
        self.assertEqual(ids[-1], "b")
        self.assertEqual(ids.count("a"), 16)
        self.assertGreater(rig.state("a").rateLimitedUntil, T0 + 120)

    def test_overload_backoff(self):
        """
        R14: request-scoped overload backs off 0.5 -> 1 -> 2 -> 4 -> 8 -> 8
        seconds (a retry count of 10), and never cools the account.
        """
        rig = Rig([account("a", pool_mode_retry_count=10)])
        over = status(503, {"error": {"code": "server_is_overloaded", "message": "busy"}})
        rig.script("a", *([over] * 6 + [ok()]))
        _, _sink, outcome = rig.run()
        for delay in (0.5, 1, 2, 4, 8, 8):
            rig.clock.advance(delay)
        self.assertEqual(outcome, ["completed"])
        times = [t - T0 for _, t in rig.dialer.calls]
        self.assertEqual(times, [0, 0.5, 1.5, 3.5, 7.5, 15.5, 23.5])
        state = rig.state("a")
        self.assertEqual((state.blockedUntil, state.overloadedUntil), (0, 0))


class BudgetTests(SynchronousTestCase):
    """
    R18, R20, R21, R22, R13 stop rule, the global retry budget.
    """

    def test_switch_budget(self):
        """
        R18: C{max_account_switches} is checked before the increment: with
        2, three accounts are tried, then the turn is exhausted (R15).
        """
        accounts = [account(f"a{i}", priority=i) for i in range(5)]
        rig = Rig(accounts, max_account_switches=2)
        for a in accounts:
            rig.script(a.id, status(500, {"error": {"message": "boom"}}))
        _, sink, outcome = rig.run()
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(rig.dialer.ids(), ["a0", "a1", "a2"])
        self.assertEqual(sink.errors[0].status, 502)
        self.assertEqual(sink.errors[0].message, "Upstream service temporarily unavailable")

    def test_first_output_timeout_one_switch(self):
        """
        R20/R21: the first first-output timeout switches, the second ends
        the turn (at most 2 attempts die this way) with 502.
        """
        accounts = [account(f"a{i}", priority=i) for i in range(4)]
        rig = Rig(accounts, first_output_timeout_seconds=30)
        for a in accounts:
            rig.script(a.id, hang())
        _, sink, outcome = rig.run()
        rig.clock.advance(30)
        rig.clock.advance(30)
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(rig.dialer.ids(), ["a0", "a1"])
        self.assertEqual(sink.errors[0].status, 502)
        self.assertEqual(sink.errors[0].type, "first_output_timeout")
        self.assertEqual(rig.load("a0", "a1"), {"a0": (0, 0), "a1": (0, 0)})

    def test_staging_cap(self):
        """
        R22: more than 8 MiB held back before the first output is a
        failover (safe after write); nothing of it reaches the client.
        """
        big = frame("response.in_progress", response={"pad": "x" * (STAGING_CAP // 4)})
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", sse(CREATED, big, big, big, big, big, *OK_STREAM[2:]))
        _, sink, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.ids(), ["a", "b"])
        self.assertEqual(sink.events.count("response.in_progress"), 1)

    def test_oauth_429_stop_rule(self):
        """
        R13 stop rule: once an OAuth account produced a 429 failover, the
        relay stops switching at a switch count of 3 (4 attempts).
        """
        accounts = [account(f"o{i}", type="oauth", priority=i) for i in range(6)]
        rig = Rig(accounts)
        for a in accounts:
            rig.script(a.id, status(429, {"error": {"message": "slow"}}))
            rig.health._oauth429[a.id] = T0 - 200  # each window already over
        _, sink, outcome = rig.run()
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(rig.dialer.ids(), ["o0", "o1", "o2", "o3"])
        self.assertEqual(sink.errors[0].status, 429)

    def test_global_retry_budget(self):
        """
        Issue 3 item 7: turns retrying or switching at the same time are
        capped at max(3, 20 % of active turns); the fourth concurrent
        switch is refused and that turn ends exhausted.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)], retry_interval_ms=1000,
                  breaker=evolve(GatewaySettings().breaker, enabled=False))
        rig.script("a", reset())
        runs = [rig.run() for _ in range(4)]
        self.assertEqual([r[2] for r in runs], [[], [], [], ["failed"]])
        rig.clock.advance(1)
        self.assertEqual([r[2] for r in runs], [["completed"]] * 3 + [["failed"]])
        self.assertEqual(rig.runner.budget.retrying, 0)
        self.assertEqual(rig.runner.budget.active, 0)


class TransportPolicyTests(SynchronousTestCase):
    """
    R4, R72, R-B1.
    """

    def test_sticky_keeps_account(self):
        """
        R72 sticky: a transient failure retries the same account after the
        interval, without exclusion or unbinding.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)],
                  transport_retry_policy="sticky", retry_interval_ms=100)
        rig.script("a", reset(), ok())
        unbinds = []
        rig.runner.scheduler = UnbindSpy(rig.scheduler, unbinds)
        with capturedLogs() as logs:
            _, _sink, outcome = rig.run()
            rig.clock.advance(0.1)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.calls, [("a", T0), ("a", T0 + 0.1)])
        self.assertEqual(unbinds, [])
        self.assertEqual(len(events(logs, "openai.transport_sticky_retry")), 1)

    def test_rotate_switches_and_unbinds(self):
        """
        R72 rotate (default): a transient failure switches and releases the
        session binding; no cooldown (R4).
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", reset())
        unbinds = []
        rig.runner.scheduler = UnbindSpy(rig.scheduler, unbinds)
        _, _sink, _outcome = rig.run()
        self.assertEqual(rig.dialer.ids(), ["a", "b"])
        self.assertEqual(len(unbinds), 1)
        self.assertEqual(rig.state("a").blockedUntil, 0)

    def test_sticky_persistent_rotates_with_cooldown(self):
        """
        R72 adopted, R4: a persistent failure rotates even under sticky and
        cools the account for 10 minutes.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)],
                  transport_retry_policy="sticky")
        rig.script("a", refused())
        _, _sink, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.ids(), ["a", "b"])
        self.assertEqual(rig.state("a").blockedUntil, T0 + 600)

    def test_sticky_limited_to_three(self):
        """
        R72 adopted: sticky retries count as same-account retries (limit 3);
        the next transient failure rotates.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)],
                  transport_retry_policy="sticky", breaker=evolve(
                      GatewaySettings().breaker, enabled=False))
        rig.script("a", reset())
        _, _sink, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.ids(), ["a", "a", "a", "a", "b"])

    def _fail(self, rig, n):
        for _ in range(n):
            rig.script("a", reset())
            rig.run()

    def test_breaker_opens_and_doubles(self):
        """
        R-B1: 3 transient failures within 60 s make the account
        temp-unschedulable for 2 min; the next opening lasts 4 min.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        with capturedLogs() as logs:
            self._fail(rig, 2)
            self.assertEqual(rig.state("a").blockedUntil, 0)
            self._fail(rig, 1)
        self.assertEqual(rig.state("a").blockedUntil, T0 + 120)
        self.assertEqual(len(events(logs, "openai.account_transport_circuit_open")), 1)
        # Blocked: the next turn goes straight to b.
        rig.dialer.calls.clear()
        rig.run()
        self.assertEqual(rig.dialer.ids(), ["b"])
        rig.clock.advance(121)
        self._fail(rig, 3)
        self.assertEqual(rig.state("a").blockedUntil, T0 + 121 + 240)

    def test_breaker_reset_by_success(self):
        """
        R-B1: a success resets the count.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        self._fail(rig, 2)
        rig.script("a", ok())
        rig.run()
        self._fail(rig, 2)
        self.assertEqual(rig.state("a").blockedUntil, 0)

    def test_breaker_window(self):
        """
        R-B1: failures further apart than 60 s do not open the breaker.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        self._fail(rig, 2)
        rig.clock.advance(61)
        self._fail(rig, 1)
        self.assertEqual(rig.state("a").blockedUntil, 0)

    def test_breaker_switchable_off(self):
        """
        R-B1: C{breaker.enabled: false} turns it off.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)],
                  breaker=evolve(GatewaySettings().breaker, enabled=False))
        self._fail(rig, 5)
        self.assertEqual(rig.state("a").blockedUntil, 0)


class OutputTests(SynchronousTestCase):
    """
    R17, R19 step 2, R23, R2.
    """

    def test_failure_after_output(self):
        """
        R17/R23: a cut after the first output ends with one in-stream error
        and never a second attempt.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", sse(CREATED, IN_PROGRESS, ITEM_ADDED, DELTA, end="cut"))
        _, sink, outcome = rig.run()
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(rig.dialer.ids(), ["a"])
        self.assertIn("response.output_text.delta", sink.events)
        self.assertEqual(len(sink.errors), 1)
        self.assertTrue(sink.finished)

    def test_clean_end_after_output_without_terminal(self):
        """
        R17: a stream that ends cleanly after output without a terminal
        event is not a silent close: the client gets an error.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", sse(CREATED, DELTA, end="done"))
        _, sink, outcome = rig.run()
        self.assertEqual(outcome, ["failed"])
        self.assertEqual(len(sink.errors), 1)
        self.assertEqual(rig.dialer.ids(), ["a"])

    def test_empty_completed_fails_over(self):
        """
        R23: an empty C{response.completed} is a silent refusal: failover.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", sse(CREATED, EMPTY_COMPLETED))
        _, sink, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(rig.dialer.ids(), ["a", "b"])
        self.assertEqual(sink.events.count("response.completed"), 1)

    def test_empty_completed_exhausted(self):
        """
        R15 step 6: exhausted silent refusals answer 502.
        """
        rig = Rig([account("a")])
        rig.script("a", sse(CREATED, EMPTY_COMPLETED))
        _, sink, _outcome = rig.run()
        self.assertEqual(sink.errors[0].status, 502)

    def test_cancel_writes_nothing(self):
        """
        R2: the client leaves while upstream hangs before headers: nothing
        is written about the account, the slot is free, no more attempts.
        """
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        rig.script("a", hang())
        turn, sink, outcome = rig.run()
        self.assertEqual(rig.load("a"), {"a": (1, 0)})
        turn.cancel.cancel("client_gone")
        self.assertEqual(outcome, ["client_gone"])
        rig.clock.advance(1000)
        self.assertEqual(rig.dialer.ids(), ["a"])
        self.assertEqual(rig.load("a"), {"a": (0, 0)})
        self.assertEqual(rig.state("a").blockedUntil, 0)
        self.assertEqual(rig.health._breakers, {})
        self.assertEqual(sink.errors, [])


class _SlowScheduler:
    """
    Delegates to a scheduler; C{select} (or C{bind}) answers C{delay}
    seconds late on the rig's clock, as a Redis-backed store does while
    Redis reconnects. Records C{bind} calls.
    """

    def __init__(self, scheduler, clock, delay, slow="select"):
        self._scheduler, self._clock, self._delay, self._slow = scheduler, clock, delay, slow
        self.binds = []

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def _late(self, d):
        out = Deferred()
        d.addBoth(lambda r: self._clock.callLater(self._delay, out.callback, r) and None)
        return out

    def select(self, turn, excluded=frozenset()):
        d = self._scheduler.select(turn, excluded)
        return self._late(d) if self._slow == "select" else d

    def bind(self, turn, account):
        self.binds.append(account.id)
        d = self._scheduler.bind(turn, account)
        return self._late(d) if self._slow == "bind" else d


class SlowSchedulingDepartureTests(SynchronousTestCase):
    """
    R2: a client that leaves while its turn is being scheduled (a slow
    selection, a slow binding write, a slow slot retake) gets no upstream
    call and writes nothing: the chaos soak's late call, found when Redis
    answered a selection 1.26 s late and the engine dialled anyway.
    """

    def _rig(self, slow):
        rig = Rig([account("a", priority=1), account("b", priority=2)])
        spy = _SlowScheduler(rig.scheduler, rig.clock, 1.5, slow)
        rig.runner.scheduler = spy
        return rig, spy

    def _leaveDuring(self, slow):
        """
        The client leaves 0.5 s into a turn whose C{slow} step answers at
        1.5 s: the turn ends C{client_gone}, nothing is dialled, no error is
        written and every slot is free.

        @return: the scheduler spy.
        """
        rig, spy = self._rig(slow)
        turn, sink, outcome = rig.run()
        rig.clock.advance(0.5)
        turn.cancel.cancel("client_gone")
        rig.clock.advance(5)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(rig.dialer.calls, [])
        self.assertEqual(sink.errors, [])
        self.assertEqual(rig.load("a", "b"), {"a": (0, 0), "b": (0, 0)})
        return spy

    def test_left_during_selection(self):
        """
        The client leaves while C{select} is pending: once it answers, the
        slot it took is released, no binding is written, nothing is dialled.
        """
        self.assertEqual(self._leaveDuring("select").binds, [])

    def test_left_during_binding(self):
        """
        The client leaves while the session binding is being written:
        nothing is dialled and the slot is released.
        """
        self.assertEqual(self._leaveDuring("bind").binds, ["a"])

    def test_left_during_same_account_retake(self):
        """
        A sticky same-account retry whose slot retake answers late: the
        client left meanwhile, so the retry is never dialled.
        """
        rig = Rig([account("a")], transport_retry_policy="sticky", retry_interval_ms=0)
        rig.script("a", reset(), ok())
        admission = rig.admission

        class SlowRetake:
            # The runner's admission: its slot retakes answer 1.5 s late.
            def __getattr__(self, name):
                return getattr(admission, name)

            def tryAcquire(self, kind, id, limit):
                d = admission.tryAcquire(kind, id, limit)
                if kind != "account":
                    return d
                out = Deferred()
                d.addBoth(lambda r: rig.clock.callLater(1.5, out.callback, r) and None)
                return out

        rig.runner.admission = SlowRetake()
        turn, sink, outcome = rig.run()
        rig.clock.advance(0.5)
        self.assertEqual(rig.dialer.ids(), ["a"])
        turn.cancel.cancel("client_gone")
        rig.clock.advance(5)
        self.assertEqual(outcome, ["client_gone"])
        self.assertEqual(rig.dialer.ids(), ["a"])
        self.assertEqual(rig.load("a"), {"a": (0, 0)})


class _OwnerProbe(FakeSink):
    """
    A sink that reads, at the moment the client gets the terminal event or
    the JSON body, what another relay process reading the shared store (and
    this process's local map) would find about the response's owner.
    """

    def __init__(self, rig):
        super().__init__()
        self._rig = rig
        self.seen = []

    def _probe(self):
        store = []
        self._rig.store.getValue(responseKey("resp_1")).addCallback(store.append)
        key = []
        self._rig.store.getValue(responseOwnerKey("resp_1")).addCallback(key.append)
        owner = json.loads(key[0])["key"] if key[0] else None
        self.seen.append((store[0], owner, self._rig.scheduler._bindings._local("resp_1")))

    def writeEvent(self, event):
        if event.type == b"response.completed":
            self._probe()
        super().writeEvent(event)

    def writeBody(self, status, headers, body):
        self._probe()
        super().writeBody(status, headers, body)


class _RecordSpy:
    """
    Delegates to a scheduler, recording C{recordResponse} calls.
    """

    def __init__(self, scheduler, calls):
        self._scheduler = scheduler
        self._calls = calls

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def recordResponse(self, turn, responseId, acct):
        self._calls.append(responseId)
        return self._scheduler.recordResponse(turn, responseId, acct)


class ResponseOwnerTests(SynchronousTestCase):
    """
    R39/R40: a response's owner is recorded before the client can chain
    from it. Found by the chaos soak (issue 14): the owner was written only
    after the terminal event (SSE) or the whole body (JSON) had gone to the
    client and the account's bookkeeping had reached the store, so a
    client's next turn with C{previous_response_id}, sent at once through
    the other relay, found no owner, went to another account and got 400
    C{previous_response_not_found}.
    """

    def chain(self, stream):
        rig = Rig([account("a")])
        calls = []
        rig.runner.scheduler = _RecordSpy(rig.scheduler, calls)
        sink = _OwnerProbe(rig)
        turn = Turn(entrypoint="http", endpoint="responses",
                    client=ClientKey(name="t", key="k", concurrency=0), model="gpt-5.5",
                    body={"model": "gpt-5.5", "input": "hi", "stream": stream}, stream=stream,
                    requestId="req")
        outcome = []
        rig.runner.run(turn, sink).addCallback(outcome.append)
        self.assertEqual(outcome, ["completed"])
        self.assertEqual(sink.seen, [("a", "t", ("a", "t"))])
        self.assertEqual(calls, ["resp_1"])

    def test_stream(self):
        """
        SSE: the owner (store and local map) and the key are there when the
        terminal event reaches the client, and recorded once.
        """
        self.chain(stream=True)

    def test_json(self):
        """
        A JSON upstream body: the owner is there when the body is written.
        """
        body = {"id": "resp_1", "object": "response", "status": "completed", "output": [
            {"type": "message", "id": "msg_1", "role": "assistant",
             "content": [{"type": "output_text", "text": "Hi"}]}]}
        original = Rig.__init__

        def patched(self, accounts, **settings):
            original(self, accounts, **settings)
            self.dialer.scripts["a"] = [status(200, body)]

        self.patch(Rig, "__init__", patched)
        self.chain(stream=False)


class SlotErrorTests(SynchronousTestCase):
    """
    behaviour.md R35/R101 (issue 23): an error from an immediate slot try
    (the per-key slot; a Redis that is down or silent) is R32's service
    error -- HTTP 503, WebSocket 1011 "failed to acquire ... concurrency
    slot" -- never the internal 502 C{upstream_error}, and nothing is dialled.
    """

    def test_userSlotTryError(self):
        from relay.base.records import AdmissionError

        rig = Rig([account("a")])

        class _Failing:
            def __init__(self, real):
                self._real = real

            def __getattr__(self, name):
                return getattr(self._real, name)

            def tryAcquire(self, kind, id, limit):
                if kind == "user":
                    return fail(AdmissionError("error", None, "RedisUnavailable: eval: timeout"))
                return self._real.tryAcquire(kind, id, limit)

        rig.runner.admission = _Failing(rig.admission)
        with capturedLogs() as logs:
            _, sink, outcome = rig.run(client=ClientKey(name="t", key="k", concurrency=2))
        self.assertEqual(outcome, ["failed"])
        [error] = sink.errors
        self.assertEqual((error.status, error.type), (503, "api_error"))
        self.assertEqual(error.message, "Service temporarily unavailable, please retry later")
        self.assertEqual(error.wsClose, (1011, "failed to acquire user concurrency slot"))
        self.assertEqual(rig.dialer.ids(), [])
        self.assertFalse([e for e in logs if e.get("log_failure") is not None])
        self.assertEqual(len(events(logs, "openai.user_slot_acquire_error")), 1)


class KeyLimitsReadTests(SynchronousTestCase):
    """
    R114: the key's windows a turn carries, read as it starts.
    """

    class _Usage:
        def __init__(self, now=None, later=None, broken=False):
            self.now, self.later, self.broken, self.awaited = now, later, broken, 0

        def limitsNow(self, key):
            if self.broken:
                raise ValueError("no windows")
            return self.now

        async def limits(self, key):
            self.awaited += 1
            return self.later

    def test_read_at_once_when_no_wait(self):
        """
        Windows that need no wait (L{relay.tenants.keyusage.KeyUsage.limitsNow})
        are the turn's without an awaited read; the others are awaited.
        """
        from relay.interfaces import IKeyUsage
        from relay.tenants.keyusage import KeyLimits, KeyUsage

        self.assertTrue(verifyObject(IKeyUsage, KeyUsage(Clock())))
        rig = Rig([account("a")])
        now, later = KeyLimits((), 1.0), KeyLimits((), 2.0)
        rig.runner.keyUsage = usage = self._Usage(now, later)
        turn, _, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertIs(turn.keyLimits, now)
        self.assertEqual(usage.awaited, 0)
        rig.runner.keyUsage = usage = self._Usage(None, later)
        turn, _, outcome = rig.run()
        self.assertIs(turn.keyLimits, later)
        self.assertEqual(usage.awaited, 1)

    def test_unreadable_is_logged(self):
        """
        Windows that cannot be read are logged; the turn goes on without
        them.
        """
        rig = Rig([account("a")])
        rig.runner.keyUsage = self._Usage(broken=True)
        with capturedLogs() as logs:
            turn, sink, outcome = rig.run()
        self.assertEqual(outcome, ["completed"])
        self.assertIsNone(turn.keyLimits)
        [failed] = [e for e in logs if e.get("log_failure") is not None]
        self.assertEqual(formatEvent(failed), "reading key t's windows failed")
        self.flushLoggedErrors(ValueError)
