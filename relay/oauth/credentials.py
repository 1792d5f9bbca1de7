# -*- test-case-name: tests.test_oauth -*-
"""
L{OAuthCredentials}: the L{relay.interfaces.ICredentialSource} for every
account (protocol.md 7.4, behaviour.md R11).

API-key accounts and OAuth accounts whose tokens relay does not manage are
dialled as configured. For every OAuth account relay keeps a
L{relay.oauth.tokens.TokenRecord} in memory and in the L{ITokenStore}:

  - B{Start-up.} The stored record wins over the configuration while it
    descends from the same configured tokens (same seed fingerprint) or
    the configured refresh token is one the record knows (its current one
    or one it retired: the configuration is an older copy of the lineage,
    e.g. a peer process configured with the same login but another access
    token); a configuration holding other tokens (a new login) starts a
    new lineage, which keeps the replaced lineage's refresh tokens as
    retired (behaviour.md R96: a spent refresh token never wins again).
  - B{A store that went back.} When the store holds a record older than
    this process's (a write lost at a Redis failover: replication is
    asynchronous; a flushed and re-seeded store), i.e. a refresh token
    this process knows as retired, or a lower version of the same tokens,
    relay writes its newer record back (compare-and-set) instead of
    adopting the old one, re-reads after every Sentinel promotion, and
    never sends a refresh token it knows as retired (behaviour.md R96).
  - B{Proactive refresh} at the access token's C{exp} minus
    C{gateway.oauth.refresh_margin_seconds} (at most half its lifetime),
    less a random jitter, on the injected clock.
  - B{Before a dial} (L{ready}) an expired, missing or invalidated access
    token is refreshed first; B{after an upstream 401} the engine asks for
    one refresh and replays the turn once (L{refresh} with the token that
    failed: when another caller already replaced it nothing is sent).
  - B{Single flight.} One refresh per account at a time in the process
    (callers share its outcome) and across processes through the store's
    lock (C{SET NX PX} on Redis, a row with an expiry in SQLite), renewed
    while the request runs. A caller that waits for another holder's lock
    re-reads the store once it gets the lock and uses the newer tokens
    without sending anything.
  - B{Persistence first.} Before the token request is sent an in-flight
    marker is written; the new tokens are written (compare-and-set) before
    the new access token is used. If that write fails, the tokens wait in
    memory (never used, never lost while the process lives) and the write
    is retried.
  - B{In doubt.} A token request that may have reached the server but
    produced no answer (a timeout after the connection was up; a process
    killed while the marker was set) leaves the refresh token in doubt:
    the server may have rotated it, and sending it again would be reuse
    (which also counts against the account). relay then never sends it by
    itself: the account keeps serving while its access token is valid and
    then shows C{needs_login} (reason C{refresh_in_doubt}); an operator may
    retry it explicitly (C{POST /admin/accounts/{id}/refresh} with
    C{{"retry_in_doubt": true}}) or give new tokens.
  - B{Failures.} C{refresh_token_expired}, C{refresh_token_reused},
    C{refresh_token_invalidated}, C{invalid_grant} (and any 401) put the
    account in C{needs_login}: never scheduled, shown with the reason,
    cleared by new tokens (C{PUT /admin/accounts/{id}/tokens}). Transient
    failures (5xx, 429, network errors before the request was sent) keep
    the current access token while it is valid and retry with exponential
    backoff (5 s doubling to 10 min, +-20 % jitter), at the time the log
    line announces, even before the proactive refresh time.
"""

from __future__ import annotations

import math
import os
import random
from typing import Any, Callable, Optional

from attrs import define, evolve, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from relay.base.logs import registerSecrets
from relay.base.records import Account
from relay.interfaces import ICredentialSource, ITokenEndpoint, ITokenStore
from relay.oauth.endpoint import describeError
from relay.oauth.records import IN_DOUBT_REASON, LOCK_TTL_SECONDS, TokenRecords
from relay.oauth.refresher import EXPIRY_SKEW_SECONDS, TokenRefresher
from relay.oauth.slot import _CHANGES, _Slot
from relay.oauth.tokens import (
    STATUS_IN_DOUBT,
    STATUS_LOADING,
    STATUS_NEEDS_LOGIN,
    STATUS_OK,
    TokenRecord,
    TokenSet,
    fingerprint,
    retiredAfter,
)
from relay.wire.redisclient import logFailure

