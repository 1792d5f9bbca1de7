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
from twisted.internet.defer import Deferred, succeed
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
    IEngineMetrics, IFailureClassifier, IKeyPolicy, IPriceTable, IRequestLog, IRuntimeSettings,
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

STARTUP_WAIT_SECONDS = 10.0
"""R105: how long a turn that arrives before the stores are loaded waits for
them; after that it goes on, and selection skips an account whose tokens
are still loading (C{tokens_loading})."""


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
    @ivar startupGate: R105: the L{IStartupGate} a turn waits on (at most
        L{STARTUP_WAIT_SECONDS}) until the stores are loaded; L{None}: no
        wait.
    @ivar keyPolicy: the L{IKeyPolicy} checked before every turn (R102),
        or L{None}.
    @ivar prices: the L{IPriceTable} pricing each turn's usage (R109), or
        L{None} (costs not counted).
    @ivar requestLog: the L{IRequestLog} that gets each turn's
        L{relay.tenants.record.TurnRecord}, or L{None}.
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
    budget: RetryBudget = field(factory=RetryBudget)
    """The global retry budget (R19), shared by every turn."""
    inflight: dict = field(factory=dict)
    """Every turn running now -> the Deferred L{run} returned for it, so a
    graceful stop can wait for them and cancel what is left (issue 14,
    L{relay.process.drain})."""
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

    def run(self, turn: Turn, sink) -> Deferred:
        """
        Run C{turn}, writing to C{sink} (an L{relay.interfaces.ITurnSink}).

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
        # Issue 15: every log line written while this coroutine runs (health,
        # scheduler, admission) carries the turn's id (relay.base.requestid).
        bindRequestId(turn.requestId)
        start = self.clock.seconds()
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
                # Issue 19 (R103): the entry admitted the key's slot before
                # the body was decoded (L{admitKey}); the turn owns it now,
                # so every way out below gives it back.
                userLease, turn.keyLease = turn.keyLease, None
            state.keepalive = W.startKeepalive(self, turn, sink)
            # R105: the stores first (the key policy reads the control
            # plane's keys and disables, selection its pauses).
            # Issue 24: no coroutine for what is ready (the common case).
            gate = self.startupGate
            pending = gate.wait() if gate is not None else None
            if pending is not None:
                await self._waitForStores(turn, pending)
            self._checkKeyPolicy(turn, self.clock.seconds())
            if self.usage is not None and self.usage.hasBudget(turn.client.name):
                await self._reserveBudget(turn)
            if self.keyPolicy is not None and (turn.client.rpm or turn.client.tpm):
                await self._checkKeyRate(turn)
            if not turn.keyAdmitted:
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
            # R26/R32: the per-key slot could not be had; or the key's token
            # budget is spent (issue 13 item 5).
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

    def _checkKeyPolicy(self, turn: Turn, now: float) -> None:
        """
        Issue 22 (behaviour.md R102): the key's policy before the turn takes
        a slot: disabled, expired, model allow/deny list, a money budget on
        an unpriced model (L{relay.tenants.keypolicy.KeyPolicy.refusal}); and
        the accounts the key may reach, for selection.

        @raise _AdmissionFailed: with the policy's L{ClientError}.
        """
        policy = self.keyPolicy
        if policy is None:
            return
        key = turn.client
        turn.allowedAccounts = policy.allowedAccounts(key)
        error = policy.refusal(key, turn.model, now)
        if error is None:
            return
        self._log.info(
            "key {key_name} refused: {message}",
            event="relay.key_policy_refused",
            key_name=key.name,
            code=error.code,
            message=error.message,
            request_id=turn.requestId,
        )
        raise _AdmissionFailed(error)

    async def _checkKeyRate(self, turn: Turn) -> None:
        """
        Issue 22: the key's C{rpm}/C{tpm} windows count the turn, or refuse
        it with a 429 that carries C{Retry-After} and the
        C{x-ratelimit-*} headers (L{relay.tenants.keypolicy.KeyPolicy.admitRate}).

        @raise _AdmissionFailed: with that L{ClientError}.
        """
        key = turn.client
        if self.keyPolicy is None or not (key.rpm or key.tpm):
            return
        error = await self.keyPolicy.admitRate(turn)
        if error is not None:
            raise _AdmissionFailed(error)

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

    def refusal(self, turn: Turn) -> Optional[ClientError]:
        """
        Issue 22: the key policy's answer for a C{response.create} relay
        answers without a generation (an C{http_bridge} prewarm), so it is
        refused exactly like a turn would be (behaviour.md R102).

        @return: the L{ClientError}, or L{None}.
        """
        if self.keyPolicy is None:
            return None
        now = self.clock.seconds()
        return self.keyPolicy.refusal(turn.client, turn.model, now) or (
            self.usage.overBudget(turn.client.name, now) if self.usage is not None else None
        )

    async def _waitForStores(self, turn: Turn, pending: Deferred) -> None:
        """
        R105: no turn on an account before its tokens, the settings and the
        control plane's first read (pauses, admin keys and disables) are
        loaded: the one start-up gate (L{relay.process.readiness.StartupGate}).
        A turn that arrives first waits (cancellable, at most
        L{STARTUP_WAIT_SECONDS}; a store whose read failed sets its flag,
        R35/R101, so a silent store ends the wait); then selection's
        C{tokens_loading} block skips what is still not loaded.

        @param pending: the gate's L{Deferred} (C{StartupGate.wait}), not
            yet fired.
        """
        self._log.info(
            "turn {request_id} waits for the stores to load", event="relay.turn_waits_for_stores",
            request_id=turn.requestId,
        )
        pending.addTimeout(STARTUP_WAIT_SECONDS, self.clock)
        try:
            await raceCancel(pending, turn.cancel)
        except ClientGone:
            raise
        except Exception:  # noqa: BLE001 - timed out: go on, loading accounts are skipped
            self._log.warn(
                "stores not loaded after {seconds} s; turn {request_id} goes on",
                event="relay.stores_not_loaded", seconds=STARTUP_WAIT_SECONDS,
                request_id=turn.requestId,
            )

    async def _reserveBudget(self, turn: Turn) -> None:
        """
        R102, R108: a key with a token or money budget
        reserves the turn's estimate (L{_budgetEstimate}) before the turn
        takes a slot or reaches an account; a key whose budget minus spend
        minus its other turns' reservations is not above zero gets a 429.
        The hold is put on the turn (C{Turn.budgetHold}): its usage settles
        it (L{recordUsage}), the turn's end releases what was not settled.

        @raise _AdmissionFailed: with the budget's L{ClientError}.
        """
        if turn.request is not None and not turn.request.billed:
            return
        tokens, nanos = await self._budgetEstimate(turn)
        error, hold = await self.usage.reserve(turn.client.name, tokens, nanos)
        if error is None:
            turn.budgetHold = hold
            if turn.cancel.cancelled:
                raise ClientGone(turn.cancel.reason or "client_gone")
            return
        self._log.warn(
            "key {key_name} is over its budget",
            event="relay.token_budget_exceeded",
            key_name=turn.client.name,
            message=error.message,
            request_id=turn.requestId,
        )
        raise _AdmissionFailed(error)

    async def _budgetEstimate(self, turn: Turn) -> tuple:
        """
        R108: what a turn may use before it runs: input from the body
        (L{relay.usage.estimate.inputTokens}) plus, for a turn chained by
        C{previous_response_id}, the chain's last known input + output;
        output from the body's C{max_output_tokens} (chat:
        C{max_completion_tokens}, C{max_tokens}), else the key's
        C{max_turn_output_tokens}; the cost at the dearest price of the
        accounts the key may reach (L{relay.tenants.keypolicy.KeyPolicy.estimate}).

        @return: C{(tokens, nano-dollars)}.
        """
        from relay.usage.estimate import inputTokens, outputTokens

        key = turn.client
        previous = turn.previousResponseId or turn.body.get("previous_response_id")
        chain = await self.usage.chainTokens(previous if isinstance(previous, str) else None)
        given = inputTokens(turn.body) + chain
        out = outputTokens(turn.body, key.max_turn_output_tokens)
        nanos = 0
        if self.keyPolicy is not None and (key.daily_usd is not None
                                           or key.monthly_usd is not None):
            nanos = self.keyPolicy.estimate(key, turn.model, turn.body, given, out)
        return given + out, nanos

    def admitKey(
        self, key, cancel, requestId: str = "", entrypoint: str = "http", keepalive=None
    ) -> Deferred:
        """
        Admit C{key}'s slot (R26) for a request whose body is not decoded
        yet (behaviour.md R103, issue 19): the entry calls this once the
        raw body is in and hands the lease to the turn (C{Turn.keyLease},
        C{keyAdmitted=True}). The same wait plan, logs and answers as a
        turn's own per-key admission, and the same keepalives (R85, R31)
        for a request that streams: C{keepalive} is called whenever the
        wait was silent for C{stream_keepalive_interval} seconds (at least
        every C{scheduling.ping_interval}).

        @param key: the authenticated L{relay.base.records.ClientKey}.
        @param cancel: the request's L{relay.base.records.CancelSignal}.
        @param requestId: for the wait's log lines.
        @param entrypoint: C{http} or C{ws}.
        @param keepalive: a no-argument callable writing one keepalive to
            the client (an SSE comment, a ping frame), or L{None} for a
            request that does not stream.
        @return: a Deferred firing with the lease (L{None} for an unlimited
            key), or failing with an exception whose C{error} is the R32
            L{ClientError} (or with L{ClientGone}).
        """
        if key.concurrency <= 0:
            # Issue 24: an unlimited key has no slot to admit (what
            # _admitUser answers at once); no Turn, coroutine or keepalive.
            return succeed(None)
        intake = Turn(
            entrypoint=entrypoint, endpoint="responses", client=key, model=None, body={},
            stream=False, requestId=requestId, cancel=cancel,
        )
        d = Deferred.fromCoroutine(self._admitKey(intake, keepalive))
        if not d.called:
            # A request waiting for its key's slot is a turn in the making:
            # a graceful stop waits for it and, when the grace runs out,
            # cancels it like a running turn (issue 14), so no slot or
            # wait ticket is taken after the drain gave them back.
            self.inflight[intake] = d
            d.addBoth(self._forget, intake)
        return d

    async def _admitKey(self, intake: Turn, keepalive=None):
        """
        See L{admitKey}. A wait relay cancelled itself (the end of a
        graceful stop's grace) fails with the error relay owes the client
        (C{cancel.tell}: 503 C{server_restarting}, C{Retry-After}).
        """
        state = None
        if keepalive is not None:
            state = TurnState(startedAt=self.clock.seconds())
            state.keepalive = StreamKeepalive(
                clock=self.clock, send=keepalive,
                interval=self.settings.current.stream_keepalive_interval,
                requestId=intake.requestId,
            )
            state.keepalive.start()
        try:
            return await self._admitUser(intake, None, state)
        except ClientGone:
            if intake.cancel.tell is not None:
                raise _AdmissionFailed(intake.cancel.tell) from None
            raise
        finally:
            if state is not None:
                state.keepalive.stop()

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
                # one-shot body rewrite, issue 12's one refresh after a 401.
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
        first when it is missing or expired (issue 12).
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

