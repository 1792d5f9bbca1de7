# -*- test-case-name: tests.test_oauth -*-
"""
L{TokenRefresher}: one token request of
L{relay.oauth.credentials.OAuthCredentials} (protocol.md 7.4, behaviour.md
R11, R96): under the account's lock, with the in-flight marker written
first and the new tokens written before use; a request that may have
reached the server leaves the refresh token in doubt; permanent failures
put the account in C{needs_login}; transient ones back off.
"""

from __future__ import annotations

from typing import Any

from attrs import define
from twisted.internet.defer import CancelledError
from twisted.internet.task import LoopingCall

from relay.base.logs import registerSecrets
from relay.oauth.crashpoints import crashPoint
from relay.oauth.endpoint import NotSent, describeError
from relay.oauth.records import LOCK_TTL_SECONDS
from relay.oauth.slot import _Slot
from relay.oauth.tokens import (
    STATUS_IN_DOUBT,
    STATUS_NEEDS_LOGIN,
    STATUS_OK,
    TokenRecord,
    TokenSet,
    retiredAfter,
)

EXPIRY_SKEW_SECONDS = 5.0
"""An access token this close to its C{exp} counts as expired before a dial."""

BACKOFF_FIRST_SECONDS = 5.0
BACKOFF_MAX_SECONDS = 600.0
BACKOFF_JITTER = 0.2


