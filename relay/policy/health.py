# -*- test-case-name: tests.test_health -*-
"""
The stateful side of account marking: it applies a classifier's
L{relay.policy.failures.Verdict} to the state store, and keeps the process-wide
state that the classifier, being pure, cannot: the R4 in-memory block, the
R11 403 counter and transient streak, the R13 OAuth 429 window and the R-B1
transport breaker.

The turn engine calls L{AccountHealth}; every method returns a
L{Deferred}. Times are Unix seconds from the injected clock.
"""

from __future__ import annotations

from typing import Optional

from attrs import define, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from relay.policy.failures import (
    MARK_COUNT_403,
    MARK_DISABLED,
    MARK_MODEL_BLOCK,
    MARK_OVERLOADED,
    MARK_RATE_LIMITED,
    MARK_TEMP_UNSCHEDULABLE,
    MARK_TRANSIENT_STREAK,
    TRANSPORT,
    Marking,
    Verdict,
)
from relay.interfaces import IStateStore
from relay.state.runtime import AccountRuntime
from relay.base.records import Account
from relay.state.settings import RuntimeSettings
from relay.state import counter403Key

#: R4: a state write has this long to finish, seconds.
STATE_WRITE_TIMEOUT_SECONDS = 5.0
#: R11: the 403 counter's fixed window, seconds (180 min).
COUNT_403_WINDOW_SECONDS = 180 * 60
#: R11: 403 count below this -> temporary cooldown; at or above -> disabled.
COUNT_403_DISABLE_AT = 3
#: R11: the temporary 403 cooldown, seconds (10 min).
COOLDOWN_403_SECONDS = 600
#: R11: the transient streak lives this long from the last failure, seconds.
STREAK_TTL_SECONDS = 30 * 60
#: R11: streak length -> block seconds (1st: none, 2nd: 10 s, 3rd+: 45 s).
STREAK_BLOCK_SECONDS = {2: 10.0}
STREAK_BLOCK_LATER_SECONDS = 45.0
#: R11 "bridge block": a disabled account is also blocked in memory, seconds.
DISABLE_BRIDGE_BLOCK_SECONDS = 120.0
#: R13: the OAuth 429 window, seconds from the first 429.
OAUTH_429_WINDOW_SECONDS = 120.0
#: R13: delay cap and default between same-account retries, seconds.
OAUTH_429_MAX_DELAY_SECONDS = 8.0
OAUTH_429_DEFAULT_DELAY_SECONDS = 0.5
#: R13: the fallback runtime cooldown when a 429 carries no reset, seconds.
OAUTH_429_FALLBACK_SECONDS = 5.0

#: Proxy id used for direct (proxy-less) accounts in the R-B1 breaker key.
DIRECT = "direct"


def count403Key(accountId: str) -> str:
    """
    R11: the 403 counter's name (sub2api's Redis key, shared with
    L{relay.state.counter403Key}).
    """
    return counter403Key(accountId)


def streakModel(model: Optional[str]) -> str:
    """
    R11: the model key of a per-(account, model) transient streak; C{*}
    when the model is unknown.
    """
    return model or "*"


@define
class _Breaker:
    """
    R-B1 state for one (account, proxy).

    @ivar failures: consecutive transient failures in the current window.
    @ivar windowStart: Unix seconds of the first failure of the window.
    @ivar opens: how many times the breaker opened since the last success.
    @ivar openUntil: Unix seconds the current open period ends, or 0.
    """

    failures: int = 0
    windowStart: float = 0.0
    opens: int = 0
    openUntil: float = 0.0


def _block(scope: str, model: Optional[str], kind: str, reason: str, until) -> dict:
    """
    One entry of L{AccountHealth.blocks}.
    """
    return {"scope": scope, "model": model, "kind": kind, "reason": reason, "until": until}


