# -*- test-case-name: tests.test_runner -*-
"""
The turn runner: the one attempt loop every entrypoint uses.

select -> admit (maybe wait) -> dial -> stream to a sink -> on failure
classify and decide: retry the same account, switch, pass the error
through, or give up (behaviour.md groups A-D and G; DEVELOPERS.md "One turn
engine"). Entrypoints build a L{Turn} and a sink and call L{TurnRunner.run};
they hold no policy.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Optional

from attrs import define, evolve, field
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import PotentialDataLoss, ResponseDone
from zope.interface import implementer
from twisted.internet.interfaces import IPushProducer

from relay import failures as F
from relay.engine import errors as E
from relay.engine.payload import (
    isEmptyCompleted,
    isSemanticOutput,
    translatesChat,
    upstreamBody,
    upstreamClientHeaders,
    upstreamPath,
    upstreamStreams,
    withoutEncryptedReasoning,
)
from relay.model import AdmissionError, ClientError, Turn, WaitPlan
from relay.policy import ends
from relay.policy.bookkeeping import AccountBookkeeping
from relay.policy.judgement import judge
from relay.selection import NoAccountAvailable
from relay.sse import DONE, LineTooLong, SSEParser
from relay.translate.sink import ChatCompletionsSink

STAGING_CAP = 8 * 2**20
"""Held-back bytes before the first output, at most (behaviour.md R22)."""

ERROR_BODY_LIMIT = 512 * 2**10
"""Upstream error bodies are read up to 512 KiB (behaviour.md R7)."""

JSON_BODY_LIMIT = 40 * 2**20
"""A non-streaming upstream body, at most (behaviour.md R22 line cap)."""

MAX_FIRST_OUTPUT_SWITCHES = 1
"""behaviour.md R21: the first safe-after-write failure switches, the second ends."""

OAUTH_429_SWITCH_STOP = 3
"""behaviour.md R13 stop rule."""

FIXED_RETRY_DELAY = 0.5
"""Same-account retry delay without a better one (R14), seconds."""


class ClientGone(Exception):
    """
    The client went away (behaviour.md R2); the turn stops silently.
    """


def raceCancel(d: Deferred, cancel) -> Deferred:
    """
    Tie C{d} to the turn's cancellation: when the client goes, C{d} is
    cancelled and the result fails with L{ClientGone}.

    @param d: any cancellable Deferred.
    @param cancel: the turn's L{relay.model.CancelSignal}.
    """
    if cancel.cancelled:
        d.cancel()
        d.addErrback(lambda f: None)
        result = Deferred()
        result.errback(ClientGone(cancel.reason))
        return result
    w = cancel.whenCancelled()
    w.addCallback(lambda _: d.cancel())
    w.addErrback(lambda f: f.trap(CancelledError))

    def _done(result):
        if not w.called:
            w.cancel()
        if cancel.cancelled and isinstance(result, Failure):
            return Failure(ClientGone(cancel.reason))
        return result

    return d.addBoth(_done)


@define(eq=False)
class RetryBudget:
    """
    Envoy-style global retry budget (issue 3 item 7): turns that retry or
    switch at the same time may not exceed C{percent} of active turns, with
    a floor of C{minimum}.

    @ivar active: turns running now.
    @ivar retrying: turns holding a retry token now.
    """

    active: int = 0
    retrying: int = 0
    minimum: int = 3

    def allowed(self, percent: float) -> int:
        """
        @param percent: C{retry_budget_percent}; <= 0 disables the budget.
        @return: how many turns may retry at once.
        """
        if percent <= 0:
            return 2**31
        return max(self.minimum, int(self.active * percent / 100.0))

    def take(self, percent: float) -> bool:
        """
        Take a retry token if the budget allows.
        """
        if self.retrying >= self.allowed(percent):
            return False
        self.retrying += 1
        return True

    def give(self) -> None:
        """
        Return a token.
        """
        self.retrying = max(0, self.retrying - 1)


@define(eq=False)
class AttemptResult:
    """
    What one attempt on one account ended with.

    @ivar end: the attempt end, a fact from L{relay.policy.ends}.
    @ivar verdict: the verdict when the attempt code already judged the end
        (an in-band failure must be judged where it is read: it fails over
        or is forwarded); else L{None} and the engine judges it.
    @ivar committed: output reached the client (no failover any more).
    @ivar status: HTTP-like status of the outcome for logs.
    """

    end: object = None
    verdict: Optional[F.Verdict] = None
    committed: bool = False
    status: int = 200

    @property
    def ok(self) -> bool:
        """
        The turn completed: a terminal event or body reached the client.
        """
        return isinstance(self.end, ends.Completed)

    @property
    def responseId(self) -> Optional[str]:
        """
        The response id of a completed or forwarded turn, else L{None}.
        """
        return getattr(self.end, "responseId", None)


@define(eq=False)
class TurnState:
    """
    Per-turn failover state (behaviour.md R18): switch count, first-output
    switch count, exclusion set, same-account retries, the last verdict and
    the OAuth-429 state.
    """

    switches: int = 0
    firstOutputSwitches: int = 0
    excluded: set = field(factory=set)
    sameAccountRetries: dict = field(factory=dict)
    lastVerdict: Optional[F.Verdict] = None
    oauth429: bool = False
    attempts: int = 0
    pendingFailover: Optional[dict] = None
    rewrites: set = field(factory=set)
    retryToken: bool = False
    lastAccountId: Optional[str] = None
    startedAt: float = 0.0
    waited: float = 0.0
    """Seconds spent in slot waits and retry sleeps (not relay's own latency)."""
    dispatched: bool = False


@implementer(IPushProducer)
class StreamPump(Protocol):
    """
    Reads one upstream SSE body: holds events back until the first semantic
    output (R22), classifies pre-output failures (R23), then passes bytes
    through, watching only for the terminal event. Registered as a
    streaming producer on the sink, so a slow client pauses upstream.

    It reports how the attempt ended as a fact (L{relay.policy.ends}) and
    never writes account state (behaviour.md R86): the engine judges and
    records the end. A pump the client left (the sink stops producing, or
    the engine calls L{depart}) ends with L{ends.Departed}, so nothing that
    happens to the upstream connection afterwards can count (R2).

    @ivar done: fires with an L{AttemptResult}.
    """

    def __init__(self, runner, turn, sink, account, release, modelRewrite, idleTimeout):
        self._runner = runner
        self._turn = turn
        self._sink = sink
        self._account = account
        self._release = release
        self._rewrite = modelRewrite
        self._idleTimeout = idleTimeout
        self._parser = SSEParser()
        # The upstream speaks chat completions chunks only for a chat turn
        # forwarded as is; a translated one (OAuth) streams Responses events.
        self._chat = turn.endpoint == "chat" and not translatesChat(turn, account)
        # Raw pass-through needs a sink that takes bytes and no model-name
        # rewrite; Responses streams must already be in event:+data: form.
        self._rawWrite = getattr(sink, "writeRaw", None) if modelRewrite is None else None
        self._rawPrefix = b"data: " if self._chat else b"event: "
        self._staged = []
        self._stagedBytes = 0
        self._headers = {}
        self._idle = None
        self.committed = False
        self.finished = False
        self.done = Deferred()

    # -- wiring ------------------------------------------------------------

    def start(self, response) -> None:
        """
        Begin reading C{response} (an L{relay.interfaces.IUpstreamResponse}).
        """
        self._headers = response.headers
        response.deliverBody(self)

    def connectionMade(self) -> None:
        self._resetIdle()

    def pauseProducing(self) -> None:
        if self.transport is not None and not self.finished:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        if self.transport is not None and not self.finished:
            self.transport.resumeProducing()

    def stopProducing(self) -> None:
        """
        The client's connection went away under us (twisted.web stops the
        registered producer): the attempt ended because the client left.
        """
        self.depart("client_gone")

    def depart(self, reason: str = "client_gone") -> None:
        """
        End the attempt as L{ends.Departed} and drop the upstream
        connection (R2). Idempotent; a no-op once the attempt ended.

        @param reason: why, for logs.
        """
        self._endWith(AttemptResult(end=ends.Departed(reason), status=499))

    def abort(self) -> None:
        """
        Drop the upstream connection. A WebSocket attempt overrides this to
        close or retire its upstream socket.
        """
        if self.transport is not None:
            self.transport.stopProducing()

    def _resetIdle(self) -> None:
        clock = self._runner.clock
        if self._idle is not None and self._idle.active():
            self._idle.reset(self._idleTimeout)
        elif self._idleTimeout > 0:
            self._idle = clock.callLater(self._idleTimeout, self._idleExpired)

    def _cancelIdle(self) -> None:
        if self._idle is not None and self._idle.active():
            self._idle.cancel()
        self._idle = None

    # -- data ---------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self.finished:
            return  # style.md trap T15: bytes after pause/abort
        self._resetIdle()
        if self._rawWrite is not None and self.committed and self._passThrough(data):
            return
        try:
            events = self._parser.feed(data)
        except LineTooLong as e:
            self._fail(ends.StagingOverflow(e.args[0]), "OpenAI stream line too long")
            return
        for event in events:
            if self.finished:
                return
            self.feedEvent(event)

    def _passThrough(self, data: bytes) -> bool:
        """
        The hot path after first output: write whole upstream events as
        they came, in one write per chunk, scanning only for a terminal
        event (DEVELOPERS.md "pass upstream bytes through"). A chunk that
        may hold a terminal event, or a CR, takes the event-by-event path.

        @return: L{True} when C{data} was handled.
        """
        if b"\r" in data:
            return False
        parser = self._parser
        buf = parser._buf + data if parser._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            if len(buf) > parser.maxLine:
                return False
            parser._buf = buf
            return True
        complete = buf[: end + 2]
        if _TERMINAL_MARK.search(complete) is not None or not complete.startswith(self._rawPrefix):
            return False
        parser._buf = buf[end + 2 :]
        self._rawWrite(complete)
        return True

    def feedEvent(self, event) -> None:
        """
        Handle one upstream event (from SSE or a WebSocket frame): held back
        and classified before the first output, passed through after it.
        Transport-agnostic; a WebSocket attempt feeds frames here.
        """
        if self.finished:
            return
        if self.committed:
            self._afterOutput(event)
        else:
            self._beforeOutput(event)

    def _failureEvent(self, event) -> Optional[dict]:
        """
        The parsed event when C{event} is an in-band failure before output:
        a C{response.failed} or C{error} event, or a chat error chunk
        (C{{"error": {...}}}, R84); else L{None}.
        """
        t = event.type
        if t == b"response.failed" or t == b"error":
            return event.json()
        if self._chat and t != DONE:
            data = event.json()
            if isinstance(data.get("error"), dict) and "choices" not in data:
                return data
        return None

    def _beforeOutput(self, event) -> None:
        failure = self._failureEvent(event)
        if failure is not None:
            wire = ends.WIRE_CHAT if self._chat else self._inBandWire
            end = ends.InBandFailure(failure, wire)
            verdict = self._runner.judge(self._turn, self._account, end)
            if verdict is not None and verdict.failover:
                self._endWith(AttemptResult(end=end, verdict=verdict, status=verdict.status))
                return
            # R23: not a failover; the client sees upstream's own failure.
            self._commit()
            self._afterOutput(event, forwardedFailure=True)
            return
        t = event.type
        if t == b"response.completed":
            response = event.json().get("response") or {}
            if isEmptyCompleted(response) and self._turn.body.get("generate") is not False:
                self._endWith(AttemptResult(end=ends.EmptyCompletion(event.json()), status=502))
                return
        if event.terminal or isSemanticOutput(event, self._chat):
            self._commit()
            self._afterOutput(event)
            return
        self._staged.append(event)
        self._stagedBytes += len(event.data)
        if self._stagedBytes > STAGING_CAP:
            self._endWith(AttemptResult(end=ends.StagingOverflow(self._stagedBytes), status=502))

    _inBandWire = ends.WIRE_SSE

    def _commit(self) -> None:
        """
        First output: fix the response and flush what was held back (R22).
        """
        self.committed = True
        self._runner._firstOutput(self._turn)
        self._sink.commit(_passHeaders(self._headers))
        attach = getattr(self._sink, "attachProducer", None)
        if attach is not None:
            attach(self)
        staged, self._staged = self._staged, []
        for event in staged:
            self._write(event)

    def _write(self, event) -> None:
        if self._rewrite is not None:
            event = self._rewrite(event)
        self._sink.writeEvent(event)

    def _afterOutput(self, event, forwardedFailure: bool = False) -> None:
        if not event.terminal and not forwardedFailure:
            self._write(event)
            return
        # Release the slot before the terminal event reaches the client:
        # Codex sends its next request the instant it reads it
        # (architecture.md invariant 4, protocol.md 8).
        responseId = None
        if event.type != DONE:
            response = event.json().get("response")
            if isinstance(response, dict):
                responseId = response.get("id")
        self._release()
        self._write(event)
        if forwardedFailure or event.type == b"response.failed":
            end = ends.Forwarded(responseId)
        else:
            end = ends.Completed(responseId)
        self._endWith(AttemptResult(end=end, committed=True, status=200), dropUpstream=False)

    # -- endings -------------------------------------------------------------

    def _outputReachedClient(self) -> bool:
        """
        R19 step 2 counts bytes written to the client: a sink that holds
        everything back until the terminal event (C{holdsOutput}, the JSON
        sink of a non-streaming client) has written nothing yet, so a
        failure before the terminal event may still fail over.
        """
        return self.committed and not getattr(self._sink, "holdsOutput", False)

    def _endWith(self, result: AttemptResult, dropUpstream: bool = True) -> None:
        if self.finished:
            return
        self.finished = True
        self._cancelIdle()
        result.committed = result.committed or self._outputReachedClient()
        if dropUpstream:
            self.abort()
        detach = getattr(self._sink, "detachProducer", None)
        if detach is not None and self.committed:
            detach()
        self.done.callback(result)

    def _fail(self, end, message: str, error=None) -> None:
        """
        End with a stream failure: before output the engine judges it and
        may fail over; after output the client gets a terminal error
        in-stream (R17, R23) and C{end} is recorded as happening after
        output.

        @param end: the attempt end (a L{relay.policy.ends} failure).
        @param message: the client's message after output.
        @param error: the L{ClientError} to write after output (default:
            L{E.streamBrokenError} of C{message}).
        """
        if self.finished:
            return
        if not self._outputReachedClient():
            self._endWith(AttemptResult(end=end, status=502))
            return
        if hasattr(end, "afterOutput"):
            end = evolve(end, afterOutput=True)
        self._release()
        self._sink.fail(error if error is not None else E.streamBrokenError(message))
        self._endWith(AttemptResult(end=end, committed=True, status=502))

    def _idleExpired(self) -> None:
        """
        R24: the upstream stream went silent. After output: an in-stream
        C{stream_timeout} error without failover. Before output relay fails
        over as for a read error (nothing reached the client yet).
        """
        self._idle = None
        if self.finished:
            return
        end = ends.RelayTimeout(ends.IDLE, self._idleTimeout)
        self._fail(end, "Upstream stream idle timeout", E.streamTimeoutError())

    def firstOutputTimeout(self, seconds: float) -> None:
        """
        Called by the runner when the first-output timer fires (R20).

        @param seconds: the deadline that expired.
        """
        if not self.finished and not self.committed:
            self._endWith(
                AttemptResult(end=ends.RelayTimeout(ends.FIRST_OUTPUT, seconds), status=504)
            )

    def connectionLost(self, reason) -> None:
        self._cancelIdle()
        if self.finished:
            return
        if self._turn.cancel.cancelled:
            self.depart(self._turn.cancel.reason)
            return
        clean = reason.check(ResponseDone, PotentialDataLoss) is not None
        tail = self._parser.feed(b"\n\n") if clean and self._parser.pending else []
        for event in tail:
            if self.finished:
                return
            (self._afterOutput if self.committed else self._beforeOutput)(event)
        if self.finished:
            return
        if clean:
            self._fail(ends.StreamEnded(), "OpenAI stream ended before a terminal event")
        else:
            detail = _shortReason(reason)
            self._fail(
                ends.StreamCut(detail), "OpenAI stream disconnected before completion: " + detail
            )


def _shortReason(reason: Failure) -> str:
    """
    A short text of a stream failure, for logs and messages.
    """
    value = reason.value
    inner = getattr(value, "reasons", None)
    if inner:
        value = inner[0].value
    return type(value).__name__


_TERMINAL_MARK = re.compile(
    rb"response\.(?:completed|failed|incomplete|done|cancell?ed)|\[DONE\]"
)
"""Anything that may be a terminal event (protocol.md 2.5); a false hit
only sends the chunk down the event-by-event path."""

_PASSED_RESPONSE_HEADERS = ("x-codex-turn-state", "x-request-id", "openai-model")


def _passHeaders(headers: dict) -> dict:
    """
    Upstream response headers that reach the client on commit (R22: headers
    are staged with the events).
    """
    return {k: headers[k] for k in _PASSED_RESPONSE_HEADERS if k in headers}


def modelRewriter(requested: Optional[str], upstream: Optional[str]) -> Optional[Callable]:
    """
    When relay mapped the model name, rewrite C{"model":"<upstream>"} back
    to the requested name in forwarded events (protocol.md 4.3). A bytes
    replace: no JSON re-serialisation on the hot path.

    @return: a function L{Event} -> L{Event}, or L{None} when no mapping.
    """
    if not requested or not upstream or requested == upstream:
        return None
    from relay.sse import Event

    pairs = [
        (b'"model":' + sep + b'"' + upstream.encode() + b'"',
         b'"model":' + sep + b'"' + requested.encode() + b'"')
        for sep in (b"", b" ")
    ]

    def rewrite(event):
        data = event.data
        for old, new in pairs:
            if old in data:
                data = data.replace(old, new)
        if data is event.data:
            return event
        dataOnly = event._raw is not None and event._raw.startswith(b"data: ")
        return Event(event.type, data, b"data: " + data + b"\n\n" if dataOnly else None)

    return rewrite


@define(eq=False)
class TurnRunner:
    """
    Runs every turn. See the module docstring.

    @ivar clock: the injected L{IReactorTime}.
    @ivar scheduler: the L{relay.interfaces.IAccountScheduler}.
    @ivar admission: the L{relay.interfaces.ISlotAdmission}.
    @ivar dialer: the L{relay.interfaces.IUpstreamDialer}.
    @ivar classifier: the L{relay.interfaces.IFailureClassifier}.
    @ivar health: the L{relay.health.AccountHealth}.
    @ivar settings: the L{relay.settings.RuntimeSettings}, read per attempt.
    @ivar metrics: optional L{relay.metrics.RelayMetrics}.
    @ivar wsAttempt: optional attempt function for WebSocket upstream modes
        (issue 6), called like L{_attemptHTTP}.
    """

    clock: object
    scheduler: object
    admission: object
    dialer: object
    classifier: object
    health: object
    settings: object
    metrics: object = field(default=None, on_setattr=lambda self, a, v: self._setMetrics(v))
    wsAttempt: object = None
    proxyHealth: object = None
    budget: RetryBudget = field(factory=RetryBudget)
    bookkeeping: object = None
    """The L{AccountBookkeeping}: the one writer of account state for an
    attempt's end (behaviour.md R86); built from C{health} when not given."""
    inflight: dict = field(factory=dict)
    """Every turn running now -> the Deferred L{run} returned for it, so a
    graceful stop can wait for them and cancel what is left (issue 14,
    L{relay.operations.drain})."""
    _log = Logger()

    def __attrs_post_init__(self) -> None:
        if self.bookkeeping is None:
            self.bookkeeping = AccountBookkeeping(
                health=self.health, clock=self.clock, proxyHealth=self.proxyHealth,
                metrics=self.metrics,
            )

    def _setMetrics(self, metrics):
        if self.bookkeeping is not None:
            self.bookkeeping.metrics = metrics
        return metrics

    @property
    def accountStats(self) -> dict:
        """
        account id -> C{{"turns", "failovers", "last_error", ...}} for the
        operator view (kept by L{AccountBookkeeping}).
        """
        return self.bookkeeping.stats

    def judge(self, turn: Turn, account, end) -> Optional[F.Verdict]:
        """
        The verdict for an attempt end (L{relay.policy.judgement.judge}).

        @param turn: the L{Turn}.
        @param account: the account attempted.
        @param end: an attempt end from L{relay.policy.ends}.
        """
        return judge(self.classifier, end, account, turn, self.clock.seconds())

    # -- public --------------------------------------------------------------

    def run(self, turn: Turn, sink) -> Deferred:
        """
        Run C{turn}, writing to C{sink} (an L{relay.interfaces.ITurnSink}).

        @return: a Deferred firing with the turn's outcome string:
            C{completed}, C{failed}, C{client_gone} or C{error}. It never
            fails; bugs are logged and answered with a 502.
        """
        d = Deferred.fromCoroutine(self._run(turn, sink))
        if not d.called:
            self.inflight[turn] = d
            d.addBoth(self._forget, turn)
        return d

    def _forget(self, result, turn: Turn):
        """
        Drop an ended turn from L{inflight}; pass C{result} through.
        """
        self.inflight.pop(turn, None)
        return result

    # -- the loop --------------------------------------------------------------

    async def _run(self, turn: Turn, sink) -> str:
        start = self.clock.seconds()
        state = TurnState(startedAt=start)
        userLease = None
        outcome, status, accountId = "error", 500, None
        self.budget.active += 1
        try:
            userLease = await self._admitUser(turn, sink, state)
            outcome, status, accountId = await self._loop(turn, sink, state)
        except ClientGone:
            outcome, status = "client_gone", 499
            if turn.cancel.tell is not None:
                # relay cancelled the turn itself (a graceful stop's grace
                # ran out, issue 14): nothing was judged or written (R2),
                # and the client, still there, gets a terminal error once
                # the slots are back (invariant 4).
                outcome, status = "relay_cancelled", turn.cancel.tell.status
        except _AdmissionFailed as e:
            # R26/R32: the per-key slot could not be had.
            sink.fail(e.error)
            outcome, status = "failed", e.error.status
        except Exception:
            self._log.failure("turn {request_id} failed unexpectedly", request_id=turn.requestId)
            outcome, status = "error", 502
            if not turn.cancel.cancelled:
                try:
                    sink.fail(E.internalError())
                except Exception:
                    self._log.failure("writing the fallback error failed")
        finally:
            if userLease is not None:
                userLease.release()
            self.budget.active -= 1
            if state.retryToken:
                self.budget.give()
        if outcome == "relay_cancelled":
            try:
                sink.fail(turn.cancel.tell)
            except Exception:
                self._log.failure(
                    "telling turn {request_id} it was cancelled failed",
                    request_id=turn.requestId,
                )
        self._finished(turn, state, outcome, status, accountId or state.lastAccountId, start)
        return outcome

    async def _admitUser(self, turn: Turn, sink, state: Optional[TurnState] = None):
        """
        The per-key slot (R26; on the WebSocket too, R-B10).
        """
        key = turn.client
        if key.concurrency <= 0:
            return None
        s = self.settings.current.scheduling
        plan = WaitPlan(
            kind="user",
            id=key.name,
            max_concurrency=key.concurrency,
            timeout=s.user_wait_timeout,
            max_waiting=s.user_max_waiting,
            plan="user",
        )
        return await self._tryThenWait(turn, sink, plan, "user_slot_busy", state)

    async def _loop(self, turn: Turn, sink, state: TurnState):
        """
        Select, attempt, decide; until the turn completes or is exhausted.

        @return: (outcome, status, account id).
        """
        sameAccount = None  # (account, delay) for a same-account retry
        while True:
            if turn.cancel.cancelled:
                raise ClientGone(turn.cancel.reason)
            if sameAccount is not None:
                account, sameAccount = sameAccount, None
                try:
                    lease = await self._retakeSameAccount(turn, sink, account, state)
                except _AdmissionFailed as e:
                    sink.fail(e.error)
                    return "failed", e.error.status, account.id
            else:
                try:
                    selection = await self.scheduler.select(turn, frozenset(state.excluded))
                except NoAccountAvailable as e:
                    error = e.error
                    if state.lastVerdict is not None:
                        error = self.classifier.exhausted(state.lastVerdict, turn.endpoint)
                    sink.fail(error)
                    return "failed", error.status, state.lastAccountId
                account = selection.account
                lease = selection.lease
                if state.pendingFailover is not None:
                    state.pendingFailover["next_account_id"] = account.id
                    state.pendingFailover = None
                if lease is None:
                    try:
                        lease = await self._wait(
                            turn, sink, selection.waitPlan, "account_busy", state
                        )
                    except _AdmissionFailed as e:
                        sink.fail(e.error)
                        return "failed", e.error.status, account.id
                await self.scheduler.bind(turn, account)
            state.attempts += 1
            state.lastAccountId = account.id
            if not state.dispatched:
                # Relay-added latency: start to first dispatch, less waits.
                state.dispatched = True
                if self.metrics is not None:
                    self.metrics.addedLatency(
                        self.clock.seconds() - state.startedAt - state.waited
                    )
            result = await self._attempt(turn, sink, account, lease)
            end = result.end
            if turn.cancel.cancelled or isinstance(end, ends.Departed):
                # R2: the client left (or relay cancelled the attempt for
                # it); nothing is judged, recorded or written.
                raise ClientGone(turn.cancel.reason or getattr(end, "reason", "client_gone"))
            verdict = result.verdict
            if verdict is None:
                verdict = self.judge(turn, account, end)
            model = account.upstreamModel(turn.model) if turn.model else None
            recorded = await self.bookkeeping.record(
                account, end, verdict, model, turn.requestId
            )
            if result.ok:
                sink.finish()
                await self._succeeded(turn, account, result)
                return "completed", result.status, account.id
            if result.committed:
                # R19 step 2 / R23: after output nothing fails over; the
                # terminal event (upstream's or relay's) is already written.
                sink.finish()
                return "failed", result.status, account.id
            if verdict is None:
                raise AssertionError(f"attempt ended with {end!r} but no verdict")
            if self._rewriteOnce(turn, state, account, verdict):
                sameAccount = account
                continue
            decision = await self._decide(turn, sink, state, account, verdict, recorded)
            if decision[0] == "pass":
                sink.fail(decision[1])
                return "failed", decision[1].status, account.id
            if decision[0] == "exhausted":
                sink.fail(decision[1])
                return "failed", decision[1].status, account.id
            if decision[0] == "same":
                await self._sleep(turn, sink, decision[1], state)
                sameAccount = account
                continue
            # switch
            await self._sleep(turn, sink, decision[1], state)

    def _rewriteOnce(self, turn: Turn, state: TurnState, account, verdict) -> bool:
        """
        behaviour.md R7: a one-shot same-account retry with a corrected body
        before any failover decision; it counts as neither a switch nor a
        same-account retry. Implemented: 400 C{invalid_encrypted_content}
        -> drop the encrypted reasoning items.

        @return: L{True} when C{turn.body} was rewritten for a retry.
        """
        if "encrypted_content" in state.rewrites or verdict is None:
            return False
        error = verdict.clientError
        if verdict.kind != F.STATUS or verdict.status != 400 or error is None:
            return False
        if error.code != "invalid_encrypted_content":
            return False
        body = withoutEncryptedReasoning(turn.body)
        if body is None:
            return False
        turn.body = body
        state.rewrites.add("encrypted_content")
        self._log.info(
            "retrying {account_id} without encrypted reasoning items",
            event="openai.invalid_encrypted_content_retry",
            account_id=account.id,
            request_id=turn.requestId,
        )
        return True

    async def _decide(
        self, turn, sink, state: TurnState, account, verdict: F.Verdict, recorded
    ):
        """
        R19: what to do with one failure. Account state was already written
        by L{AccountBookkeeping.record} (C{recorded} says what it found);
        this only decides.

        @return: C{("pass", ClientError)}, C{("exhausted", ClientError)},
            C{("same", delay)} or C{("switch", delay)}.
        """
        s = self.settings.current
        if not verdict.failover:
            return ("pass", verdict.clientError)
        state.lastVerdict = verdict
        interval = max(0, s.retry_interval_ms) / 1000.0

        # R72: a transient transport failure may retry the same account.
        if verdict.kind == F.TRANSPORT:
            if not verdict.persistent:
                if s.transport_retry_policy == "sticky" and self._canRetrySame(
                    state, account, verdict
                ):
                    if not self._takeRetryToken(state, s):
                        return ("exhausted", self.classifier.exhausted(verdict, turn.endpoint))
                    state.sameAccountRetries[account.id] = (
                        state.sameAccountRetries.get(account.id, 0) + 1
                    )
                    self._log.info(
                        "sticky transport retry on account {account_id}",
                        event="openai.transport_sticky_retry",
                        account_id=account.id,
                        attempt=state.attempts,
                        cause=verdict.message,
                        request_id=turn.requestId,
                    )
                    return ("same", interval)
        elif verdict.oauth429:
            # R13: inside the window the same account is retried.
            delay = recorded.oauth429RetryIn
            if delay is not None:
                if not self._takeRetryToken(state, s):
                    return ("exhausted", self.classifier.exhausted(verdict, turn.endpoint))
                self._logSameRetry(turn, account, state, delay, "oauth_429_window", None)
                return ("same", max(interval, delay))
            state.oauth429 = True

        if verdict.stop:
            return ("exhausted", self.classifier.exhausted(verdict, turn.endpoint))

        # R21: at most one switch for slow first output / staging overflow.
        if verdict.safeAfterWrite:
            state.firstOutputSwitches += 1
            if state.firstOutputSwitches > MAX_FIRST_OUTPUT_SWITCHES:
                return ("exhausted", self.classifier.exhausted(verdict, turn.endpoint))

        # R14: same-account retry. An OAuth 429 after its R13 window has
        # just marked the account rate-limited: it switches (retrying would
        # open a fresh window on a rate-limited account).
        if (
            verdict.sameAccount
            and not verdict.safeAfterWrite
            and not verdict.oauth429
            and self._canRetrySame(state, account, verdict)
        ):
            count = state.sameAccountRetries.get(account.id, 0) + 1
            state.sameAccountRetries[account.id] = count
            if verdict.retryDelay is not None:
                delay = verdict.retryDelay
            elif verdict.backoff:
                delay = min(8.0, 0.5 * 2 ** (count - 1))
            else:
                delay = FIXED_RETRY_DELAY
            if not self._takeRetryToken(state, s):
                return ("exhausted", self.classifier.exhausted(verdict, turn.endpoint))
            self._logSameRetry(turn, account, state, delay, verdict.reason, count)
            return ("same", max(interval, delay))

        # R19 step 7: switch.
        state.excluded.add(account.id)
        if not turn.historyComplete:
            # R62, R-B7, R76: relay does not hold the whole conversation, so
            # the turn cannot move; the client must resend full input.
            self._log.info(
                "not moving turn {request_id} off {account_id}: incomplete history",
                event="ingress_ws_account_failover_replay_skip",
                reason="incomplete_history",
                account_id=account.id,
                request_id=turn.requestId,
            )
            return ("exhausted", previousResponseNotFound(turn.previousResponseId))
        if state.switches >= s.max_account_switches:
            return ("exhausted", self.classifier.exhausted(verdict, turn.endpoint))
        if state.oauth429 and state.switches >= OAUTH_429_SWITCH_STOP:
            return ("exhausted", self.classifier.exhausted(verdict, turn.endpoint))
        if not self._takeRetryToken(state, s):
            self._log.warn(
                "retry budget exhausted; not switching from {account_id}",
                event="relay.retry_budget_exhausted",
                account_id=account.id,
                request_id=turn.requestId,
            )
            return ("exhausted", self.classifier.exhausted(verdict, turn.endpoint))
        state.switches += 1
        if verdict.kind == F.TRANSPORT:
            # R72 rotate (and any persistent failure): release the binding.
            await self.scheduler.unbind(turn)
        name = (
            "openai.websocket_upstream_failover_switching"
            if turn.entrypoint == "ws"
            else "openai.upstream_failover_switching"
        )
        self._log.warn(
            "switching from account {account_id} after {reason} (status {upstream_status}),"
            " switch {switch_count}/{max_switches}",
            event=name,
            account_id=account.id,
            upstream_status=verdict.status,
            reason=verdict.reason,
            switch_count=state.switches,
            max_switches=s.max_account_switches,
            proxy_id=_proxyId(account),
            proxy_name=_proxyId(account),
            proxy_host=account.proxy.host if account.proxy is not None else None,
            proxy_port=account.proxy.port if account.proxy is not None else None,
            request_id=turn.requestId,
            entrypoint=turn.entrypoint,
        )
        if self.metrics is not None:
            state.pendingFailover = self.metrics.failover(
                verdict.reason, account.id, None, turn.entrypoint, verdict.status
            )
        # R71: no extra interval after a first-output timeout.
        return ("switch", 0 if verdict.kind == F.FIRST_OUTPUT_TIMEOUT else interval)

    def _canRetrySame(self, state: TurnState, account, verdict) -> bool:
        """
        R14's count limit: C{pool_mode_retry_count} (default 3) per account
        in this turn; an OAuth-429 window retry is not counted here.
        """
        limit = max(0, min(10, account.pool_mode_retry_count))
        return state.sameAccountRetries.get(account.id, 0) < limit

    def _takeRetryToken(self, state: TurnState, s) -> bool:
        """
        The global retry budget: one token per retrying turn.
        """
        if state.retryToken:
            return True
        if self.budget.take(s.retry_budget_percent):
            state.retryToken = True
            return True
        return False

    def _logSameRetry(self, turn, account, state, delay, reason, count) -> None:
        self._log.info(
            "retrying account {account_id} after {retry_delay}s ({reason})",
            event="openai.pool_mode_same_account_retry",
            account_id=account.id,
            retry_limit=account.pool_mode_retry_count,
            retry_count=count,
            retry_delay=delay,
            reason=reason,
            request_id=turn.requestId,
        )
        if self.metrics is not None:
            self.metrics.sameAccountRetry(reason)

    async def _succeeded(self, turn, account, result: AttemptResult) -> None:
        """
        A completed turn: remember which account owns the response (R39).
        """
        if result.responseId:
            await self.scheduler.recordResponse(turn, result.responseId, account)
            if turn.onResponseId is not None:
                turn.onResponseId(result.responseId, account)

    async def _retakeSameAccount(self, turn, sink, account, state=None):
        """
        Retake the slot for a same-account retry, waiting per the sticky
        plan (R60, R64 step 2).
        """
        s = self.settings.current.scheduling
        plan = WaitPlan(
            kind="account",
            id=account.id,
            max_concurrency=account.concurrency,
            timeout=s.sticky_session_wait_timeout,
            max_waiting=s.sticky_session_max_waiting,
            plan="sticky",
        )
        return await self._tryThenWait(turn, sink, plan, "same_account_retry", state)

    async def _tryThenWait(self, turn: Turn, sink, plan: WaitPlan, reason: str, state=None):
        """
        One immediate try on C{plan}'s slot, else wait on it (R27 steps 1-3).
        """
        lease = await self.admission.tryAcquire(plan.kind, plan.id, plan.max_concurrency)
        if lease is not None:
            return lease
        return await self._wait(turn, sink, plan, reason, state)

    # -- waiting -------------------------------------------------------------

    async def _wait(self, turn: Turn, sink, plan: WaitPlan, reason: str, state=None):
        """
        Wait for a slot on C{plan} (R27, R30-R33), with SSE keepalives
        (R31) and the wait events of R32.

        @raise _AdmissionFailed: queue full, timeout or error (R32).
        @raise ClientGone: the client left while waiting.
        """
        ws = turn.entrypoint == "ws"
        prefix = "openai.websocket_account_wait" if ws else "openai.account_wait"
        phase = turn.phase if turn.phase != "request" else "request"
        if reason == "same_account_retry":
            phase = "same_account_retry"
        fields = dict(
            entrypoint=turn.entrypoint,
            mode=turn.wsMode,
            phase=phase,
            reason=reason,
            account_id=plan.id if plan.kind == "account" else None,
            key_name=plan.id if plan.kind == "user" else None,
            plan=plan.plan,
            request_id=turn.requestId,
        )
        self._log.info("waiting for a {plan} slot on {account_id}", event=prefix + "_started", **fields)
        start = self.clock.seconds()
        keepalive = self._keepalive(sink)
        try:
            lease = await self.admission.acquire(plan, turn.cancel)
        except AdmissionError as e:
            outcome = "client_gone" if turn.cancel.cancelled else e.reason
            self._waitFinished(prefix, fields, outcome, start, 0)
            if outcome == "client_gone":
                raise ClientGone(turn.cancel.reason)
            raise _AdmissionFailed(E.admissionError(e, plan.kind))
        except ClientGone:
            self._waitFinished(prefix, fields, "client_gone", start, 0)
            raise
        finally:
            if keepalive is not None and keepalive.running:
                keepalive.stop()
            if state is not None:
                state.waited += self.clock.seconds() - start
        self._waitFinished(prefix, fields, "acquired", start, getattr(lease, "queuePosition", 0))
        if turn.cancel.cancelled:
            lease.release()
            raise ClientGone(turn.cancel.reason)
        return lease

    def _waitFinished(self, prefix, fields, outcome, start, position) -> None:
        waitMs = int((self.clock.seconds() - start) * 1000)
        self._log.info(
            "wait for {account_id} finished: {outcome} after {wait_ms} ms",
            event=prefix + "_finished",
            outcome=outcome,
            wait_ms=waitMs,
            queue_position=position,
            **fields,
        )
        if self.metrics is not None:
            self.metrics.waitFinished(fields["entrypoint"], outcome, waitMs / 1000.0)

    def _keepalive(self, sink) -> Optional[LoopingCall]:
        """
        SSE keepalive comments every C{ping_interval} seconds while waiting
        (R31). Non-streaming sinks ignore them.
        """
        interval = self.settings.current.scheduling.ping_interval
        if interval <= 0:
            return None
        call = LoopingCall(sink.keepalive)
        call.clock = self.clock
        call.start(interval, now=False).addErrback(
            lambda f: self._log.failure("keepalive failed", f)
        )
        return call

    async def _sleep(self, turn: Turn, sink, seconds: float, state=None) -> None:
        """
        The retry interval / same-account delay (R71, R73): cancellable by
        the client, keepalives continue, no slot is held.
        """
        if seconds <= 0:
            return
        self._log.info(
            "waiting {interval_ms} ms before the next attempt",
            event="openai.retry_interval_wait",
            interval_ms=int(seconds * 1000),
            request_id=turn.requestId,
        )
        keepalive = self._keepalive(sink)
        began = self.clock.seconds()
        try:
            await raceCancel(deferLater(self.clock, seconds), turn.cancel)
        finally:
            if keepalive is not None and keepalive.running:
                keepalive.stop()
            if state is not None:
                state.waited += self.clock.seconds() - began

    # -- one attempt -----------------------------------------------------------

    async def _attempt(self, turn: Turn, sink, account, lease) -> AttemptResult:
        """
        One attempt on C{account} holding C{lease}. The lease is released on
        every path, before a terminal event is written.
        """
        released = []
        renew = getattr(lease, "startRenewing", None)
        if renew is not None:
            # R34: a long stream keeps its Redis slot lease alive.
            renew()

        def release():
            if not released:
                released.append(True)
                lease.release()

        try:
            if self.wsAttempt is not None and turn.entrypoint == "ws" and turn.wsMode in (
                "ctx_pool",
                "passthrough",
            ):
                return await self.wsAttempt(self, turn, sink, account, release)
            return await self._attemptHTTP(turn, sink, account, release)
        finally:
            release()

    async def _attemptHTTP(self, turn: Turn, sink, account, release) -> AttemptResult:
        """
        One HTTP attempt: dial, then stream (SSE) or read (JSON).

        A chat turn on an OAuth account goes to C{/responses}; the pump
        stages and classifies its Responses events as on any other turn and
        a L{ChatCompletionsSink} translates them on write (issue 13, R84).
        """
        s = self.settings.current
        stream = upstreamStreams(turn, account)
        path = upstreamPath(turn, account)
        if translatesChat(turn, account):
            sink = ChatCompletionsSink(sink, turn, self.clock.seconds())
        headers = upstreamClientHeaders(turn, account)
        headers["accept"] = "text/event-stream" if stream else "application/json"
        body = upstreamBody(turn, account)
        fot = s.first_output_timeout_seconds if stream else 0
        pump = None
        timedOut = []
        requestD = self.dialer.request(account, b"POST", path, body, headers, s.upstream)

        def _onFirstOutputTimeout():
            timedOut.append(True)
            self._log.warn(
                "no first output from {account_id} within {seconds}s",
                event="openai.first_output_timeout",
                account_id=account.id,
                seconds=fot,
                request_id=turn.requestId,
            )
            if pump is not None:
                pump.firstOutputTimeout(fot)
            else:
                requestD.cancel()

        timer = self.clock.callLater(fot, _onFirstOutputTimeout) if fot > 0 else None
        try:
            try:
                response = await raceCancel(requestD, turn.cancel)
            except ClientGone:
                raise
            except Exception as e:
                if timedOut:
                    return AttemptResult(
                        end=ends.RelayTimeout(ends.FIRST_OUTPUT, fot), status=504
                    )
                return AttemptResult(end=ends.TransportFailure(e, "headers"), status=502)
            if self.metrics is not None:
                self.metrics.upstreamStatus(response.code)
            if response.code >= 300:
                idle = s.upstream.stream_idle_timeout_seconds
                try:
                    errorBody = await raceCancel(
                        readBody(response, ERROR_BODY_LIMIT, idle, self.clock), turn.cancel
                    )
                except BodyBroken as e:
                    errorBody = e.partial  # the status decides; the body is a hint
                release()
                end = ends.StatusRefused(response.code, dict(response.headers), errorBody)
                return AttemptResult(end=end, status=response.code)
            rewrite = modelRewriter(turn.model, account.upstreamModel(turn.model) if turn.model else None)
            if not stream:
                return await self._readJSON(turn, sink, account, response, release, rewrite)
            pump = StreamPump(
                self, turn, sink, account, release, rewrite, s.upstream.stream_idle_timeout_seconds
            )
            pump.start(response)
            try:
                return await raceCancel(_uncancellable(pump.done), turn.cancel)
            except ClientGone:
                pump.depart(turn.cancel.reason)
                raise
        finally:
            if timer is not None and timer.active():
                timer.cancel()

    async def _readJSON(self, turn, sink, account, response, release, rewrite) -> AttemptResult:
        """
        A non-streaming upstream body: check for a silent refusal, then
        answer the client with it.
        """
        idle = self.settings.current.upstream.stream_idle_timeout_seconds
        try:
            body = await raceCancel(
                readBody(response, JSON_BODY_LIMIT, idle, self.clock), turn.cancel
            )
        except BodyBroken as e:
            # R1/R23/R24/R86.3: a body that broke before its end is a read
            # error before output (nothing reached the client), exactly like
            # a cut stream; one that went silent is relay's idle timeout.
            if e.idle:
                return AttemptResult(end=ends.RelayTimeout(ends.IDLE, idle), status=502)
            return AttemptResult(end=ends.StreamCut(e.detail), status=502)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if turn.endpoint == "responses" and isinstance(parsed, dict) and isEmptyCompleted(parsed):
            return AttemptResult(end=ends.EmptyCompletion(parsed), status=502)
        if rewrite is not None:
            from relay.sse import Event

            body = rewrite(Event(b"", body)).data
        release()
        self._firstOutput(turn)
        sink.writeBody(200, _passHeaders(response.headers), body)
        responseId = parsed.get("id") if isinstance(parsed, dict) else None
        return AttemptResult(end=ends.Completed(responseId), committed=True, status=200)

    # -- bookkeeping -----------------------------------------------------------

    def _firstOutput(self, turn: Turn) -> None:
        if turn.firstOutputAt is None:
            turn.firstOutputAt = self.clock.seconds()

    def _finished(self, turn, state, outcome, status, accountId, start) -> None:
        now = self.clock.seconds()
        first = turn.firstOutputAt
        self._log.info(
            "turn {request_id} {outcome} with status {status} on {account_id}"
            " after {attempts} attempt(s)",
            event="relay.turn_finished",
            request_id=turn.requestId,
            entrypoint=turn.entrypoint,
            endpoint=turn.endpoint,
            client=turn.client.name,
            model=turn.model,
            outcome=outcome,
            status=status,
            account_id=accountId,
            attempts=state.attempts,
            switches=state.switches,
            duration_ms=int((now - start) * 1000),
            first_output_ms=None if first is None else int((first - start) * 1000),
        )
        if accountId is not None:
            self.bookkeeping.accountStats(accountId)["turns"] += 1
        if self.metrics is not None:
            self.metrics.turnFinished(turn.entrypoint, outcome)
            if first is not None:
                self.metrics.firstOutput(first - start)


def previousResponseNotFound(responseId: Optional[str]) -> ClientError:
    """
    The error that makes a client resend its full input (protocol.md 4.5,
    behaviour.md R66, R-B7): status 400 C{previous_response_not_found}, then
    the WebSocket closes so Codex reconnects.
    """
    return ClientError(
        400,
        "invalid_request_error",
        f"Previous response with id '{responseId}' not found.",
        code="previous_response_not_found",
        param="previous_response_id",
        wsClose=(1011, "upstream websocket proxy failed"),
    )


class BodyBroken(Exception):
    """
    An upstream body ended uncleanly or went idle before its end.

    @ivar partial: the bytes read so far.
    @ivar detail: a short reason.
    @ivar idle: the body went silent (relay's R24 timeout), rather than
        breaking.
    """

    def __init__(self, partial: bytes, detail: str, idle: bool = False):
        super().__init__(detail)
        self.partial = partial
        self.detail = detail
        self.idle = idle


class _BodyReader(Protocol):
    """
    Reads a bounded upstream body for L{readBody}.
    """

    def __init__(self, limit: int, idle: float, clock):
        self._limit = limit
        self._idle = idle
        self._clock = clock
        self._parts = []
        self._size = 0
        self._timer = None
        self.done = Deferred(self._cancel)

    def _cancel(self, d) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.stopProducing()

    def connectionMade(self) -> None:
        self._arm()

    def _arm(self) -> None:
        if self._idle <= 0:
            return
        if self._timer is not None and self._timer.active():
            self._timer.reset(self._idle)
        else:
            self._timer = self._clock.callLater(self._idle, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if not self.done.called:
            self.done.errback(BodyBroken(b"".join(self._parts), "body idle timeout", idle=True))
            if self.transport is not None:
                self.transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        self._arm()
        room = self._limit - self._size
        self._parts.append(data[:room])
        self._size += min(len(data), room)
        if self._size >= self._limit:
            self._disarm()
            self.done.callback(b"".join(self._parts))
            self.transport.stopProducing()

    def connectionLost(self, reason) -> None:
        self._disarm()
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss) is not None:
            self.done.callback(b"".join(self._parts))
        else:
            self.done.errback(BodyBroken(b"".join(self._parts), _shortReason(reason)))


def readBody(response, limit: int, idle: float, clock) -> Deferred:
    """
    Read at most C{limit} bytes of an upstream body. Unlike
    L{IUpstreamResponse.readBody} it tells a clean end from a broken one,
    and gives up after C{idle} seconds without bytes (R24's idle timeout
    also covers non-streaming bodies).

    @return: Deferred firing with bytes, or failing with L{BodyBroken}.
    """
    reader = _BodyReader(limit, idle, clock)
    response.deliverBody(reader)
    return reader.done


class _AdmissionFailed(Exception):
    """
    Admission refused; carries the L{ClientError} (R32).
    """

    def __init__(self, error: ClientError):
        super().__init__(error.message)
        self.error = error


def _uncancellable(d: Deferred) -> Deferred:
    """
    A view of C{d} whose cancellation does not errback C{d} itself (the
    pump owns its Deferred and ends it on abort).
    """
    view = Deferred(lambda _: None)
    d.addBoth(lambda r: (view.callback(r) if not view.called else None, r)[1])
    return view


def _proxyId(account) -> Optional[str]:
    return account.proxy.id if account.proxy is not None else None