@define(eq=False, repr=False)
class TokenRefresher:
    """
    Runs the refresh of one slot (L{relay.oauth.slot._Slot}) of
    L{relay.oauth.credentials.OAuthCredentials}; single flight within the
    process is the host's (its C{refresh}), across processes the lock's.

    @ivar _host: the L{relay.oauth.credentials.OAuthCredentials}: its
        C{store}, log, C{onRefreshFailure} and C{adopt}.
    @ivar _records: the host's L{relay.oauth.records.TokenRecords}.
    @ivar _clock: the injected clock (Unix seconds).
    @ivar _settings: the L{relay.state.settings.RuntimeSettings}.
    @ivar _endpoint: the L{relay.interfaces.ITokenEndpoint}.
    @ivar _random: backoff jitter.
    """

    _host: Any
    _records: Any
    _clock: Any
    _settings: Any
    _endpoint: Any
    _random: Any

    @property
    def _log(self):
        return self._host._log

    def _fresh(self, slot: _Slot, stale) -> bool:
        tokens = slot.record.tokens
        if slot.record.status == STATUS_NEEDS_LOGIN:
            return False
        if not tokens.access_token or slot.invalidated:
            return False
        if stale is not None and tokens.access_token == stale:
            return False
        now = self._clock.seconds()
        return tokens.expires_at is None or tokens.expires_at > now + EXPIRY_SKEW_SECONDS

    async def flight(self, slot, stale, reason, force, retryInDoubt) -> bool:
        """
        One refresh of C{slot} under the account's lock (renewed while it
        runs); the arguments are those of
        L{relay.oauth.credentials.OAuthCredentials.refresh}.

        @return: whether the slot now has fresh tokens; never fails.
        """
        account = slot.account
        settings = self._settings.current.oauth
        try:
            owner = await self._records.lock(
                slot, settings.refresh_timeout_seconds + 2 * LOCK_TTL_SECONDS
            )
        except Exception as e:
            self._log.warn(
                "cannot refresh {account_id}: the token store is unavailable ({error})",
                event="relay.oauth_refresh_failed", account_id=account.id, error=describeError(e),
                reason=reason,
            )
            self._backoff(slot, slot.record.failures + 1)
            return False
        if owner is None:
            self._log.warn(
                "cannot refresh {account_id}: its refresh lock stayed busy",
                event="relay.oauth_refresh_failed", account_id=account.id, reason=reason,
            )
            return False
        renew = LoopingCall(
            lambda: self._host.store.acquireLock(account.id, owner, LOCK_TTL_SECONDS).addErrback(
                lambda f: None
            )
        )
        renew.clock = self._clock
        renew.start(LOCK_TTL_SECONDS / 3, now=False).addErrback(lambda f: None)
        try:
            return await self._refreshLocked(slot, owner, stale, reason, force, retryInDoubt)
        except Exception as e:
            self._log.warn(
                "refresh of {account_id} failed: {error}",
                event="relay.oauth_refresh_failed", account_id=account.id, error=describeError(e),
                reason=reason,
            )
            return False
        finally:
            if renew.running:
                renew.stop()
            await self._records.release(slot, owner)

    async def _refreshLocked(self, slot, owner, stale, reason, force, retryInDoubt) -> bool:
        account = slot.account
        settings = self._settings.current.oauth
        record = await self._records.reload(slot)
        if record.in_flight is not None and record.in_flight.get("owner") != owner:
            record = await self._records.markInDoubt(
                slot, record, "another refresh was in flight and its process is gone"
            )
            self._host.adopt(slot, record, schedule=False)
        if not force and self._fresh(slot, stale):
            self._log.info(
                "tokens of {account_id} were already refreshed elsewhere; nothing sent",
                event="relay.oauth_refresh_shared", account_id=account.id, reason=reason,
            )
            return True
        if slot.pending is not None:
            return False
        if record.status == STATUS_NEEDS_LOGIN:
            return False
        if record.status == STATUS_IN_DOUBT and not retryInDoubt:
            return False
        refreshToken = record.tokens.refresh_token
        if not refreshToken:
            return False
        if record.retires(refreshToken):
            # Never present a token this lineage replaced (R96).
            self._log.error(
                "not refreshing {account_id}: its refresh token was already used",
                event="relay.oauth_refresh_failed", account_id=account.id, reason=reason,
            )
            return False
        now = self._clock.seconds()
        crashPoint("before_mark")
        marked = record.next(now, in_flight={"owner": owner, "since": now}, status=STATUS_OK)
        if not await self._host.store.save(
            account.id, marked.version, marked.toJSON(), record.version
        ):
            await self._records.reload(slot)
            return self._fresh(slot, stale)
        crashPoint("before_request")
        self._log.info(
            "refreshing the tokens of {account_id} ({reason})",
            event="relay.oauth_refresh_started", account_id=account.id, reason=reason,
        )
        try:
            reply = await self._endpoint.refresh(
                account, refreshToken, settings.refresh_timeout_seconds
            )
        except NotSent as e:
            await self._transient(slot, marked, describeError(e), reason)
            return False
        except (Exception, CancelledError) as e:
            self._refreshFailed(slot)
            doubtful = await self._records.markInDoubt(
                slot, marked, "the token request may have reached the server: " + describeError(e)
            )
            self._host.adopt(slot, doubtful, schedule=False)
            return False
        crashPoint("after_response")
        now = self._clock.seconds()
        if reply.ok:
            body = reply.body
            tokens = TokenSet.fromTokens(
                body["access_token"], body.get("refresh_token") or refreshToken,
                body.get("id_token") or record.tokens.id_token, now, body.get("expires_in"),
            )
            registerSecrets(
                [tokens.access_token, tokens.refresh_token or "", tokens.id_token or ""]
            )
            fresh = marked.next(
                now, tokens=tokens, in_flight=None, status=STATUS_OK, reason=None,
                last_refresh=now, failures=0, last_error=None,
                retired=marked.retired if tokens.refresh_token == refreshToken
                else retiredAfter(marked.retired, refreshToken),
            )
            stored = await self._records.persist(slot, fresh, marked)
            crashPoint("after_persist")
            if stored is None:
                return False
            slot.refreshes += 1
            slot.nextAttempt = 0.0
            self._host.adopt(slot, stored, schedule=False)
            self._log.info(
                "refreshed the tokens of {account_id} ({reason}); the new access token expires"
                " at {expires_at}",
                event="relay.oauth_refreshed", account_id=account.id, reason=reason,
                expires_at=tokens.expires_at,
            )
            return True
        if reply.permanent:
            self._refreshFailed(slot)
            code = reply.errorCode or f"status_{reply.status}"
            dead = marked.next(
                now, in_flight=None, status=STATUS_NEEDS_LOGIN, reason=code,
                last_error=reply.describe(),
            )
            if await self._host.store.save(account.id, dead.version, dead.toJSON(), marked.version):
                self._host.adopt(slot, dead, schedule=False)
            self._log.error(
                "account {account_id} needs a new login: the token endpoint answered {code}",
                event="relay.oauth_needs_login", account_id=account.id, code=code,
                status=reply.status,
            )
            return False
        await self._transient(slot, marked, reply.describe(), reason)
        return False

    def _refreshFailed(self, slot: _Slot) -> None:
        """
        Count a failed token request of C{slot}'s account: in the view
        (this process) and through L{onRefreshFailure} (the metrics).
        """
        slot.refreshFailures += 1
        if self._host.onRefreshFailure is not None:
            self._host.onRefreshFailure(slot.account.id)

    async def _transient(self, slot, marked: TokenRecord, error: str, reason: str) -> None:
        self._refreshFailed(slot)
        failures = marked.failures + 1
        record = marked.next(
            self._clock.seconds(), in_flight=None, failures=failures, last_error=error,
        )
        if await self._host.store.save(
            slot.account.id, record.version, record.toJSON(), marked.version
        ):
            self._host.adopt(slot, record, schedule=False)
        delay = self._backoff(slot, failures)
        self._log.warn(
            "refresh of {account_id} failed ({error}); keeping the current token, next try in"
            " {delay:.0f}s",
            event="relay.oauth_refresh_failed", account_id=slot.account.id, error=error,
            reason=reason, failures=failures, delay=delay,
        )

    def _backoff(self, slot: _Slot, failures: int) -> float:
        base = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** max(0, failures - 1))
        delay = base * (1 + self._random.uniform(-BACKOFF_JITTER, BACKOFF_JITTER))
        slot.nextAttempt = self._clock.seconds() + delay
        return delay