@define(eq=False)
class AccountHealth:
    """
    Applies verdicts to account state (R4, R11, R12, R13, R-B1).

    @ivar _store: the L{IStateStore}.
    @ivar _clock: the L{IReactorTime}; C{seconds()} are Unix seconds.
    @ivar _settings: the L{RuntimeSettings}; C{.current} is read on every
        call (R74).
    @ivar _blocks: C{(account id, model or None)} -> C{(until, reason)}:
        in-memory blocks (R4 step 1, the R11 bridge block, failed writes).
    @ivar _breakers: C{(account id, proxy id)} -> L{_Breaker}.
    @ivar _oauth429: account id -> Unix seconds of the window's first 429
        (R13, process-wide).
    """

    _store: IStateStore
    _clock: IReactorTime
    _settings: RuntimeSettings
    _blocks: dict = field(factory=dict, init=False)
    _breakers: dict = field(factory=dict, init=False)
    _oauth429: dict = field(factory=dict, init=False)

    _log = Logger()

    # -- local blocks -----------------------------------------------------------

    def _block(
        self, accountId: str, until: float, reason: str, model: Optional[str] = None
    ) -> None:
        """
        Block an account (or an account+model) in memory until C{until},
        keeping the later of an existing block and the new one.
        """
        key = (accountId, model)
        current = self._blocks.get(key)
        if current is None or current[0] < until:
            self._blocks[key] = (until, reason)

    def clear(self, accountId: str, cause: str = "operator") -> Deferred:
        """
        Lift every block of an account: the store's states, the in-memory
        blocks, the breaker and the OAuth-429 window (admin "clear"),
        logged once as C{relay.account_cleared}.

        @param cause: why, in that line: C{operator} (C{POST
            /admin/accounts/{id}/clear}), C{new_tokens} (C{PUT
            /admin/accounts/{id}/tokens}) or C{reload} (a reload renewed the
            account's credential, endpoint or proxy).
        @return: Deferred firing once the store is cleared.
        """
        for key in [k for k in self._blocks if k[0] == accountId]:
            del self._blocks[key]
        for key in [k for k in self._breakers if k[0] == accountId]:
            del self._breakers[key]
        self._oauth429.pop(accountId, None)
        self._log.info(
            "account {account_id} cleared ({cause})",
            event="relay.account_cleared",
            account_id=accountId,
            cause=cause,
        )
        return self._store.clearAccount(accountId)

    def breakerState(self, accountId: str) -> Optional[dict]:
        """
        The R-B1 breaker of an account for the admin view.

        @return: C{{"failures", "threshold", "window_seconds",
            "window_resets_at", "opens", "open_until", "state"}} over its
            proxies: C{failures} what the breaker counts now (0 once the
            window that began with the first failure has passed, as the next
            failure would start counting again), summed; C{window_resets_at}
            when the oldest counting window ends (or L{None});
            C{open_until} the latest open period's end in Unix seconds, or
            L{None} when none is in force; C{state} C{open}, C{counting} or
            C{closed}. L{None} when the account has no breaker state.
        """
        found = [b for k, b in self._breakers.items() if k[0] == accountId]
        if not found:
            return None
        now = self._clock.seconds()
        settings = self._settings.current.breaker
        window = float(settings.window_seconds)
        counting = [b for b in found if b.failures and now - b.windowStart <= window]
        ends = [b.openUntil for b in found if b.openUntil > now]
        failures = sum(b.failures for b in counting)
        return {
            "failures": failures,
            "threshold": settings.failures,
            "window_seconds": window,
            "window_resets_at": min(b.windowStart for b in counting) + window
            if counting else None,
            "opens": sum(b.opens for b in found),
            "open_until": max(ends) if ends else None,
            "state": "open" if ends else ("counting" if failures else "closed"),
        }

    def blocks(self, account: Account, runtime: AccountRuntime, now: float) -> list:
        """
        Every block of an account in force at C{now}, as selection honours
        them: the stored states (L{AccountRuntime.unschedulable}) and the
        in-memory blocks (R4 step 1, R-B1, the R11 bridge block, failed
        writes) that the scheduler's C{extraBlock} hook reads.

        @param account: the L{Account}.
        @param runtime: its stored L{AccountRuntime}.
        @param now: Unix seconds.
        @return: a list of C{{"scope": "account" | "model", "model": str or
            None, "kind": str, "reason": str, "until": Unix seconds or None
            (permanent)}}, account-wide blocks first.
        """
        out = []
        if runtime.disabled:
            out.append(_block("account", None, MARK_DISABLED, runtime.disabledReason, None))
        if runtime.blockedUntil > now:
            out.append(
                _block("account", None, MARK_TEMP_UNSCHEDULABLE, runtime.blockReason,
                       runtime.blockedUntil)
            )
        if runtime.rateLimitedUntil > now:
            out.append(
                _block("account", None, MARK_RATE_LIMITED, "rate limited", runtime.rateLimitedUntil)
            )
        if runtime.overloadedUntil > now:
            out.append(
                _block("account", None, MARK_OVERLOADED, "overloaded", runtime.overloadedUntil)
            )
        stored = {(b["model"], b["until"]) for b in out}
        for (accountId, model), (until, reason) in sorted(
            self._blocks.items(), key=lambda kv: (kv[0][1] or "", kv[1][0])
        ):
            if accountId != account.id or until <= now or (model, until) in stored:
                continue
            kind = "breaker" if reason.startswith("transport circuit open") else "memory"
            out.append(_block("model" if model else "account", model, kind, reason, until))
        for model, until in sorted(runtime.modelBlocks.items()):
            if until > now:
                out.append(
                    _block("model", model, MARK_MODEL_BLOCK,
                           runtime.modelReasons.get(model, ""), until)
                )
        return out

    def streaks(self, runtime: AccountRuntime, now: float) -> dict:
        """
        The live R11 transient streaks of an account.

        @return: upstream model (C{*} when unknown) -> consecutive failures.
        """
        return {
            model: count
            for model, (count, last) in sorted(runtime.streaks.items())
            if now - last <= STREAK_TTL_SECONDS
        }

    def flagged(self, now: float) -> list:
        """
        The accounts with an in-memory block (R4 step 1, R-B1,
        the R11 bridge block) in force at C{now}: those L{localBlock} may
        answer for; blocks that have ended are dropped.

        @param now: Unix seconds.
        @return: account ids (possibly repeated).
        """
        blocks = self._blocks
        if not blocks:
            return []
        over = [key for key, (until, _) in blocks.items() if until <= now]
        for key in over:
            del blocks[key]
        return [key[0] for key in blocks]

    def localBlock(self, accountId: str, model: Optional[str] = None) -> Optional[tuple]:
        """
        The in-memory block of an account, if one is in force.

        @param accountId: the account id.
        @param model: the upstream model, or L{None}.
        @return: C{(reason, until)} or L{None}.
        """
        if not self._blocks:
            return None
        now = self._clock.seconds()
        best = None
        for key in (
            ((accountId, None), (accountId, model)) if model is not None else ((accountId, None),)
        ):
            entry = self._blocks.get(key)
            if entry is None:
                continue
            if entry[0] <= now:
                del self._blocks[key]
                continue
            if best is None or entry[0] > best[1]:
                best = (entry[1], entry[0])
        return best

    def unschedulable(
        self, runtime: AccountRuntime, account: Account, model: Optional[str], now: float
    ) -> Optional[tuple]:
        """
        Why the account cannot be scheduled now: the stored runtime state
        merged with the in-memory blocks (R4 step 1, R11 "blocked in memory").

        @param runtime: the stored L{AccountRuntime}.
        @param account: the L{Account}.
        @param model: the upstream model of the request, or L{None}.
        @param now: Unix seconds.
        @return: L{None} when schedulable, else C{(reason, until)}; C{until}
            is 0 for a permanent state.
        """
        stored = runtime.unschedulable(now, model)
        if stored is not None and stored[1] == 0:
            return stored
        local = None
        for key in (
            ((account.id, None), (account.id, model))
            if model is not None
            else ((account.id, None),)
        ):
            entry = self._blocks.get(key)
            if entry is not None and entry[0] > now and (local is None or entry[0] > local[1]):
                local = (entry[1], entry[0])
        if stored is None:
            return local
        if local is None:
            return stored
        return local if local[1] > stored[1] else stored

    # -- writes -----------------------------------------------------------------

    async def _write(
        self,
        account: Account,
        kind: str,
        until: float,
        reason: str,
        model: Optional[str] = None,
        transport: bool = False,
    ) -> bool:
        """
        Write one state with the R4 5-second timeout; on failure keep an
        in-memory block and log.

        @return: L{True} when the store accepted it.
        """
        # A disabled marking (until 0) has no end: an operator clears it.
        ends = "until {until}" if until else "until cleared"
        try:
            d = self._store.markAccount(account.id, kind, until, reason, model)
            d.addTimeout(STATE_WRITE_TIMEOUT_SECONDS, self._clock)
            await d
        except Exception as e:
            blockUntil = (
                until
                if kind != MARK_DISABLED
                else self._clock.seconds() + DISABLE_BRIDGE_BLOCK_SECONDS
            )
            self._block(account.id, blockUntil, reason, model if kind == MARK_MODEL_BLOCK else None)
            self._log.warn(
                "account {account_id}: writing {kind} " + ends + " failed ({error});"
                " blocked in memory",
                event="openai.account_temp_unscheduled_transport_failed"
                if transport
                else "relay.account_state_write_failed",
                account_id=account.id,
                kind=kind,
                until=until,
                reason=reason,
                error=repr(e),
            )
            return False
        if transport:
            self._log.warn(
                "account {account_id} temp-unschedulable " + ends + ": {reason}",
                event="openai.account_temp_unscheduled_transport",
                account_id=account.id,
                until=until,
                reason=reason,
            )
        else:
            self._log.warn(
                "account {account_id} marked {kind} " + ends + ": {reason}",
                event="relay.account_cooldown_set",
                account_id=account.id,
                kind=kind,
                until=until,
                reason=reason,
                model=model,
            )
        return True

    def _until(self, marking: Marking) -> float:
        """
        A marking's absolute end: C{until} wins over C{seconds} (Marking's
        contract); neither means now.
        """
        if marking.until is not None:
            return float(marking.until)
        return self._clock.seconds() + float(marking.seconds or 0)

    # -- applyVerdict -----------------------------------------------------------

    def applyVerdict(
        self, account: Account, verdict: Verdict, model: Optional[str] = None
    ) -> Deferred:
        """
        Apply each of the verdict's markings (R4, R11, R12).

        @param account: the L{Account} that failed.
        @param verdict: the L{Verdict}.
        @param model: the upstream model of the attempt, for model-scoped
            marks, or L{None}.
        @return: a L{Deferred} firing with a tuple of C{(kind, until)} for
            every state written or blocked (C{until} 0 for C{disabled}).
        """
        return Deferred.fromCoroutine(self._applyVerdict(account, verdict, model))

    async def _applyVerdict(
        self, account: Account, verdict: Verdict, model: Optional[str]
    ) -> tuple:
        applied = []
        for marking in verdict.markings:
            applied.extend(await self._applyMarking(account, verdict, marking, model))
        return tuple(applied)

    async def _applyMarking(
        self, account: Account, verdict: Verdict, marking: Marking, model: Optional[str]
    ) -> list:
        """
        Apply one L{Marking}.

        @return: a list of C{(kind, until)}.
        """
        kind = marking.kind
        if kind == MARK_TEMP_UNSCHEDULABLE and verdict.kind == TRANSPORT and verdict.persistent:
            # R4: block in memory at once, then persist with a 5 s timeout.
            until = self._until(marking)
            self._block(account.id, until, "transport_error")
            await self._write(account, kind, until, marking.reason, transport=True)
            return [(kind, until)]
        if kind in (MARK_TEMP_UNSCHEDULABLE, MARK_OVERLOADED):
            until = self._until(marking)
            await self._write(account, kind, until, marking.reason)
            return [(kind, until)]
        if kind == MARK_RATE_LIMITED:
            # R12/R13: block in memory until the reset, then persist.
            until = self._until(marking)
            self._block(account.id, until, "rate_limited")
            await self._write(account, kind, until, marking.reason)
            return [(kind, until)]
        if kind == MARK_DISABLED:
            return await self._disable(account, marking.reason)
        if kind == MARK_MODEL_BLOCK:
            target = marking.model or model
            until = self._until(marking)
            if target is None:
                # R106: a model refusal blocks a model, never the account; a
                # turn that named no model has nothing to block.
                return []
            await self._write(account, kind, until, marking.reason, model=target)
            return [(kind, until)]
        if kind == MARK_COUNT_403:
            return await self._count403(account, marking.reason)
        if kind == MARK_TRANSIENT_STREAK:
            return await self._streak(account, marking.model or model, marking.reason)
        self._log.error(
            "unknown marking kind {kind} for account {account_id}",
            event="relay.account_marking_unknown",
            account_id=account.id,
            kind=kind,
        )
        return []

    async def _disable(self, account: Account, reason: str) -> list:
        """
        R11: a permanent error state, plus the 2-minute in-memory bridge
        block.
        """
        self._block(
            account.id, self._clock.seconds() + DISABLE_BRIDGE_BLOCK_SECONDS, "disabled: " + reason
        )
        await self._write(account, MARK_DISABLED, 0, reason)
        return [(MARK_DISABLED, 0)]

    async def _count403(self, account: Account, reason: str) -> list:
        """
        R11 403 row: a counter with a fixed 180-minute window; below 3 a
        10-minute cooldown, at 3 a permanent error.
        """
        try:
            n = await self._store.incrementCounter(
                count403Key(account.id), COUNT_403_WINDOW_SECONDS, False
            )
        except Exception as e:
            self._log.warn(
                "account {account_id}: the 403 counter failed ({error}); cooling down",
                event="relay.account_state_write_failed",
                account_id=account.id,
                error=repr(e),
            )
            n = 1
        if n >= COUNT_403_DISABLE_AT:
            return await self._disable(
                account, f"OpenAI 403 ({n}/{COUNT_403_DISABLE_AT}): {reason}"
            )
        until = self._clock.seconds() + COOLDOWN_403_SECONDS
        await self._write(
            account,
            MARK_TEMP_UNSCHEDULABLE,
            until,
            f"OpenAI 403 temporary cooldown ({n}/{COUNT_403_DISABLE_AT}): {reason}",
        )
        return [(MARK_TEMP_UNSCHEDULABLE, until)]

    async def _streak(self, account: Account, model: Optional[str], reason: str) -> list:
        """
        R11 API-key transient streak per (account, model): 1st nothing, 2nd
        10 s, 3rd and later 45 s; the streak lives 30 min from the last
        failure.
        """
        try:
            n = await self._store.bumpStreak(
                account.id, streakModel(model), STREAK_TTL_SECONDS
            )
        except Exception as e:
            self._log.warn(
                "account {account_id}: the transient streak counter failed ({error})",
                event="relay.account_state_write_failed",
                account_id=account.id,
                error=repr(e),
            )
            return []
        seconds = STREAK_BLOCK_SECONDS.get(n, STREAK_BLOCK_LATER_SECONDS if n > 2 else 0)
        self._log.info(
            "account {account_id} model {model}: transient streak {streak}, block {seconds} s",
            event="openai_model_transient_state",
            account_id=account.id,
            model=model,
            streak=n,
            seconds=seconds,
        )
        if not seconds:
            return []
        until = self._clock.seconds() + seconds
        text = f"transient upstream errors ({n} in a row): {reason}"
        if model is None:
            await self._write(account, MARK_TEMP_UNSCHEDULABLE, until, text)
            return [(MARK_TEMP_UNSCHEDULABLE, until)]
        await self._write(account, MARK_MODEL_BLOCK, until, text, model=model)
        return [(MARK_MODEL_BLOCK, until)]

    # -- R-B1 -------------------------------------------------------------------

    def transientTransportFailure(
        self, account: Account, proxyId: Optional[str] = None
    ) -> Deferred:
        """
        R-B1: count a consecutive transient transport failure on (account,
        proxy); at C{breaker.failures} within C{breaker.window_seconds}, mark
        the account temp-unschedulable for C{breaker.open_seconds}, doubled
        on each repeat up to C{breaker.max_open_seconds}.

        @param account: the L{Account}.
        @param proxyId: the proxy id; L{None} means the account's own proxy,
            or direct.
        @return: a L{Deferred} firing with the open period's end (Unix
            seconds) when the breaker opened, else L{None}.
        """
        return Deferred.fromCoroutine(self._transientTransportFailure(account, proxyId))

    async def _transientTransportFailure(
        self, account: Account, proxyId: Optional[str]
    ) -> Optional[float]:
        settings = self._settings.current.breaker
        if not settings.enabled:
            return None
        if proxyId is None:
            proxyId = account.proxy.id if account.proxy is not None else DIRECT
        now = self._clock.seconds()
        state = self._breakers.setdefault((account.id, proxyId), _Breaker())
        if state.failures == 0 or now - state.windowStart > settings.window_seconds:
            state.failures = 0
            state.windowStart = now
        state.failures += 1
        if state.failures < settings.failures:
            return None
        failures = state.failures
        seconds = min(settings.open_seconds * (2**state.opens), settings.max_open_seconds)
        state.opens += 1
        state.failures = 0
        until = now + seconds
        state.openUntil = until
        reason = f"transport circuit open: {failures} consecutive transient failures via {proxyId}"
        self._block(account.id, until, reason)
        self._log.warn(
            "account {account_id} via {proxy_id}: circuit open after {failures} failures"
            " until {until}",
            event="openai.account_transport_circuit_open",
            account_id=account.id,
            proxy_id=proxyId,
            failures=failures,
            until=until,
        )
        await self._write(account, MARK_TEMP_UNSCHEDULABLE, until, reason)
        return until

    # -- success ----------------------------------------------------------------

    def success(self, account: Account, model: Optional[str] = None) -> Deferred:
        """
        A successful attempt: reset the R-B1 breaker of every proxy of the
        account, the R11 transient streak of (account, model) and the R13
        OAuth 429 window.

        @return: a L{Deferred} firing with L{None} (fired: nothing here
            waits; no coroutine per relayed turn).
        """
        try:
            self._success(account, model)
        except BaseException:  # noqa: BLE001 - delivered as the Deferred's failure (as eagerDeferred did)
            return fail()
        return succeed(None)

    def _success(self, account: Account, model: Optional[str]) -> None:
        if self._breakers:
            for key in [k for k in self._breakers if k[0] == account.id]:
                state = self._breakers.pop(key)
                if state.failures or state.opens:
                    self._log.info(
                        "account {account_id} via {proxy_id}: circuit closed",
                        event="openai.account_transport_circuit_closed",
                        account_id=account.id,
                        proxy_id=key[1],
                    )
        if self._oauth429:
            self._oauth429.pop(account.id, None)
        if account.type != "oauth":
            # Not waited for: on Redis it leaves with the turn's
            # other end-of-turn writes (owner records, slot releases).
            try:
                d = self._store.resetStreak(account.id, streakModel(model))
            except Exception:  # noqa: BLE001 - logged by the errback below
                d = fail()
            if d.called and d.result is None:
                return  # done at once (the memory store's): no errback to add

            def _eb(f, accountId=account.id):
                self._log.warn(
                    "account {account_id}: resetting the transient streak failed ({error})",
                    event="relay.account_state_write_failed",
                    account_id=accountId,
                    error=repr(f.value),
                )

            d.addErrback(_eb)

    # -- R13 --------------------------------------------------------------------

    def oauth429Decision(self, account: Account, verdict: Verdict) -> Deferred:
        """
        R13: an OAuth 429. Inside the 2-minute window from the account's
        first 429, retry the same account after C{verdict.retryDelay}
        (Retry-After capped at 8 s, else 0.5 s), never past the window's
        end, and mark nothing. After the window, block the account in
        memory and persist the rate-limited state until
        C{verdict.rateLimitUntil} (or now + 5 s), and clear the window.

        @return: a L{Deferred} firing with C{("retry_same", delay seconds)}
            or C{("mark", None)}.
        """
        return Deferred.fromCoroutine(self._oauth429Decision(account, verdict))

    async def _oauth429Decision(self, account: Account, verdict: Verdict) -> tuple:
        now = self._clock.seconds()
        start = self._oauth429.setdefault(account.id, now)
        end = start + OAUTH_429_WINDOW_SECONDS
        if now < end:
            delay = (
                verdict.retryDelay
                if verdict.retryDelay is not None
                else OAUTH_429_DEFAULT_DELAY_SECONDS
            )
            delay = min(delay, OAUTH_429_MAX_DELAY_SECONDS, end - now)
            return ("retry_same", delay)
        del self._oauth429[account.id]
        until = verdict.rateLimitUntil
        if until is None or until <= now:
            until = now + OAUTH_429_FALLBACK_SECONDS
        self._block(account.id, until, "rate_limited")
        await self._write(
            account,
            MARK_RATE_LIMITED,
            until,
            "429 after the OAuth retry window: " + verdict.message,
        )
        return ("mark", None)
