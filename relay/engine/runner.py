# -*- test-case-name: tests.test_runner -*-
"""
The turn runner: the one attempt loop every entrypoint uses.

select -> admit (maybe wait) -> dial -> stream to a sink -> on failure
classify and decide: retry the same account, switch, pass the error
through, or give up (behaviour.md groups A-D and G; DEVELOPERS.md "One turn
engine"). Entrypoints build a L{Turn} and a sink and call L{TurnRunner.run};
they hold no policy. The loop's parts: the waits (L{relay.engine.waiting}),
the decision (L{relay.engine.decide}), what a turn leaves behind
(L{relay.engine.record}).
"""

from __future__ import annotations

from typing import Optional

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from relay.engine import decide as D
from relay.engine import record as R
from relay.engine import waiting as W
from relay.base import clienterrors as E
from relay.engine.cancel import ClientGone, raceCancel
from relay.engine.decide import RetryBudget, TurnState
from relay.engine.httpattempt import attemptHTTP
from relay.engine.keepalive import StreamKeepalive
from relay.engine.pump import AttemptResult
from relay.engine.compaction import CompactionWatch, endsWithTrigger
from relay.engine.record import SamplingSink as _SamplingSink
from relay.engine.waiting import AdmissionFailed as _AdmissionFailed
from relay.interfaces import (
    IAccountBookkeeping, IAccountHistory, IAccountScheduler, IAttempt, ICredentialSource,
    IEngineMetrics, IFailureClassifier, IKeyPolicy, IKeyUsage, IPriceTable, IRequestLog,
    IRuntimeSettings,
    ISlotAdmission, IStartupGate, ITurnObserver, IUpstreamDialer, IUsageLedger, IUsageWindows,
)
from relay.base.logs import ClassLogger
from relay.base.records import ClientError, Turn, WaitPlan
from relay.policy import ends
from relay.policy import failures as F
from relay.policy.judgement import judge
from relay.base.requestid import bindRequestId
from relay.scheduling.selection import NoAccountAvailable
from relay.tenants.record import Attempt
from relay.usage.reader import HostedCallWatch



def _leaveIfGone(turn: Turn, lease) -> None:
    """
    Behaviour.md R2: when the client left while its account was selected
    or its slot awaited (a store that answers late, e.g. Redis
    reconnecting), release C{lease} and stop the turn before anything is
    written or dialled.

    @raise ClientGone: the turn's client left.
    """
    if turn.cancel.cancelled:
        lease.release()
        raise ClientGone(turn.cancel.reason or "client_gone")


