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

from typing import Optional

from attrs import define, evolve, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import deferLater

from relay.policy import failures as F
from relay.engine import errors as E
from relay.engine.background import watchBackground
from relay.engine.cancel import ClientGone, raceCancel
from relay.engine.httpattempt import attemptHTTP
from relay.engine.keepalive import StreamKeepalive
from relay.engine.payload import translatesChat, withoutEncryptedReasoning, withoutField
from relay.engine.pump import AttemptResult
from relay.engine.compaction import CompactionWatch, endsWithTrigger, recordCompaction
from relay.engine.requests import onceUsageTap, requestFinished
from relay.logs import ClassLogger
from relay.model import AdmissionError, ClientError, Turn, WaitPlan
from relay.policy import ends
from relay.policy.bookkeeping import AccountBookkeeping
from relay.policy.classify import sanitise
from relay.policy.judgement import judge
from relay.requestid import bindRequestId
from relay.scheduling.itemowners import outputItemIds
from relay.scheduling.scheduler import NO_SLOT
from relay.scheduling.selection import NoAccountAvailable
from relay.tenants.record import Attempt, TurnRecord
from relay.usage.tap import HostedCallWatch, UsageTap, clientAskedUsage

STARTUP_WAIT_SECONDS = 10.0
"""R105: how long a turn that arrives before the stores are loaded waits for
them; after that it goes on, and selection skips an account whose tokens
are still loading (C{tokens_loading})."""

MAX_FIRST_OUTPUT_SWITCHES = 1
"""behaviour.md R21: the first safe-after-write failure switches, the second ends."""

OAUTH_429_SWITCH_STOP = 3
"""behaviour.md R13 stop rule."""

