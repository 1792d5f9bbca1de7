# -*- test-case-name: tests.integration.test_operator -*-
"""
Glue between the running relay and its operator surface: the
accounts view for C{/admin/accounts}, the admin "clear", the settings
store, the Prometheus slot gauges, and the periodic jobs that keep them
fresh.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

from attrs import define, field
from twisted.application.internet import TimerService
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import Logger

from relay.wire.redisclient import logFailure


@define(eq=False)
class OperatorView:
    """
    Reads account state for operators.

    @ivar accounts: the configured accounts (the scheduler's list).
    @ivar store: the L{relay.interfaces.IStateStore}.
    @ivar admission: the L{relay.interfaces.ISlotAdmission}.
    @ivar health: the L{relay.policy.health.AccountHealth}.
    @ivar runner: the L{relay.engine.runner.TurnRunner} (per-account stats).
    @ivar proxyHealth: the L{relay.policy.proxyhealth.ProxyHealth}, or L{None}.
    @ivar clock: the L{IReactorTime}.
    @ivar slots: the last C{{account id: (in use, waiting)}} read, served
        synchronously to the Prometheus collector.
    @ivar credentials: the L{relay.interfaces.ICredentialSource} (token
        state, refresh, new tokens), or L{None}.
    @ivar quota: the L{relay.scheduling.quota.UsageWindows}, or L{None}.
    @ivar control: the L{relay.control.plane.ControlPlane} (pauses and
        where each account comes from), or L{None}.
    """

    accounts: list
    store: object
    admission: object
    health: object
    runner: object
    clock: object
    proxyHealth: object = None
    credentials: object = None
    quota: object = None
    control: object = None
    resets: object = None
    """The L{relay.oauth.resets.BankedResets} (each login's banked resets,
    protocol.md 7.3a), set with the control plane; or L{None}."""
    slots: dict = field(factory=dict)
    _log = Logger()

    def accountsView(self) -> Deferred:
        """
        @return: Deferred firing with one dict per account (keys as
            L{relay.console.admin.buildAdminResource} documents; times in Unix
            seconds).
        """
        return Deferred.fromCoroutine(self._view())

    async def _view(self) -> list:
        ids = [a.id for a in self.accounts]
        states = await self.store.getAccountStates(ids)
        loads = await self.admission.load("account", ids)
        self.slots = dict(loads)
        now = self.clock.seconds()
        proxies = self.proxyHealth.snapshot() if self.proxyHealth is not None else {}
        rows = []
        for account in self.accounts:
            runtime = states[account.id]
            inUse, waiting = loads.get(account.id, (0, 0))
            stats = self.runner.accountStats.get(account.id, {})
            proxyId = account.proxy.id if account.proxy is not None else None
            proxy = proxies.get(proxyId) if proxyId else None
            blocks = [_timed(b, now) for b in self.health.blocks(account, runtime, now)]
            if proxy is not None and proxy.get("state") == "quarantined":
                blocks.append(
                    _timed(
                        {"scope": "proxy", "model": None, "kind": "proxy_quarantine",
                         "reason": f"proxy {proxyId} quarantined after stream cuts",
                         "until": proxy.get("until")},
                        now,
                    )
                )
            tokenBlock = (
                self.credentials.blockReason(account, now) if self.credentials is not None
                else None
            )
            if tokenBlock is not None:
                # needs_login (or an expired token) keeps it out.
                blocks.insert(0, _timed(
                    {"scope": "account", "model": None, "kind": "token",
                     "reason": tokenBlock[0], "until": tokenBlock[1] or None},
                    now,
                ))
            if self.control is not None:
                # A paused account's block comes first.
                blocks[0:0] = [_timed(b, now) for b in self.control.blocksOf(account, now)]
            first = blocks[0] if blocks else None
            # A model-wide block leaves the account serving other models:
            # its health state is then the attempts'.
            health = self._health(account.id, next(
                (b for b in blocks if b["scope"] != "model"), None))
            rows.append(
                {
                    "id": account.id,
                    "type": account.type,
                    "priority": account.priority,
                    "concurrency": account.concurrency,
                    "in_use": inUse,
                    "waiting": waiting,
                    "schedulable": first is None,
                    "reason": _reasonText(first) if first else None,
                    "until": first["until"] if first else None,
                    "blocks": blocks,
                    "blocked_models": {
                        b["model"]: {k: b[k] for k in ("reason", "until", "until_iso",
                                                        "seconds_left")}
                        for b in blocks if b["scope"] == "model"
                    },
                    "streaks": self.health.streaks(runtime, now),
                    "rate_limited_until": runtime.rateLimitedUntil or None,
                    "breaker": self.health.breakerState(account.id),
                    "disabled": runtime.disabled,
                    "last_error": stats.get("last_error"),
                    "last_error_at": stats.get("last_error_at"),
                    "last_success_at": stats.get("last_success_at"),
                    "turns": stats.get("turns", 0),
                    "failovers": stats.get("failovers", 0),
                    "proxy_id": proxyId,
                    "proxy_state": proxy,
                    "usage": self.quota.view(account.id) if self.quota is not None else None,
                    "banked_resets": self.resets.available.get(account.id)
                    if self.resets is not None and account.type == "oauth" else None,
                    "health": health,
                }
            )
            if self.credentials is not None:
                rows[-1].update(_tokenView(self.credentials.view(account)))
            if self.control is not None:
                rows[-1].update(self.control.viewOf(account))
        return rows

    def _health(self, accountId: str, block: Optional[dict]) -> Optional[dict]:
        """
        @return: the account's health over the last 15 minutes
            (L{relay.policy.outcomes.healthState}), or L{None} without a
            record of attempt ends.
        """
        from relay.policy.outcomes import healthState

        outcomes = getattr(getattr(self.runner, "bookkeeping", None), "outcomes", None)
        if outcomes is None:
            return None
        return healthState(outcomes.counts(accountId), block)

    def _oauthAccount(self, accountId: str):
        for account in self.accounts:
            if account.id == accountId:
                if account.type != "oauth" or self.credentials is None:
                    raise ValueError(f"account {accountId!r} is not an OAuth account")
                return account
        raise KeyError(accountId)

    def refreshAccount(self, accountId: str, options: dict) -> Deferred:
        """
        Force a token refresh (C{POST /admin/accounts/{id}/refresh}).
        C{options} may hold C{retry_in_doubt: true} to send a refresh
        token that is in doubt (the operator's explicit choice).

        @return: a Deferred firing with C{(refreshed, token view, why)}:
            C{why} is L{None} after a refresh, else L{refreshNotDone}'s
            C{{"reason", "hint"}}.
        @raise KeyError: unknown account. @raise ValueError: not OAuth.
        """
        account = self._oauthAccount(accountId)
        retry = bool(options.get("retry_in_doubt"))
        d = self.credentials.refresh(account, reason="admin", force=True, retryInDoubt=retry)

        def _cbAnswer(ok):
            view = _tokenView(self.credentials.view(account))
            return ok, view, None if ok else refreshNotDone(accountId, view, retry)

        return d.addCallback(_cbAnswer)

    def setTokens(self, accountId: str, body: dict) -> Deferred:
        """
        New tokens for an account (C{PUT /admin/accounts/{id}/tokens}):
        C{refresh_token}, C{access_token}, C{id_token}, or a Codex
        C{auth.json} document; clears C{needs_login} and the account's
        runtime states without a restart.

        @return: a Deferred firing with the token view.
        @raise KeyError: unknown account. @raise ValueError: not OAuth, or
            no usable token in C{body}.
        """
        from relay.oauth.authfile import AuthFileError, parseAuth

        self._oauthAccount(accountId)
        try:
            auth = parseAuth(body)
        except AuthFileError as e:
            raise ValueError(str(e))
        d = self.credentials.setTokens(
            accountId, auth.access_token, auth.refresh_token, auth.id_token
        )
        d.addCallback(_tokenView)

        def _cbClear(view):
            return self.health.clear(accountId, "new_tokens").addCallback(lambda _: view)

        return d.addCallback(_cbClear)

    def clearAccount(self, accountId: str) -> Deferred:
        """
        Lift an account's cooldowns (C{POST /admin/accounts/{id}/clear}).

        @raise KeyError: for an unknown account id.
        """
        account = next((a for a in self.accounts if a.id == accountId), None)
        if account is None:
            raise KeyError(accountId)
        return self.runner.bookkeeping.clear(account)

    def refreshSlots(self) -> Deferred:
        """
        Re-read slot usage for the Prometheus gauges (a periodic job; errors
        are logged, never raised: style.md trap T26).
        """
        ids = [a.id for a in self.accounts]
        busy = getattr(self.admission, "busy", None)
        if busy is None:
            d = self.admission.load("account", ids)
        else:
            # The busy read (the same counts; every other account
            # is idle) -- in Redis one argument for the pool, not 3 keys per
            # account for relay to encode every 5 s.
            d = maybeDeferred(busy, "account", frozenset(ids), fresh=True)
            d.addCallback(lambda loads: {i: loads.get(i, (0, 0)) for i in ids})
        d.addCallback(lambda loads: self.slots.update(loads))
        d.addErrback(lambda f: logFailure(self._log, f, "refreshing slot gauges failed"))
        return d


def refreshNotDone(accountId: str, view: dict, retriedInDoubt: bool) -> dict:
    """
    Why a forced refresh did not happen and what the operator can do, from
    the account's token view afterwards (C{POST
    /admin/accounts/{id}/refresh}).

    @param view: L{relay.interfaces.ICredentialSource.view} of the account.
    @param retriedInDoubt: whether C{retry_in_doubt} was asked for.
    @return: C{{"reason": machine reason, "hint": one sentence}}.
    """
    status, reason = view.get("token_status"), view.get("token_reason")
    error = view.get("refresh_last_error")
    tokens = f"PUT /admin/accounts/{accountId}/tokens with new tokens"
    if view.get("token_unpersisted"):
        return {"reason": "tokens_unpersisted",
                "hint": "new tokens are waiting to be written to the token store; relay retries"
                        " the write, try again once it is reachable"}
    if status == "in_doubt" or reason == "refresh_in_doubt":
        if retriedInDoubt:
            return {"reason": "refresh_in_doubt",
                    "hint": "the retried token request got no answer either"
                            + (f" ({error})" if error else "") + f"; {tokens}"}
        return {"reason": "refresh_in_doubt",
                "hint": "the refresh token is in doubt (an earlier token request may have"
                        " reached the server unanswered) and is not sent without consent: POST"
                        ' again with {"retry_in_doubt": true} to send it anyway (the server'
                        f" may count it as reuse), or {tokens}"}
    if status == "needs_login":
        return {"reason": "needs_login",
                "hint": f"the account needs a new login ({reason or 'login required'}): {tokens}"}
    if not view.get("token_refreshable"):
        return {"reason": "no_refresh_token", "hint": f"no refresh token to send: {tokens}"}
    if error:
        when = isoTime(view.get("refresh_next_attempt"))
        return {"reason": "refresh_failed",
                "hint": f"the token request failed ({error})"
                        + (f"; relay tries again at {when}" if when else "")}
    return {"reason": "not_refreshed",
            "hint": "another refresh or the refresh lock was busy; see the"
                    " relay.oauth_refresh_* log lines"}


def isoTime(seconds: Optional[float]) -> Optional[str]:
    """
    Unix seconds as ISO-8601 UTC (C{2026-11-30T22:10:14Z}), or L{None}.
    """
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tokenView(view: dict) -> dict:
    """
    An account's token view with C{token_expires_at_iso} beside
    C{token_expires_at} (as blocks have C{until_iso}), for OAuth accounts.
    """
    if "token_expires_at" not in view:
        return view
    return {**view, "token_expires_at_iso": isoTime(view["token_expires_at"])}


def _timed(block: dict, now: float) -> dict:
    """
    A block with its end as ISO-8601 UTC and whole seconds left (L{None}
    for a permanent one).
    """
    until = block.get("until")
    return {
        **block,
        "until_iso": isoTime(until),
        "seconds_left": None if until is None else max(0, int(until - now + 0.999)),
    }


def _reasonText(block: dict) -> str:
    """
    One line for a block: its kind, its model when model-scoped, and why.
    """
    head = block["kind"] if block["scope"] != "model" else f"{block['kind']} {block['model']}"
    return f"{head}: {block['reason']}" if block.get("reason") else head


class RedisGetSet:
    """
    C{get}/C{set} over a L{relay.wire.redisclient.RedisService}, for
    L{relay.state.settingsdb.RedisSettingsStore}.
    """

    def __init__(self, service, timeout: float = 2.0):
        self._service = service
        self._timeout = timeout

    def get(self, key: str) -> Deferred:
        return self._service.execute(self._timeout, "get", key)

    def set(self, key: str, value: str) -> Deferred:
        return self._service.execute(self._timeout, "set", key, value)


def periodic(interval: float, job, clock) -> TimerService:
    """
    A L{TimerService} on C{clock} whose job never stops it on an error
    (style.md trap T26).
    """
    log = Logger()

    def _safe():
        try:
            d = job()
        except Exception:
            log.failure("periodic job {job} failed", job=getattr(job, "__name__", job))
            return None
        if isinstance(d, Deferred):
            d.addErrback(lambda f: logFailure(log, f, "periodic job failed"))
        return None

    service = TimerService(interval, _safe)
    service.clock = clock
    return service


def settingsStore(config, reactor, redisService=None) -> Optional[object]:
    """
    The settings store (R74): SQLite at C{database} with the memory
    backend, Redis with the Redis backend (so every process agrees).
    """
    from relay.state.settingsdb import RedisSettingsStore, SQLiteSettingsStore

    if config.state.backend == "redis" and redisService is not None:
        return RedisSettingsStore(redis=RedisGetSet(redisService), clock=reactor)
    if config.database:
        return SQLiteSettingsStore(path=config.database, reactor=reactor)
    return None