CODEX_REFRESH_AGE_SECONDS = 8 * 86400
"""Without a known C{exp}, refresh when the last refresh is this old (Codex's rule)."""

SWITCH_SYNC_DELAYS = (1.0, 5.0)
"""Seconds after a Redis master switch at which the token records are read
again (L{OAuthCredentials.storeSwitched})."""

TOKEN_SOURCE_ADMIN = "admin"
"""C{token_source} of tokens an operator put (C{PUT /admin/accounts/{id}/tokens})."""


def _describe(e: BaseException) -> str:
    """
    @return: C{e}'s class and message, readable (no C{Failure} reprs;
        L{relay.oauth.endpoint.describeError}).
    """
    return describeError(e)


@implementer(ICredentialSource)
@define(eq=False)
class OAuthCredentials:
    """
    See the module docstring.

    @ivar _clock: the injected clock (Unix seconds).
    @ivar _settings: the L{relay.state.settings.RuntimeSettings}
        (C{current.oauth}).
    @ivar store: the L{ITokenStore} (may be replaced before L{start}).
    @ivar _endpoint: the L{ITokenEndpoint}.
    @ivar _accounts: the configured accounts.
    @ivar _random: jitter and lock owners.
    @ivar onRefreshFailure: called with an account id for each failed token
        request (transient, permanent or in doubt), or L{None}: the metrics'
        C{relay_oauth_refresh_failures_total}, which adds up across workers
        (L{relay.console.metrics.RelayMetrics.oauthRefreshFailed}).
    @ivar _records: the L{TokenRecords} (the store side: load, lock,
        re-read, persist).
    @ivar _refresher: the L{TokenRefresher} (one token request).
    """

    _clock: IReactorTime
    _settings: Any
    store: ITokenStore
    _endpoint: ITokenEndpoint
    _accounts: list
    _random: random.Random = field(factory=random.Random)
    onRefreshFailure: Optional[Callable[[str], None]] = None
    _slots: dict = field(factory=dict, init=False)
    _running: bool = field(default=False, init=False)
    _owner: str = field(default="", init=False)
    _flagCache: Optional[tuple] = field(default=None, init=False)
    _records: TokenRecords = field(default=None, init=False)
    _refresher: TokenRefresher = field(default=None, init=False)
    _log = Logger()

    def __attrs_post_init__(self) -> None:
        self._owner = f"{os.getpid()}-{self._random.getrandbits(48):012x}"
        self._records = TokenRecords(self, self._clock, self._random, self._owner)
        self._refresher = TokenRefresher(
            self, self._records, self._clock, self._settings, self._endpoint, self._random
        )
        for account in self._accounts:
            if account.type == "oauth":
                seed = fingerprint(account.refresh_token, account.credential, account.id_token)
                self._slots[account.id] = _Slot(account=account, seed=seed)

    # -- life cycle ---------------------------------------------------------------

    def start(self) -> Deferred:
        """
        Load (or seed) every OAuth account's record, resolve orphaned
        in-flight markers, and schedule the proactive refreshes.

        @return: a Deferred firing once every account is loaded; an account
            whose store read fails keeps its configured tokens (logged) and
            is loaded again by L{sync}.
        """
        return Deferred.fromCoroutine(self._start())

    async def _start(self) -> None:
        self._running = True
        for slot in list(self._slots.values()):
            try:
                await self._records.load(slot)
            except Exception as e:
                self._log.error(
                    "could not load the tokens of {account_id}: {error}; using the configured ones",
                    event="relay.oauth_load_failed", account_id=slot.account.id, error=_describe(e),
                )
                if slot.record is None:
                    self.adopt(slot, self._records.configured(slot, 0), schedule=True)

    def stop(self) -> None:
        """
        Cancel timers (service stop). A running refresh finishes on its own.
        """
        self._running = False
        for slot in self._slots.values():
            self._cancelTimers(slot)

    @staticmethod
    def _cancelTimers(slot: _Slot) -> None:
        for name in ("timer", "pendingCall", "doubtTimer"):
            call = getattr(slot, name)
            if call is not None and call.active():
                call.cancel()
            setattr(slot, name, None)

    def accountsChanged(self, accounts, change) -> Deferred:
        """
        A reload changed the live account set (subscribed to
        L{relay.interfaces.ILiveAccounts}): a new OAuth account gets its
        tokens managed at once (loaded or seeded, proactive refresh
        scheduled); a removed one is forgotten; a renewed one (its tokens,
        endpoint or proxy changed) starts again from its configured tokens;
        a changed one (priority, concurrency, models) keeps its tokens and
        dials with its new settings.

        @param accounts: the live accounts, new set (L{Account}s).
        @param change: the L{relay.process.live.AccountSetChange}.
        @return: a Deferred firing once new accounts are loaded; never fails.
        """
        return Deferred.fromCoroutine(self._accountsChanged(list(accounts), change))

    async def _accountsChanged(self, accounts, change) -> None:
        _CHANGES[0] += 1
        byId = {a.id: a for a in accounts}
        for accountId in change.removed | change.renewed:
            slot = self._slots.pop(accountId, None)
            if slot is not None:
                self._cancelTimers(slot)
        for accountId in change.changed - change.renewed:
            slot, account = self._slots.get(accountId), byId.get(accountId)
            if slot is not None and account is not None:
                slot.account = account
                if slot.record is not None:
                    self.adopt(slot, slot.record, schedule=False)
        for accountId in sorted(change.added | change.renewed):
            account = byId.get(accountId)
            if account is None or account.type != "oauth":
                continue
            seed = fingerprint(account.refresh_token, account.credential, account.id_token)
            slot = self._slots[accountId] = _Slot(account=account, seed=seed)
            if not self._running:
                continue
            try:
                await self._records.load(slot)
            except Exception as e:
                self._log.error(
                    "could not load the tokens of {account_id}: {error}; using the configured ones",
                    event="relay.oauth_load_failed", account_id=accountId, error=_describe(e),
                )
                if slot.record is None:
                    self.adopt(slot, self._records.configured(slot, 0), schedule=True)

    def sync(self) -> Deferred:
        """
        Re-read every record from the store and adopt newer ones (another
        process refreshed; a periodic job). Never fails.
        """
        return Deferred.fromCoroutine(self._sync())

    async def _sync(self) -> None:
        for slot in list(self._slots.values()):
            try:
                if slot.record is None:
                    if slot.loading:
                        continue  # start-up (or a reload) is reading it
                    await self._records.load(slot)
                else:
                    await self._records.reload(slot)
                    self._schedule(slot)
            except Exception as e:
                self._log.warn(
                    "token store read for {account_id} failed: {error}",
                    event="relay.oauth_sync_failed", account_id=slot.account.id,
                    error=_describe(e),
                )

    def storeSwitched(self) -> None:
        """
        The store's Redis master changed (a Sentinel promotion,
        L{relay.wire.redisclient.RedisService.switchListeners}): replication is
        asynchronous, so the new master may lack the last token write.
        Every record is read again soon (after L{SWITCH_SYNC_DELAYS}
        seconds, by when the new master is usually reachable), and a
        record older than this process's is written back
        (L{relay.oauth.records.TokenRecords.reload}, behaviour.md R96).
        """
        if not self._running:
            return
        for delay in SWITCH_SYNC_DELAYS:
            self._clock.callLater(delay, self._syncAfterSwitch)

    def _syncAfterSwitch(self) -> None:
        if self._running:
            self.sync().addErrback(
                lambda f: logFailure(self._log, f, "re-reading the tokens after a switch failed")
            )

    # -- ICredentialSource ----------------------------------------------------------

    def current(self, account: Account) -> Account:
        """
        See L{ICredentialSource.current}.
        """
        slot = self._slots.get(account.id)
        if slot is None or slot.dial is None:
            return account
        return slot.dial

    def ready(self, account: Account):
        """
        See L{ICredentialSource.ready}.
        """
        slot = self._slots.get(account.id)
        if slot is None or slot.record is None:
            return None
        tokens = slot.record.tokens
        now = self._clock.seconds()
        if not slot.invalidated and tokens.access_token and (
            tokens.expires_at is None or tokens.expires_at > now + EXPIRY_SKEW_SECONDS
        ):
            return None
        if not self.canRefresh(account) or (slot.waiters is None and now < slot.nextAttempt):
            return None
        return self.refresh(account, stale=tokens.access_token, reason="expired")

    def canRefresh(self, account: Account) -> bool:
        """
        See L{ICredentialSource.canRefresh}.
        """
        slot = self._slots.get(account.id)
        if slot is None or slot.record is None or slot.pending is not None:
            return False
        return slot.record.status == STATUS_OK and bool(slot.record.tokens.refresh_token)

    def refresh(self, account: Account, stale=None, reason: str = "401", force: bool = False,
                retryInDoubt: bool = False) -> Deferred:
        """
        See L{ICredentialSource.refresh}.

        @param retryInDoubt: send an in-doubt refresh token anyway (the
            operator's explicit choice through the admin API).
        """
        slot = self._slots.get(account.id)
        if slot is None or slot.record is None:
            return succeed(False)
        tokens = slot.record.tokens
        if (
            not force and stale is not None and tokens.access_token
            and tokens.access_token != stale and not slot.invalidated
        ):
            return succeed(True)  # someone already replaced the failing token
        if not force and slot.waiters is None and self._clock.seconds() < slot.nextAttempt:
            return succeed(False)  # backing off after a transient failure
        waiter = Deferred()
        if slot.waiters is not None:
            slot.waiters.append(waiter)
            return waiter
        slot.waiters = [waiter]
        flight = Deferred.fromCoroutine(
            self._refresher.flight(slot, stale, reason, force, retryInDoubt)
        )

        def _done(result):
            waiters, slot.waiters = slot.waiters or [], None
            ok = result is True
            for w in waiters:
                if not w.called:
                    w.callback(ok)
            if self._running:
                self._schedule(slot)

        def _ebBug(f):
            self._log.failure("token refresh of {account_id} failed unexpectedly", f,
                              account_id=account.id)
            return False

        flight.addErrback(_ebBug).addCallback(_done)
        return waiter

    def invalidate(self, account: Account) -> None:
        """
        See L{ICredentialSource.invalidate}.
        """
        slot = self._slots.get(account.id)
        if slot is not None:
            slot.invalidated = True
            self._log.warn(
                "access token of {account_id} invalidated after a 401 on the refreshed token",
                event="relay.oauth_token_invalidated", account_id=account.id,
            )
            self._announceDoubt(slot)

    def blockReason(self, account: Account, now: float):
        """
        See L{ICredentialSource.blockReason}.
        """
        slot = self._slots.get(account.id)
        if slot is None:
            return None
        if slot.record is None:
            # Loading (start-up, or an account a reload just added): never
            # dial with token state relay has not read yet (R105:
            # also before the store load began).
            return ("tokens_loading", now + 1)
        record = slot.record
        if record.status == STATUS_NEEDS_LOGIN:
            return ("needs_login: " + (record.reason or "login required"), 0)
        tokens = record.tokens
        usable = bool(tokens.access_token) and not slot.invalidated and (
            tokens.expires_at is None or tokens.expires_at > now
        )
        if usable:
            return None
        if record.status == STATUS_IN_DOUBT:
            return ("needs_login: " + IN_DOUBT_REASON, 0)
        if slot.pending is None and not tokens.refresh_token:
            return ("needs_login: access token expired and no refresh token", 0)
        if slot.waiters is None and now < slot.nextAttempt:
            return ("token_refresh_failing", slot.nextAttempt)
        return None

    def flagged(self, now: float) -> list:
        """
        The OAuth accounts L{blockReason} may refuse at C{now}
        (a superset): every one whose token state is not a usable access
        token. The answer is kept until a slot changes or the first kept
        access token expires, so a selection does not look at every OAuth
        account.

        @param now: Unix seconds.
        @return: account ids.
        """
        key = (_CHANGES[0], self._running, len(self._slots))
        cached = self._flagCache
        if cached is not None and cached[0] == key and now < cached[2]:
            return cached[1]
        out = []
        valid = math.inf
        for accountId, slot in self._slots.items():
            record = slot.record
            if (record is None or record.status == STATUS_NEEDS_LOGIN or slot.invalidated
                    or not record.tokens.access_token):
                out.append(accountId)
                continue
            expires = record.tokens.expires_at
            if expires is not None:
                if expires <= now:
                    out.append(accountId)
                    continue
                valid = min(valid, expires)
        self._flagCache = (key, out, valid)
        return out

    def view(self, account: Account) -> dict:
        """
        See L{ICredentialSource.view}.
        """
        slot = self._slots.get(account.id)
        if slot is None:
            return {}
        if slot.record is None:
            # Managed tokens not read from the store yet (start-up or a
            # reload): the account is blocked ("tokens_loading") and the view
            # says so rather than leaving the token fields out.
            return {
                "token_status": STATUS_LOADING, "token_reason": None,
                "token_expires_at": None, "refresh_running": False,
                "token_source": slot.account.token_source,
            }
        record = slot.record
        status, reason = record.status, record.reason
        block = self.blockReason(account, self._clock.seconds())
        if block is not None and block[0].startswith("needs_login"):
            status, reason = STATUS_NEEDS_LOGIN, block[0][len("needs_login: "):]
        return {
            "token_status": status,
            "token_reason": reason,
            "token_expires_at": record.tokens.expires_at,
            "token_refreshable": bool(record.tokens.refresh_token),
            "last_refresh": record.last_refresh,
            "refresh_failures": record.failures,
            "refresh_failures_total": slot.refreshFailures,
            "refresh_last_error": record.last_error,
            "refresh_next_attempt": slot.nextAttempt or None,
            "refreshes": slot.refreshes,
            "refresh_running": slot.waiters is not None,
            "token_version": record.version,
            "token_unpersisted": slot.pending is not None,
            "token_source": record.source or slot.account.token_source,
        }

    # -- admin ------------------------------------------------------------------------

    def hasAccount(self, accountId: str) -> bool:
        """
        @return: whether C{accountId} is an OAuth account this object manages.
        """
        return accountId in self._slots

    def setTokens(self, accountId: str, access: Optional[str], refresh: Optional[str],
                  idToken: Optional[str] = None) -> Deferred:
        """
        New tokens from an operator (C{PUT /admin/accounts/{id}/tokens}):
        written under the lock as the lineage's newest record; clears
        C{needs_login} and the in-doubt state.

        @return: a Deferred firing with the account's L{view}.
        @raise KeyError: for an account this object does not manage.
        """
        slot = self._slots[accountId]
        return Deferred.fromCoroutine(self._setTokens(slot, access, refresh, idToken))

    async def _setTokens(self, slot, access, refresh, idToken) -> dict:
        owner = await self._records.lock(slot, LOCK_TTL_SECONDS * 4)
        if owner is None:
            raise RuntimeError("the refresh lock is busy; try again")
        try:
            current = await self._records.reload(slot)
            now = self._clock.seconds()
            # The replaced refresh token is spent for good (R96); the one
            # the operator gives is current even if relay had retired it
            # (the operator's explicit choice).
            retired = retiredAfter(current.retired, current.tokens.refresh_token)
            if refresh:
                retired = tuple(f for f in retired if f != fingerprint(refresh))
            record = current.next(
                now, tokens=TokenSet.fromTokens(access, refresh, idToken, now), status=STATUS_OK,
                reason=None, in_flight=None, failures=0, last_error=None, last_refresh=now,
                source=TOKEN_SOURCE_ADMIN, retired=retired,
            )
            if not await self.store.save(slot.account.id, record.version, record.toJSON(),
                                          current.version):
                raise RuntimeError("the token record changed meanwhile; try again")
            slot.pending = None
            slot.nextAttempt = 0.0
            self.adopt(slot, record, schedule=True)
            self._log.warn(
                "new tokens for {account_id} set by the admin",
                event="relay.oauth_tokens_set", account_id=slot.account.id,
            )
        finally:
            await self._records.release(slot, owner)
        return self.view(slot.account)

    # -- the refresh -------------------------------------------------------------------

    # -- adopting and scheduling ------------------------------------------------------

    def adopt(self, slot: _Slot, record: TokenRecord, schedule: bool) -> None:
        previous = slot.record.tokens.access_token if slot.record is not None else None
        slot.record = record
        tokens = record.tokens
        if tokens.access_token != previous:
            slot.invalidated = False
        registerSecrets([tokens.access_token, tokens.refresh_token or "", tokens.id_token or ""])
        refresh = tokens.refresh_token if record.status == STATUS_OK else None
        account = slot.account
        if account.credential == tokens.access_token and account.refresh_token == refresh:
            slot.dial = account
        else:
            slot.dial = evolve(account, credential=tokens.access_token, refresh_token=refresh)
        if schedule:
            self._schedule(slot)
        self._planDoubt(slot)

    def _planDoubt(self, slot: _Slot) -> None:
        """
        While the refresh token is in doubt, plan the call at the access
        token's expiry that logs the account's turn to C{needs_login}
        (reason C{refresh_in_doubt}); cancel it when the tokens or the
        status change.
        """
        record = slot.record
        tokens = record.tokens
        key = None
        if record.status == STATUS_IN_DOUBT and tokens.expires_at is not None:
            key = (tokens.access_token, tokens.expires_at)
        if slot.doubtTimer is not None and slot.doubtTimer.active():
            if slot.doubtKey == key:
                return
            slot.doubtTimer.cancel()
        slot.doubtTimer = slot.doubtKey = None
        if key is None or not self._running or slot.doubtAnnounced == key:
            return
        slot.doubtKey = key
        delay = max(0.0, tokens.expires_at - self._clock.seconds())
        slot.doubtTimer = self._clock.callLater(delay, self._onDoubtExpired, slot)

    def _onDoubtExpired(self, slot: _Slot) -> None:
        slot.doubtTimer = None
        try:
            self._announceDoubt(slot)
        except Exception:
            self._log.failure("reporting the end of an in-doubt access token failed")

    def _announceDoubt(self, slot: _Slot) -> None:
        """
        Log C{relay.oauth_needs_login} (once per in-doubt access token) when
        the account is now unschedulable because its refresh token is in
        doubt and its access token expired or was invalidated.
        """
        record = slot.record
        if record is None or record.status != STATUS_IN_DOUBT:
            return
        key = (record.tokens.access_token, record.tokens.expires_at)
        block = self.blockReason(slot.account, self._clock.seconds())
        if slot.doubtAnnounced == key or block is None or block[0] != (
            "needs_login: " + IN_DOUBT_REASON
        ):
            return
        slot.doubtAnnounced = key
        self._log.error(
            "account {account_id} needs a new login: its access token is no longer usable and"
            " its refresh token is in doubt (POST /admin/accounts/{account_id}/refresh with"
            ' {{"retry_in_doubt": true}} retries it, PUT .../tokens sets new ones)',
            event="relay.oauth_needs_login", account_id=slot.account.id, code=IN_DOUBT_REASON,
            status=None, expired_at=record.tokens.expires_at,
        )

    def refreshAt(self, account: Account) -> Optional[float]:
        """
        When the proactive refresh of C{account} is due (Unix seconds), or
        L{None} when none is planned.
        """
        slot = self._slots.get(account.id)
        if slot is None or slot.record is None:
            return None
        return self._due(slot)

    def _due(self, slot: _Slot) -> Optional[float]:
        record = slot.record
        tokens = record.tokens
        if record.status != STATUS_OK or not tokens.refresh_token or slot.pending is not None:
            return None
        now = self._clock.seconds()
        if not tokens.access_token or slot.invalidated:
            return max(now, slot.nextAttempt)
        if record.failures and slot.nextAttempt:
            # A transient failure in this process: the retry is at the
            # backoff time its log line and the view announced, also when
            # the failed refresh came before the proactive time (an admin's
            # forced refresh, the refresh after a 401).
            return slot.nextAttempt
        if tokens.expires_at is None:
            if record.last_refresh is None:
                return None
            return max(record.last_refresh + CODEX_REFRESH_AGE_SECONDS, slot.nextAttempt)
        start = tokens.issued_at or record.last_refresh or record.updated_at
        lifetime = max(0.0, tokens.expires_at - start)
        margin = min(self._settings.current.oauth.refresh_margin_seconds, lifetime / 2)
        return max(tokens.expires_at - margin, slot.nextAttempt)

    def _schedule(self, slot: _Slot) -> None:
        if slot.timer is not None and slot.timer.active():
            slot.timer.cancel()
        slot.timer = None
        if not self._running or slot.record is None:
            return
        due = self._due(slot)
        if due is None:
            return
        now = self._clock.seconds()
        delay = max(0.0, due - now)
        # Jitter spreads processes that share the account (up to 5 % of the
        # wait, at most 60 s) without ever moving the refresh past C{due}.
        jitter = self._random.uniform(0, min(60.0, delay * 0.05))
        delay = max(0.0, delay - jitter, slot.nextAttempt - now)
        slot.timer = self._clock.callLater(delay, self._onTimer, slot)

    def _onTimer(self, slot: _Slot) -> None:
        slot.timer = None
        try:
            tokens = slot.record.tokens
            reason = "retry" if slot.record.failures and slot.nextAttempt else "proactive"
            d = self.refresh(slot.account, stale=tokens.access_token or "", reason=reason)

            def _cbAgain(ok):
                if slot.waiters is None and slot.timer is None:
                    self._schedule(slot)

            d.addCallback(_cbAgain)
            d.addErrback(lambda f: logFailure(self._log, f, "proactive refresh failed"))
        except Exception:
            self._log.failure("scheduling a proactive refresh failed")