FIXED_RETRY_DELAY = 0.5
"""Same-account retry delay without a better one (R14), seconds."""


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
    keepalive: StreamKeepalive | None = None
    """The turn's downstream keepalive (R85), for streaming turns."""
    bearers: dict = field(factory=dict)
    """Account id -> the bearer its last attempt was dialled with (issue 12)."""
    refreshed: set = field(factory=set)
    """Accounts that got their one 401 refresh-and-replay in this turn."""
    tried: list = field(factory=list)
    """Issue 22: every attempt (L{Attempt}) and why it was left, for the
    turn's record."""
    sink: object = None
    """The turn's sink (its C{failed} error goes into the record)."""
    trace: object = None
    """The turn's L{relay.interfaces.ITurnTrace} (issue 23), or L{None}."""


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

    @ivar clock: the injected L{IReactorTime}.
    @ivar scheduler: the L{relay.interfaces.IAccountScheduler}.
    @ivar admission: the L{relay.interfaces.ISlotAdmission}.
    @ivar dialer: the L{relay.interfaces.IUpstreamDialer}.
    @ivar classifier: the L{relay.interfaces.IFailureClassifier}.
    @ivar health: the L{relay.policy.health.AccountHealth}.
    @ivar settings: the L{relay.settings.RuntimeSettings}, read per attempt.
    @ivar metrics: optional L{relay.operator.metrics.RelayMetrics}.
    @ivar wsAttempt: optional attempt function for WebSocket upstream modes
        (issue 6), called like L{relay.engine.httpattempt.attemptHTTP}.
    @ivar usage: optional L{relay.usage.ledger.UsageLedger}: token
        accounting and per-key budgets (issue 13 item 5).
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
    usage: object = None
    history: object = None
    """optional L{relay.interfaces.IAccountHistory} (the status page's charts)."""
    credentials: object = None
    """The L{relay.interfaces.ICredentialSource}, or L{None}: dial as configured."""
    quota: object = None
    """The L{relay.scheduling.quota.UsageWindows} recording upstream usage windows, or L{None}."""
    observer: object = None
    """The L{relay.interfaces.ITurnObserver} (traces, issue 23), or L{None}:
    then nothing is built per turn."""
    budget: RetryBudget = field(factory=RetryBudget)
    bookkeeping: object = None
    """The L{AccountBookkeeping}: the one writer of account state for an
    attempt's end (behaviour.md R86); built from C{health} when not given."""
    startupGate: object = None
    """Issue 19 item 6 (R105): a L{relay.operations.readiness.StartupGate}
    a turn waits on (at most L{STARTUP_WAIT_SECONDS}) until the settings
    and token stores are loaded; L{None}: no wait."""
    inflight: dict = field(factory=dict)
    """Every turn running now -> the Deferred L{run} returned for it, so a
    graceful stop can wait for them and cancel what is left (issue 14,
    L{relay.operations.drain})."""
    backgroundOwners: dict = field(factory=dict)
    """R107: a running background create -> (account, response id), once its
    response id is known; an unfinished one is watched when the create ends
    (L{relay.engine.background.watchBackground})."""
    drains: set = field(factory=set)
    """Behaviour.md R107: the stream pumps reading a left client's upstream
    for its usage (L{relay.engine.pump.StreamPump.hurry} ends them with an
    estimate when a graceful stop's grace runs out)."""
    keyPolicy: object = None
    """Issue 22: the L{relay.tenants.policy.KeyPolicy} checked before every
    turn (behaviour.md R102), or L{None}."""
    prices: object = None
    """Issue 22: the L{relay.tenants.prices.PriceTable} pricing each turn's
    usage, or L{None} (costs not counted)."""
    requestLog: object = None
    """Issue 22: the L{relay.interfaces.IRequestLog} that gets each turn's
    L{TurnRecord}, or L{None}."""
    _log = ClassLogger()

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
        # scheduler, admission) carries the turn's id (relay.requestid).
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
            state.keepalive = self._startKeepalive(turn, sink)
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
        self._finished(turn, state, outcome, status, accountId or state.lastAccountId, start)
        return outcome

    def _checkKeyPolicy(self, turn: Turn, now: float) -> None:
        """
        Issue 22 (behaviour.md R102): the key's policy before the turn takes
        a slot: disabled, expired, model allow/deny list, a money budget on
        an unpriced model (L{relay.tenants.policy.KeyPolicy.refusal}); and
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
        C{x-ratelimit-*} headers (L{relay.tenants.policy.KeyPolicy.admitRate}).

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
        loaded: the one start-up gate (L{relay.operations.readiness.StartupGate}).
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
        C{max_completion_tokens}, C{max_tokens}), else (or where the key
        may reach an account that drops that limit: OAuth,
        L{relay.tenants.policy.KeyPolicy.outputLimitHonoured}) the key's
        C{max_turn_output_tokens}; the cost at the dearest price of the
        accounts the key may reach (L{relay.tenants.policy.KeyPolicy.estimate}).

        @return: C{(tokens, nano-dollars)}.
        """
        from relay.usage.estimate import inputTokens, outputTokens

        key = turn.client
        previous = turn.previousResponseId or turn.body.get("previous_response_id")
        chain = await self.usage.chainTokens(previous if isinstance(previous, str) else None)
        given = inputTokens(turn.body) + chain
        honoured = self.keyPolicy is None or self.keyPolicy.outputLimitHonoured(key, turn.model)
        out = outputTokens(turn.body if honoured else None, key.max_turn_output_tokens)
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

        @param key: the authenticated L{relay.model.ClientKey}.
        @param cancel: the request's L{relay.model.CancelSignal}.
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
                        error = await self._withRetryHint(turn, error, e.error)
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
                        lease = await self._wait(
                            turn, sink, selection.waitPlan, "account_busy", state
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
                if self._rewriteOnce(turn, state, account, verdict) or await self._refreshOnce(
                    turn, state, account, verdict
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
                await self._succeeded(turn, account, result)
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
            decision = await self._decide(turn, sink, state, account, verdict, recorded)
            attempt.decision = decision[0]
            if decision[0] == "pass":
                sink.fail(decision[1])
                return "failed", decision[1].status, account.id
            if decision[0] == "exhausted":
                error = await self._withRetryHint(turn, decision[1])
                sink.fail(error)
                return "failed", error.status, account.id
            if decision[0] == "same":
                await self._sleep(turn, sink, decision[1], state)
                sameAccount = account
                continue
            # switch
            await self._sleep(turn, sink, decision[1], state)

    async def _withRetryHint(self, turn: Turn, error: ClientError, fallback=None) -> ClientError:
        """
        Issue 19 item 7 (R83, R16): relay's 429 after every account it
        tried answered 429 carries C{Retry-After} -- the upstream's when it
        gave one, else the seconds until the earliest cooldown ends.

        @param fallback: the scheduler's own answer, whose hint is used
            first when it has one.
        """
        if error.status != 429 or any(n.lower() == "retry-after" for n, _ in error.headers):
            return error
        hint = None
        for name, value in (fallback.headers if fallback is not None else ()):
            if name.lower() == "retry-after":
                hint = value
        if hint is None:
            hinter = getattr(self.scheduler, "retryHint", None)
            seconds = await hinter(turn) if hinter is not None else None
            hint = str(seconds) if seconds else None
        if hint is None:
            return error
        return evolve(error, headers=tuple(error.headers) + (("Retry-After", hint),))

    def _rewriteOnce(self, turn: Turn, state: TurnState, account, verdict) -> bool:
        """
        behaviour.md R7: a one-shot same-account retry with a corrected body
        before any failover decision; it counts as neither a switch nor a
        same-account retry. Implemented: 400 C{invalid_encrypted_content}
        -> drop the encrypted reasoning items; a 400 naming an unknown or
        unsupported parameter (C{verdict.rejectedField}, R106, R112) ->
        drop that field, once per turn (a second refusal reaches the
        client).

        @return: L{True} when C{turn.body} was rewritten for a retry.
        """
        if verdict is not None and verdict.rejectedField is not None:
            return self._dropRejectedField(turn, state, account, verdict.rejectedField)
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

    def _dropRejectedField(self, turn: Turn, state: TurnState, account, name: str) -> bool:
        """
        behaviour.md R7's rejected field (R106, R112): drop the field the
        upstream refused and retry once on the same account, on every
        entrypoint (the HTTP and WebSocket attempts build their upstream
        body from C{turn.body}).

        @param name: the field as upstream named it.
        @return: L{True} when the field was dropped for a retry.
        """
        if "rejected_field" in state.rewrites:
            return False
        body = withoutField(turn.body, name)
        if body is None:
            return False
        turn.body = body
        state.rewrites.add("rejected_field")
        self._log.info(
            "retrying {account_id} without the field upstream refused",
            event="openai.rejected_field_retry",
            account_id=account.id,
            field=sanitise(name, 120),
            request_id=turn.requestId,
        )
        return True

    async def _refreshOnce(self, turn: Turn, state: TurnState, account, verdict) -> bool:
        """
        Issue 12 (behaviour.md R11, protocol.md 7.4): a 401 from an OAuth
        account that can refresh, before anything reached the client,
        triggers one refresh (single flight) and one replay on the same
        account before any failover decision. A second 401 in the turn
        invalidates the cached token and goes on to R11's marking.

        @return: L{True} when a new token is in place and the turn should
            be replayed on C{account}.
        """
        if self.credentials is None or verdict is None or verdict.status != 401:
            return False
        if verdict.kind not in (F.STATUS, F.STREAM) or account.type != "oauth":
            return False
        if account.id in state.refreshed:
            self.credentials.invalidate(account)
            return False
        if not self.credentials.canRefresh(account):
            return False
        state.refreshed.add(account.id)
        ok = await raceCancel(
            self.credentials.refresh(account, stale=state.bearers.get(account.id)), turn.cancel
        )
        self._log.info(
            "401 on {account_id}: token refresh {outcome}; {action}",
            event="openai.oauth_401_refresh",
            account_id=account.id,
            outcome="succeeded" if ok else "failed",
            action="replaying on the same account" if ok else "deciding as usual",
            request_id=turn.requestId,
        )
        return bool(ok)

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
            return ("exhausted", E.previousResponseNotFound(turn.previousResponseId))
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
            upstream_request_id=turn.upstreamRequestId,
            entrypoint=turn.entrypoint,
        )
        if self.metrics is not None:
            state.pendingFailover = self.metrics.failover(
                verdict.reason, account.id, None, turn.entrypoint, verdict.status
            )
        if self.history is not None:
            self.history.failover(account.id)
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
        A completed turn: remember which account owns the response (R39),
        unless the attempt already did (L{ownResponse}).
        """
        if turn.compactionItems:
            recordCompaction(self, turn, account)
        if result.responseId:
            self._keepChain(turn, result.responseId)
            if not result.ownerRecorded:
                await self.scheduler.recordResponse(turn, result.responseId, account)
            if turn.onResponseId is not None:
                turn.onResponseId(result.responseId, account)

    def _keepChain(self, turn: Turn, responseId: Optional[str]) -> None:
        """
        R108: once a turn of a key with a budget has both its response id
        and its usage, keep its input + output for a turn chained on it
        (for C{previous_response_ttl_seconds}).
        """
        hold = turn.budgetHold
        if hold is None or hold.chainKept:
            return
        if responseId and hold.responseId is None:
            hold.responseId = responseId
        if hold.responseId and turn.usage is not None:
            hold.chainKept = True
            self.usage.rememberChain(
                hold.responseId, turn.usage.total,
                self.settings.current.scheduling.previous_response_ttl_seconds)

    def ownResponse(self, turn: Turn, account, responseId: Optional[str],
                    response=None) -> bool:
        """
        Record that C{account} owns C{responseId} (R39) and the turn's key
        may use it (R40), called by the attempt just I{before} the terminal
        event or body goes to the client: a client chains from a response
        the instant it reads it, possibly through another relay process, so
        the owner must already be in the local map (set synchronously here)
        and its store writes already on their way (sent ahead of the
        client's bytes; a later read from any process sees them). The
        writes are not awaited: the terminal event is not held back, and a
        store error is logged by the scheduler (R35 fail-open).

        @param responseId: the response id, or L{None} (nothing recorded).
        @param response: the completed response object (the terminal
            event's, or the JSON body), or L{None}: its output items are
            the key's too (R104, at most
            L{relay.scheduling.itemowners.MAX_OWNED_ITEMS}), recorded in
            the same store operation.
        @return: whether the owner was recorded.
        """
        if not responseId:
            return False
        self._keepChain(turn, responseId)
        if turn.background and turn.request is None:
            self.backgroundOwners[turn] = (account, responseId)
        if response is not None:
            turn.outputItemIds = tuple(outputItemIds(response))
        d = self.scheduler.recordResponse(turn, responseId, account)
        if not d.called or d.result is not None:
            # Issue 24: a write already done (the memory store's) needs no errback.
            d.addErrback(
                lambda f: self._log.failure(
                    "recording the owner of {response_id} failed", f,
                    response_id=responseId, request_id=turn.requestId,
                )
            )
        return True

    async def _retakeSameAccount(self, turn, sink, account, state=None):
        """
        Retake the slot for a same-account retry, waiting per the sticky
        plan (R60, R64 step 2). A request that takes no slot (R87) retakes
        none.
        """
        if turn.request is not None and not turn.request.usesSlot:
            return NO_SLOT
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
        try:
            lease = await self.admission.tryAcquire(plan.kind, plan.id, plan.max_concurrency)
        except AdmissionError as e:
            # R35 / R101: a slot acquire error (Redis silent or down) is
            # R32's service error (503 / 1011), never an internal error.
            self._log.warn(
                "{kind} slot acquire failed for {id}: {error}",
                event="openai.account_slot_acquire_error"
                if plan.kind == "account" else "openai.user_slot_acquire_error",
                kind=plan.kind, id=plan.id, error=str(e), request_id=turn.requestId,
            )
            raise _AdmissionFailed(E.admissionError(e, plan.kind))
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
        self._log.info(
            "waiting for a {plan} slot on key {key_name}"
            if plan.kind == "user" else "waiting for a {plan} slot on {account_id}",
            event=prefix + "_started", **fields,
        )
        start = self.clock.seconds()
        keepalive = self._keepalive(state)
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
            if keepalive is not None:
                keepalive.endWait()
            if state is not None:
                state.waited += self.clock.seconds() - start
        self._waitFinished(prefix, fields, "acquired", start, getattr(lease, "queuePosition", 0))
        if turn.cancel.cancelled:
            lease.release()
            raise ClientGone(turn.cancel.reason)
        return lease

    def _waitFinished(self, prefix, fields, outcome, start, position) -> None:
        """
        Log the end of a slot wait (R32) and count it: the text names the
        account, or the client key (by name) for a per-key slot.
        """
        waitMs = int((self.clock.seconds() - start) * 1000)
        self._log.info(
            "wait for key {key_name} finished: {outcome} after {wait_ms} ms"
            if fields["key_name"] is not None
            else "wait for {account_id} finished: {outcome} after {wait_ms} ms",
            event=prefix + "_finished",
            outcome=outcome,
            wait_ms=waitMs,
            queue_position=position,
            **fields,
        )
        if self.metrics is not None:
            self.metrics.waitFinished(fields["entrypoint"], outcome, waitMs / 1000.0)

    def _startKeepalive(self, turn: Turn, sink) -> StreamKeepalive | None:
        """
        The turn's downstream keepalive (R24, R85): for every streaming
        turn, from now until the turn ends, an SSE comment or WebSocket
        ping after C{stream_keepalive_interval} seconds of silence.
        Non-streaming turns get none (R31).

        @return: the running L{StreamKeepalive}, or L{None}.
        """
        if not turn.stream:
            return None
        keepalive = StreamKeepalive(
            clock=self.clock,
            send=sink.keepalive,
            interval=self.settings.current.stream_keepalive_interval,
            requestId=turn.requestId,
        )
        watch = getattr(sink, "watchWrites", None)
        if watch is not None:
            watch(keepalive.touch)
        # Issue 19: a request whose key's slot was awaited before its body
        # was parsed may have had keepalives already; the silence counts
        # from the last one (R85), not from the turn's start.
        keepalive.start(since=getattr(sink, "quietSince", None))
        return keepalive

    def _keepalive(self, state) -> StreamKeepalive | None:
        """
        A wait or retry sleep begins: keepalives at least every
        C{ping_interval} seconds while it runs (R31); the caller calls
        C{endWait} on the result.
        """
        keepalive = state.keepalive if state is not None else None
        if keepalive is not None:
            keepalive.beginWait(self.settings.current.scheduling.ping_interval)
        return keepalive

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
        keepalive = self._keepalive(state)
        began = self.clock.seconds()
        try:
            await raceCancel(deferLater(self.clock, seconds), turn.cancel)
        finally:
            if keepalive is not None:
                keepalive.endWait()
            if state is not None:
                state.waited += self.clock.seconds() - began

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

    # -- bookkeeping -----------------------------------------------------------

    def usageTap(self, turn: Turn, account) -> UsageTap:
        """
        The usage reader of one attempt (issue 13 item 5): records into
        L{usage} and onto C{turn.usage}. A chat stream's usage chunk is
        dropped when the client did not ask for it (relay always asks
        upstream, L{relay.engine.payload.upstreamBody}).
        """
        if turn.request is not None or turn.background:
            return onceUsageTap(self, turn, account)  # R87, R88
        # Chat chunks carry usage only when the upstream speaks chat; a
        # translated chat turn (OAuth) ends with a Responses terminal event.
        chat = turn.endpoint == "chat" and turn.stream and not translatesChat(turn, account)
        return UsageTap(
            record=lambda counts: self.recordUsage(turn, account, counts),
            chat=chat,
            dropUsageChunk=chat and not clientAskedUsage(turn.body),
            requestId=turn.requestId,
        )

    def recordUsage(self, turn: Turn, account, counts) -> None:
        """
        Count C{counts} for the turn's key, C{account} and the upstream
        model relay asked for; once per turn (issue 13 item 5).
        """
        if turn.usage is not None:
            return
        model = account.upstreamModel(turn.model) if turn.model else ""
        if turn.hostedCalls and not counts.tools:
            # R109: the calls were reported in the stream's items only.
            counts = evolve(counts, tools=tuple(sorted(turn.hostedCalls.items())))
        if self.prices is not None:
            # Issue 22: the turn's cost, once, by the upstream model.
            counts = self.prices.priced(model, counts)
        turn.usage = counts
        if self.keyPolicy is not None and turn.client.tpm:
            self.keyPolicy.countTokens(turn.client, counts.total)
        if self.usage is None:
            return
        hold = turn.budgetHold
        if hold is not None:
            # R108: the reservation settles to the real figure (one place
            # for every way usage is learnt).
            try:
                self.usage.settle(hold, counts)
                self._keepChain(turn, None)
            except Exception:  # noqa: BLE001 - logged; accounting never breaks a turn
                self._log.failure("settling the budget hold failed",
                                  event="relay.usage_failed", request_id=turn.requestId)
        try:
            self.usage.record(turn.client.name, account.id, model, counts)
        except Exception:  # noqa: BLE001 - logged; accounting never breaks a turn
            self._log.failure(
                "recording usage failed", event="relay.usage_failed", request_id=turn.requestId,
                account_id=account.id,
            )

    def firstOutput(self, turn: Turn) -> None:
        if turn.firstOutputAt is None:
            turn.firstOutputAt = self.clock.seconds()

    def _finished(self, turn, state, outcome, status, accountId, start) -> None:
        if state.trace is not None:
            state.trace.turnEnded(outcome, status, accountId, state)
        owned = self.backgroundOwners.pop(turn, None) if self.backgroundOwners else None
        if owned is not None and turn.usage is None:
            # R107, R88: counted once when it finishes, even if nobody polls.
            watchBackground(self, turn, owned[0], owned[1])
        if turn.request is not None:
            requestFinished(self, turn, state, outcome, status, accountId, start)
            return
        now = self.clock.seconds()
        first = turn.firstOutputAt
        usage = turn.usage
        if self.requestLog is not None:
            try:
                self.requestLog.add(
                    _turnRecord(turn, state, outcome, status, accountId, start, now)
                )
            except Exception:  # noqa: BLE001 - logged; the log never breaks a turn
                self._log.failure("recording turn {request_id} failed",
                                  event="relay.request_log_failed", request_id=turn.requestId)
        self._log.info(
            "turn {request_id} {outcome} with status {status} on {account_id}"
            " after {attempts} attempt(s)",
            event="relay.turn_finished",
            request_id=turn.requestId,
            client_request_id=turn.clientRequestId,
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
            # The token fields (issue 13 item 5; L{_usageFields}, inline: issue 24).
            input_tokens=None if usage is None else usage.input,
            cached_input_tokens=None if usage is None else usage.cached,
            output_tokens=None if usage is None else usage.output,
            reasoning_tokens=None if usage is None else usage.reasoning,
            upstream_request_id=turn.upstreamRequestId,
        )
        if accountId is not None:
            self.bookkeeping.accountStats(accountId)["turns"] += 1
            if first is not None and self.history is not None:
                self.history.firstOutput(accountId, first - start)
        if self.metrics is not None:
            if state.pendingFailover is not None:
                # A switch that found no next account (exhausted, or the
                # client left during the retry interval).
                self.metrics.failoverTo(state.pendingFailover, None)
                state.pendingFailover = None
            self.metrics.turnFinished(turn.entrypoint, outcome)
            if first is not None:
                self.metrics.firstOutput(first - start)


def _usageFields(counts) -> dict:
    """
    The token fields of C{relay.turn_finished} (issue 13 item 5); L{None}
    when the turn reported no usage.
    """
    if counts is None:
        return {"input_tokens": None, "cached_input_tokens": None,
                "output_tokens": None, "reasoning_tokens": None}
    return {"input_tokens": counts.input, "cached_input_tokens": counts.cached,
            "output_tokens": counts.output, "reasoning_tokens": counts.reasoning}


def _turnRecord(turn, state, outcome, status, accountId, start, now) -> TurnRecord:
    """
    Issue 22: the turn's one structured record, from what the engine holds
    at its end (no parsing, no formatting).
    """
    first = turn.firstOutputAt
    usage = turn.usage
    error = getattr(state.sink, "failed", None)
    sample = None
    if isinstance(state.sink, _SamplingSink):
        sample = state.sink.sample(turn.body)
    return TurnRecord(
        time=start,
        request_id=turn.requestId,
        client_request_id=turn.clientRequestId,
        key=turn.client.name,
        entrypoint=turn.entrypoint,
        endpoint=turn.endpoint,
        mode=turn.wsMode,
        stream=turn.stream,
        model=turn.model,
        account=accountId,
        attempts=state.tried,
        outcome=outcome,
        status=status,
        first_output_ms=None if first is None else int((first - start) * 1000),
        duration_ms=int((now - start) * 1000),
        input_tokens=None if usage is None else usage.input,
        cached_tokens=None if usage is None else usage.cached,
        output_tokens=None if usage is None else usage.output,
        reasoning_tokens=None if usage is None else usage.reasoning,
        cost_nanos=None if usage is None or usage.unpriced else usage.cost,
        unpriced=usage is not None and bool(usage.unpriced),
        usage_estimated=usage is not None and bool(usage.estimated),
        error_code=None if error is None else error.code,
        error=None if error is None else error.message,
        client_ip=turn.clientAddress,
        user_agent=turn.userAgent,
        upstream_request_id=turn.upstreamRequestId,
        switches=state.switches,
        waited_ms=int(state.waited * 1000),
        sample=sample,
    )


class _SamplingSink:
    """
    Issue 22's debug sampling (C{request_log.sample_rate}, off by default):
    a sink that forwards everything to the turn's sink and keeps a copy of
    what the client received, up to C{limit} bytes. Only sampled turns pay
    for it.
    """

    def __init__(self, sink, limit: int):
        self._sink = sink
        self._limit = limit
        self._kept: list = []
        self._size = 0
        if hasattr(sink, "writeRaw"):
            self.writeRaw = self._writeRaw

    def __getattr__(self, name):
        return getattr(self._sink, name)

    def _keep(self, data: bytes) -> None:
        if self._size < self._limit:
            part = data[: self._limit - self._size]
            self._kept.append(part)
            self._size += len(part)

    def writeEvent(self, event) -> None:
        self._keep(event.raw or event.data)
        self._sink.writeEvent(event)

    def _writeRaw(self, data: bytes) -> None:
        self._keep(data)
        self._sink.writeRaw(data)

    def writeBody(self, status, headers, body) -> None:
        self._keep(body)
        self._sink.writeBody(status, headers, body)

    def sample(self, body) -> dict:
        """
        @return: C{{"request": <body JSON>, "output": <what the client got>}},
            each cut to the limit.
        """
        import json

        request = json.dumps(body, ensure_ascii=False, default=str)
        return {
            "request": request[: self._limit],
            "output": b"".join(self._kept).decode("utf-8", "replace"),
        }


class _AdmissionFailed(Exception):
    """
    Admission refused; carries the L{ClientError} (R32).
    """

    def __init__(self, error: ClientError):
        super().__init__(error.message)
        self.error = error


def _proxyId(account) -> Optional[str]:
    return account.proxy.id if account.proxy is not None else None