@define(eq=False)
class TurnRunner:
    """
    Runs every turn. See the module docstring.

    Every collaborator is given at construction, as the interface the
    engine calls (L{relay.interfaces}; L{relay.process.app} builds them in one
    place), and none is set afterwards. An optional one left L{None} is
    not used.

    @ivar clock: the injected L{IReactorTime}.
    @ivar scheduler: the L{IAccountScheduler}.
    @ivar admission: the L{ISlotAdmission}.
    @ivar dialer: the L{IUpstreamDialer}.
    @ivar classifier: the L{IFailureClassifier}.
    @ivar settings: the L{IRuntimeSettings}, read per attempt.
    @ivar bookkeeping: the L{IAccountBookkeeping}: the one writer of
        account state for an attempt's end (behaviour.md R86).
    @ivar metrics: the L{IEngineMetrics}, or L{None}.
    @ivar wsAttempt: the L{IAttempt} for the WebSocket upstream modes
        (C{ctx_pool}, C{passthrough}), or L{None}: every turn over HTTP.
    @ivar usage: the L{IUsageLedger}: token accounting and per-key budgets
        (R102, R108), or L{None}.
    @ivar history: the L{IAccountHistory} (the status page's charts), or
        L{None}.
    @ivar credentials: the L{ICredentialSource}, or L{None}: dial as
        configured.
    @ivar quota: the L{IUsageWindows} recording upstream usage windows,
        or L{None}.
    @ivar observer: the L{ITurnObserver} (traces), or L{None}: then nothing
        is built per turn.
    @ivar startupGate: R105: the L{IStartupGate} a turn waits on at the
        front door (L{relay.frontdoor.keychecks}) until the stores are
        loaded; L{None}: no wait.
    @ivar keyPolicy: the L{IKeyPolicy}: the price of what the chosen
        account serves (R109); the front door checks the key with it before
        the turn (R102); or L{None}.
    @ivar prices: the L{IPriceTable} pricing each turn's usage (R109), or
        L{None} (costs not counted).
    @ivar requestLog: the L{IRequestLog} that gets each turn's
        L{relay.tenants.record.TurnRecord}, or L{None}.
    @ivar keyUsage: the L{IKeyUsage} whose key windows replace an account's
        rate-limit headers and events on a turn (R114), or L{None}: they
        are dropped.
    """

    clock: IReactorTime
    scheduler: IAccountScheduler
    admission: ISlotAdmission
    dialer: IUpstreamDialer
    classifier: IFailureClassifier
    settings: IRuntimeSettings
    bookkeeping: IAccountBookkeeping
    metrics: Optional[IEngineMetrics] = None
    wsAttempt: Optional[IAttempt] = None
    usage: Optional[IUsageLedger] = None
    history: Optional[IAccountHistory] = None
    credentials: Optional[ICredentialSource] = None
    quota: Optional[IUsageWindows] = None
    observer: Optional[ITurnObserver] = None
    startupGate: Optional[IStartupGate] = None
    keyPolicy: Optional[IKeyPolicy] = None
    prices: Optional[IPriceTable] = None
    requestLog: Optional[IRequestLog] = None
    keyUsage: Optional[IKeyUsage] = None
    budget: RetryBudget = field(factory=RetryBudget)
    """The global retry budget (R19), shared by every turn."""
    inflight: dict = field(factory=dict)
    """Every turn running now -> the Deferred L{run} returned for it, so a
    graceful stop can wait for them and cancel what is left
    (L{relay.process.drain})."""
    backgroundOwners: dict = field(factory=dict)
    """R107: a running background create -> (account, response id), once its
    response id is known; an unfinished one is watched when the create ends
    (L{relay.engine.background.watchBackground})."""
    drains: set = field(factory=set)
    """Behaviour.md R107: the stream pumps reading a left client's upstream
    for its usage (L{relay.engine.pump.StreamPump.hurry} ends them with an
    estimate when a graceful stop's grace runs out)."""
    _log = ClassLogger()

    # What the attempts call back (L{relay.engine.record}), and the slot
    # wait the per-key admission uses (L{relay.engine.waiting}).
    usageTap = R.usageTap
    recordUsage = R.recordUsage
    ownResponse = R.ownResponse
    _tryThenWait = W.tryThenWait

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

    def run(self, turn: Turn, sink, since: Optional[float] = None) -> Deferred:
        """
        Run C{turn}, writing to C{sink} (an L{relay.interfaces.ITurnSink}).
        The turn was admitted by the front door (L{relay.frontdoor}: the
        key's policy, budget and windows, R102, R105, R108); the engine
        does not check the key again.

        @param since: when the turn reached the front door (clock seconds),
            if it waited there: its duration and relay's added latency
            count from then; L{None}: now.

        @return: a Deferred firing with the turn's outcome string:
            C{completed}, C{failed}, C{client_gone} or C{error}. It never
            fails; bugs are logged and answered with a 502.
        """
        if turn.compactionItems is not None or endsWithTrigger(turn.body):
            # R89: compaction items are bound to the account that produces
            # them (a compaction turn, a compact request); see which it was.
            if turn.compactionItems is None:
                turn.compactionItems = []
            sink = CompactionWatch(sink, turn.compactionItems)
        key = turn.client
        if (key.daily_usd is not None or key.monthly_usd is not None) and turn.body.get("tools"):
            from relay.tenants.prices import requestTools

            if requestTools(turn.body):
                # R109: the hosted-tool calls of an answer whose terminal
                # event lists no output (the ChatGPT backend).
                turn.hostedCalls = {}
                sink = HostedCallWatch(sink, turn.hostedCalls)
        if self.keyUsage is not None:
            self._readKeyLimits(turn)
        d = Deferred.fromCoroutine(self._running(turn, sink, since))
        if not d.called:
            self.inflight[turn] = d  # until it ends (L{_running})
        return d

    async def _running(self, turn: Turn, sink, since: Optional[float]) -> str:
        """
        L{_run} for L{run}: a turn that waited was put in L{inflight}; it
        leaves as it ends, before its Deferred fires (no callback on it).
        """
        try:
            return await self._run(turn, sink, None, since)
        finally:
            self.inflight.pop(turn, None)

    def _readKeyLimits(self, turn: Turn) -> None:
        """
        R114: read the key's windows for the turn's rate-limit headers and
        events while it is dialled (never waited for: a turn whose first
        output comes first carries none). Windows that need no wait (no
        C{rpm}/C{tpm} to read: L{KeyUsage.limitsNow}) are read here,
        without a coroutine.
        """
        try:
            limits = self.keyUsage.limitsNow(turn.client)
        except Exception:  # noqa: BLE001 - logged as the awaited read's failure is
            self._log.failure("reading key {key_name}'s windows failed",
                              key_name=turn.client.name)
            return
        if limits is not None:
            turn.keyLimits = limits
            return

        def keep(limits):
            turn.keyLimits = limits

        def failed(failure):
            self._log.failure("reading key {key_name}'s windows failed", failure,
                              key_name=turn.client.name)

        Deferred.fromCoroutine(self.keyUsage.limits(turn.client)).addCallbacks(keep, failed)

    def refuse(self, turn: Turn, sink, reason, since: Optional[float] = None) -> Deferred:
        """
        End a turn the front door did not let through, recorded as a turn
        that ended before its first attempt (trace, request log,
        C{relay.turn_finished}, metrics; R102, R2), its key slot and budget
        hold given back.

        @param reason: the refusal's L{ClientError} (written to C{sink});
            L{None} when the client left while the turn was checked (a wait
            relay cancelled itself answers C{turn.cancel.tell}); or the
            exception a check failed with (logged, answered 502).
        @param since: as L{run}'s.
        @return: a Deferred firing with the outcome, as L{run}'s.
        """
        if reason is None:
            reason = ClientGone(turn.cancel.reason or "client_gone")
        elif isinstance(reason, ClientError):
            reason = _AdmissionFailed(reason)
        return Deferred.fromCoroutine(self._run(turn, sink, reason, since))

    def keySlot(self, turn: Turn, keepalive=None) -> Deferred:
        """
        Wait for C{turn.client}'s slot (R26) before the turn's body is
        decoded (R103; the front door's L{relay.frontdoor.door.FrontDoor.admitSlot}):
        the same wait plan, logs and answers as a turn's own per-key
        admission, and keepalives (R85, R31) for a request that streams:
        C{keepalive} is called whenever the wait was silent for
        C{stream_keepalive_interval} seconds (at least every
        C{scheduling.ping_interval}).

        @param turn: a L{Turn} standing for the request (its key, cancel
            signal, request id and entrypoint).
        @param keepalive: a no-argument callable writing one keepalive, or
            L{None}.
        @return: a Deferred firing with the lease, or failing with an
            exception whose C{error} is the R32 L{ClientError} (or with
            L{ClientGone}).
        """
        return Deferred.fromCoroutine(self._keySlot(turn, keepalive))

    async def _keySlot(self, turn: Turn, keepalive=None):
        """
        See L{keySlot}. A wait relay cancelled itself (the end of a
        graceful stop's grace) fails with the error relay owes the client
        (C{cancel.tell}: 503 C{server_restarting}, C{Retry-After}).
        """
        state = None
        if keepalive is not None:
            state = TurnState(startedAt=self.clock.seconds())
            state.keepalive = StreamKeepalive(
                clock=self.clock, send=keepalive,
                interval=self.settings.current.stream_keepalive_interval,
                requestId=turn.requestId,
            )
            state.keepalive.start()
        try:
            return await self._admitUser(turn, None, state)
        except ClientGone:
            if turn.cancel.tell is not None:
                raise _AdmissionFailed(turn.cancel.tell) from None
            raise
        finally:
            if state is not None:
                state.keepalive.stop()

    # -- the loop --------------------------------------------------------------

    async def _run(self, turn: Turn, sink, refusal: Optional[Exception] = None,
                   since: Optional[float] = None) -> str:
        # Every log line written while this coroutine runs (health,
        # scheduler, admission) carries the turn's id (relay.base.requestid).
        bindRequestId(turn.requestId)
        start = self.clock.seconds() if since is None else since
        state = TurnState(startedAt=start)
        if self.observer is not None:
            state.trace = self.observer.turnStarted(turn)
        userLease = None
        outcome, status, accountId = "error", 500, None
        if self.requestLog is not None and self.requestLog.sampled():
            sink = _SamplingSink(sink, self.requestLog.sampleMaxBytes)
        state.sink = sink
        self.budget.active += 1
        try:
            if turn.keyAdmitted:
                # R103: the front door admitted the key's slot before the
                # body was decoded (L{keySlot}); the turn owns it now,
                # so every way out below gives it back.
                userLease, turn.keyLease = turn.keyLease, None
            if refusal is not None:
                # the front door refused the turn (relay.frontdoor): it
                # ends here, recorded like every turn
                raise refusal
            state.keepalive = W.startKeepalive(self, turn, sink)
            if not turn.keyAdmitted:
                userLease = await self._admitUser(turn, sink, state)
            outcome, status, accountId = await self._loop(turn, sink, state)
        except ClientGone:
            outcome, status = "client_gone", 499
            if turn.cancel.tell is not None:
                # relay cancelled the turn itself (a graceful stop's grace
                # ran out): nothing was judged or written (R2),
                # and the client, still there, gets a terminal error once
                # the slots are back (invariant 4).
                outcome, status = "relay_cancelled", turn.cancel.tell.status
        except _AdmissionFailed as e:
            # R26/R32: the per-key slot could not be had; or the key's token
            # budget is spent.
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
            if state.keepalive is not None:
                state.keepalive.stop()
            if userLease is not None:
                userLease.release()
            if turn.budgetHold is not None:
                # R108: a turn refused or failed before output gives its
                # reservation back (settled ones are done already).
                self.usage.release(turn.budgetHold)
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
        R.finished(self, turn, state, outcome, status, accountId or state.lastAccountId, start)
        return outcome

    def _priceRefusal(self, turn: Turn, account) -> Optional[ClientError]:
        """
        R109: a key with a money budget is refused (C{model_not_priced})
        when the model C{account} serves the turn as, the request's
        C{service_tier} or a hosted tool it offers has no price.
        """
        key = turn.client
        if self.keyPolicy is None or (key.daily_usd is None and key.monthly_usd is None):
            return None
        if not turn.model or (turn.request is not None and not turn.request.billed):
            return None  # nothing generated, or no model to price (as the key policy)
        served = account.upstreamModel(turn.model)
        error = self.keyPolicy.priceRefusal(key, served, turn.body)
        if error is not None:
            self._log.info(
                "key {key_name} refused: {message}", event="relay.key_policy_refused",
                key_name=key.name, code=error.code, message=error.message,
                request_id=turn.requestId, account_id=account.id,
            )
        return error

    async def _admitUser(self, turn: Turn, sink, state: Optional[TurnState] = None):
        """
        The per-key slot (R26; on the WebSocket too, R-B10).
        """
        key = turn.client
        if key.concurrency <= 0 or (turn.request is not None and not turn.request.usesSlot):
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
                    lease = await W.retakeSameAccount(self, turn, sink, account, state)
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
                        error = await D.withRetryHint(self, turn, error, e.error)
                    sink.fail(error)
                    return "failed", error.status, state.lastAccountId
                account = selection.account
                lease = selection.lease
                refused = self._priceRefusal(turn, account)
                if refused is not None:
                    # R109: what the chosen account serves has no price
                    # (a key with a money budget): refused before dialling.
                    if lease is not None:
                        lease.release()
                    sink.fail(refused)
                    return "failed", refused.status, account.id
                if state.pendingFailover is not None:
                    self.metrics.failoverTo(state.pendingFailover, account.id)
                    state.pendingFailover = None
                if lease is None:
                    try:
                        lease = await W.wait(
                            self, turn, sink, selection.waitPlan, "account_busy", state
                        )
                    except _AdmissionFailed as e:
                        sink.fail(e.error)
                        return "failed", e.error.status, account.id
                _leaveIfGone(turn, lease)  # R2: no binding for a client that left
                await self.scheduler.bind(turn, account)
            state.attempts += 1
            state.lastAccountId = account.id
            attempt = Attempt(account.id)
            state.tried.append(attempt)
            if self.history is not None:
                self.history.attempt(account.id)
            if not state.dispatched:
                # Relay-added latency: start to first dispatch, less waits.
                state.dispatched = True
                if self.metrics is not None:
                    self.metrics.addedLatency(
                        self.clock.seconds() - state.startedAt - state.waited
                    )
            if state.trace is not None:
                state.trace.attemptStarted(account, state)
            result = await self._attempt(turn, sink, account, lease, state)
            end = result.end
            if (result.ok or result.committed) and state.keepalive is not None:
                state.keepalive.stop()  # R85: the terminal event was written
            if turn.cancel.cancelled or isinstance(end, ends.Departed):
                # R2: the client left (or relay cancelled the attempt for
                # it); nothing is judged, recorded or written.
                attempt.reason, attempt.decision = "client_gone", "client_gone"
                raise ClientGone(turn.cancel.reason or getattr(end, "reason", "client_gone"))
            verdict = result.verdict
            if verdict is None:
                verdict = self.judge(turn, account, end)
            if verdict is not None:
                attempt.status, attempt.reason = verdict.status, verdict.reason
            if state.trace is not None:
                state.trace.attemptEnded(result, verdict, state)
            if not result.committed and verdict is not None:
                # Ends relay resolves on the same account before any
                # decision, and that say nothing against the account: R7's
                # one-shot body rewrite, R11's one OAuth refresh after a 401.
                if D.rewriteOnce(self, turn, state, account, verdict) or await D.refreshOnce(
                    self, turn, state, account, verdict
                ):
                    attempt.decision = "replay"
                    sameAccount = account
                    continue
            model = account.upstreamModel(turn.model) if turn.model else None
            recorded = await self.bookkeeping.record(
                account, end, verdict, model, turn.requestId, turn.upstreamRequestId
            )
            if result.ok:
                attempt.status, attempt.reason, attempt.decision = result.status, "ok", "served"
                sink.finish()
                await R.succeeded(self, turn, account, result)
                return "completed", result.status, account.id
            if result.committed:
                # R19 step 2 / R23: after output nothing fails over; the
                # terminal event (upstream's or relay's) is already written.
                attempt.decision = "failed_after_output"
                if attempt.status is None:
                    attempt.status = result.status
                sink.finish()
                return "failed", result.status, account.id
            if verdict is None:
                raise AssertionError(f"attempt ended with {end!r} but no verdict")
            decision = await D.decide(self, turn, sink, state, account, verdict, recorded)
            attempt.decision = decision[0]
            if decision[0] == "pass":
                sink.fail(decision[1])
                return "failed", decision[1].status, account.id
            if decision[0] == "exhausted":
                error = await D.withRetryHint(self, turn, decision[1])
                sink.fail(error)
                return "failed", error.status, account.id
            if decision[0] == "same":
                await W.sleep(self, turn, sink, decision[1], state)
                sameAccount = account
                continue
            # switch
            await W.sleep(self, turn, sink, decision[1], state)

    # -- one attempt -----------------------------------------------------------

    async def _attempt(self, turn: Turn, sink, account, lease, state=None) -> AttemptResult:
        """
        One attempt on C{account} holding C{lease}. The lease is released on
        every path, before a terminal event is written. With a credential
        source the account is dialled with its current bearer, refreshed
        first when it is missing or expired.
        """
        released = []
        turn.upstreamRequestId = None
        renew = getattr(lease, "startRenewing", None)
        if renew is not None:
            # R34: a long stream keeps its Redis slot lease alive.
            renew()

        def release():
            if not released:
                released.append(True)
                lease.release()

        try:
            if self.credentials is not None:
                pending = self.credentials.ready(account)
                if pending is not None:
                    await raceCancel(pending, turn.cancel)
                account = self.credentials.current(account)
                if state is not None:
                    state.bearers[account.id] = account.credential
            if turn.cancel.cancelled:
                # R2: the client left while the account was being chosen
                # or its slot taken (a late store answer); nothing is dialled.
                raise ClientGone(turn.cancel.reason or "client_gone")
            if turn.request is not None:
                # R87: a request of its own kind, never the generation path.
                return await turn.request.run(self, turn, sink, account, release)
            if self.wsAttempt is not None and turn.entrypoint == "ws" and turn.wsMode in (
                "ctx_pool",
                "passthrough",
            ):
                return await self.wsAttempt(self, turn, sink, account, release)
            return await attemptHTTP(self, turn, sink, account, release)
        finally:
            release()

    def firstOutput(self, turn: Turn) -> None:
        """
        The attempt wrote the turn's first output: note when (once).
        """
        if turn.firstOutputAt is None:
            turn.firstOutputAt = self.clock.seconds()

