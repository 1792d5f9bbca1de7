# -*- test-case-name: tests.test_oauth -*-
"""
L{TokenRecords}: how L{relay.oauth.credentials.OAuthCredentials} keeps an
OAuth account's L{TokenRecord} in the L{relay.interfaces.ITokenStore}
(protocol.md 7.4, behaviour.md R11, R96): the start-up load or seed, the
cross-process refresh lock, re-reads that adopt newer records or write
back a record the store lost, the in-doubt marker, and the write of new
tokens before they are used (retried while the store fails).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define, evolve
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from relay.oauth.endpoint import describeError
from relay.oauth.slot import _Slot
from relay.oauth.tokens import STATUS_IN_DOUBT, TokenRecord, TokenSet, retiredAfter
from relay.wire.redisclient import logFailure

LOCK_TTL_SECONDS = 15.0
"""The refresh lock's TTL; the holder renews it every third of it."""

LOCK_POLL_SECONDS = 0.2
"""How often a waiter retries the lock, seconds."""

PERSIST_RETRY_SECONDS = 5.0
"""How often unpersisted new tokens are written again, seconds."""

IN_DOUBT_REASON = "refresh_in_doubt"


def wentBack(stored: TokenRecord, mine: TokenRecord) -> bool:
    """
    Whether the store holds an older state of C{mine}'s lineage than this
    process knows (behaviour.md R96): its refresh token is one C{mine}
    retired (and it does not know C{mine}'s as retired: not a newer
    record of a lineage that came back to it), or it has a lower version
    of the same seed and refresh token (a lost in-doubt or needs-login
    write). Versions only grow, so a lower one is a write the store lost.

    @param stored: the record read from the store.
    @param mine: this process's newest record.
    """
    refreshToken = stored.tokens.refresh_token
    if refreshToken and mine.retires(refreshToken) and not stored.retires(
        mine.tokens.refresh_token
    ):
        return True
    return (
        stored.version < mine.version and stored.seed == mine.seed
        and refreshToken == mine.tokens.refresh_token
    )


@define(eq=False, repr=False)
class TokenRecords:
    """
    The store side of L{relay.oauth.credentials.OAuthCredentials}: every
    method takes the account's slot (L{relay.oauth.slot._Slot}) and reads
    or writes its record.

    @ivar _host: the L{relay.oauth.credentials.OAuthCredentials} holding
        this object: its C{store} (replaceable before start), its log and
        C{adopt(slot, record, schedule)}.
    @ivar _clock: the injected clock (Unix seconds).
    @ivar _random: lock owner suffixes.
    @ivar _owner: this process's lock owner prefix.
    """

    _host: Any
    _clock: Any
    _random: Any
    _owner: str

    @property
    def _log(self):
        return self._host._log

    def configured(self, slot: _Slot, version: int) -> TokenRecord:
        """
        @return: a record of C{slot}'s configured tokens at C{version}.
        """
        account = slot.account
        tokens = TokenSet.fromTokens(
            account.credential, account.refresh_token, account.id_token, self._clock.seconds()
        )
        return TokenRecord(
            tokens=tokens, version=version, seed=slot.seed, last_refresh=account.last_refresh,
            updated_at=self._clock.seconds(),
        )

    async def load(self, slot: _Slot) -> None:
        """
        Load C{slot}'s stored record, or seed it from the configuration
        (a new login starts a new lineage, R96), resolve an orphaned
        in-flight marker, and adopt the result with its proactive refresh.

        @raise Exception: the store's error; the slot keeps no record.
        """
        slot.loading = True
        try:
            await self._loadSlot(slot)
        finally:
            slot.loading = False

    async def _loadSlot(self, slot: _Slot) -> None:
        account = slot.account
        stored = TokenRecord.fromJSON(await self._host.store.load(account.id))
        older = (
            stored is not None and stored.seed != slot.seed
            and stored.knows(account.refresh_token)
        )
        if stored is None or (stored.seed != slot.seed and not older):
            fresh = self.configured(slot, (stored.version + 1) if stored else 1)
            if stored is not None:
                # A new login replaces the lineage: its refresh tokens stay
                # known as spent (R96), so a peer still configured with one
                # of them adopts this lineage instead of presenting it.
                fresh = evolve(fresh, retired=retiredAfter(
                    stored.retired, stored.tokens.refresh_token
                ))
            written = await self._host.store.save(
                account.id, fresh.version, fresh.toJSON(), stored.version if stored else None
            )
            if written:
                self._log.info(
                    "tokens of {account_id} taken from the configuration ({source})",
                    event="relay.oauth_tokens_seeded", account_id=account.id,
                    source=account.token_source, replaced=stored is not None,
                )
                stored = fresh
            else:
                stored = TokenRecord.fromJSON(await self._host.store.load(account.id)) or fresh
        else:
            self._log.info(
                "tokens of {account_id} loaded from the store (version {version})"
                + ("; the configuration holds an older token of the same login" if older else ""),
                event="relay.oauth_tokens_loaded", account_id=account.id, version=stored.version,
                status=stored.status, older_configuration=older,
            )
        if stored.in_flight is not None:
            stored = await self._resolveInFlight(slot, stored)
        self._host.adopt(slot, stored, schedule=True)

    async def _resolveInFlight(self, slot: _Slot, record: TokenRecord) -> TokenRecord:
        """
        A stored in-flight marker: when its owner's lock is gone the owner
        died mid-refresh and the refresh token is in doubt.
        """
        owner = self._newOwner()
        if not await self._host.store.acquireLock(slot.account.id, owner, LOCK_TTL_SECONDS):
            return record  # its owner is alive (or its lock not yet expired)
        try:
            current = TokenRecord.fromJSON(await self._host.store.load(slot.account.id)) or record
            if current.in_flight is None:
                return current
            return await self.markInDoubt(
                slot, current, "a refresh was in flight when its process stopped"
            )
        finally:
            await self.release(slot, owner)

    async def markInDoubt(self, slot: _Slot, record: TokenRecord, why: str) -> TokenRecord:
        """
        Write C{record} as in doubt (compare-and-set): its refresh token
        is never sent again by itself.

        @param why: the reason, logged and kept as C{last_error}.
        @return: the in-doubt record, or what the store holds when another
            write won.
        """
        doubtful = record.next(
            self._clock.seconds(), in_flight=None, status=STATUS_IN_DOUBT,
            reason=IN_DOUBT_REASON, last_error=why,
        )
        written = await self._host.store.save(
            slot.account.id, doubtful.version, doubtful.toJSON(), record.version
        )
        if written:
            self._log.error(
                "refresh token of {account_id} is in doubt ({why}); it will not be sent again:"
                " the account serves while its access token lasts, then needs a login",
                event="relay.oauth_refresh_in_doubt", account_id=slot.account.id, why=why,
            )
            return doubtful
        return TokenRecord.fromJSON(await self._host.store.load(slot.account.id)) or record

    def _newOwner(self) -> str:
        return f"{self._owner}-{self._random.getrandbits(32):08x}"

    async def lock(self, slot: _Slot, wait: float) -> Optional[str]:
        """
        Take the account's lock, waiting up to C{wait} seconds for another
        holder.

        @return: the owner string, or L{None} when it could not be had.
        """
        owner = self._newOwner()
        deadline = self._clock.seconds() + wait
        while True:
            if await self._host.store.acquireLock(slot.account.id, owner, LOCK_TTL_SECONDS):
                return owner
            if self._clock.seconds() >= deadline:
                return None
            await deferLater(self._clock, LOCK_POLL_SECONDS, lambda: None)

    async def release(self, slot: _Slot, owner: str) -> None:
        """
        Release the account's lock held as C{owner}; an error is logged.
        """
        try:
            await self._host.store.releaseLock(slot.account.id, owner)
        except Exception as e:
            self._log.warn(
                "releasing the refresh lock of {account_id} failed: {error}",
                event="relay.oauth_lock_release_failed", account_id=slot.account.id,
                error=describeError(e),
            )

    async def reload(self, slot: _Slot) -> TokenRecord:
        """
        Read the stored record and adopt it when newer.

        @return: the newest record.
        """
        stored = TokenRecord.fromJSON(await self._host.store.load(slot.account.id))
        if stored is None and slot.record is not None:
            # The store lost the record (e.g. a flushed Redis): put ours back.
            await self._host.store.save(
                slot.account.id, slot.record.version, slot.record.toJSON(), None
            )
            stored = TokenRecord.fromJSON(await self._host.store.load(slot.account.id))
        if stored is not None and slot.record is not None and wentBack(stored, slot.record):
            stored = await self._restore(slot, stored)
        if stored is not None and (slot.record is None or stored.version > slot.record.version):
            self._host.adopt(slot, stored, schedule=False)
        return slot.record if slot.record is not None else stored

    async def _restore(self, slot: _Slot, stored: TokenRecord) -> TokenRecord:
        """
        The store went back (L{wentBack}): write this process's newer
        record again, with a version above both, compare-and-set on the
        stored one (behaviour.md R96).

        @return: the record now stored (ours, or what won meanwhile).
        """
        mine = slot.record
        restored = evolve(
            mine, version=max(mine.version, stored.version) + 1,
            updated_at=self._clock.seconds(),
        )
        self._log.warn(
            "the token store holds an older record of {account_id} (version {stored}, this"
            " process has {mine}: a write was lost, e.g. at a Redis failover); writing the"
            " newer tokens back",
            event="relay.oauth_record_restored", account_id=slot.account.id,
            stored=stored.version, mine=mine.version,
        )
        if await self._host.store.save(slot.account.id, restored.version, restored.toJSON(),
                                 stored.version):
            self._host.adopt(slot, restored, schedule=False)
            return restored
        return TokenRecord.fromJSON(await self._host.store.load(slot.account.id)) or stored

    async def persist(self, slot, fresh: TokenRecord, marked: TokenRecord):
        """
        Write the new tokens before they are used: compare-and-set on the
        marker's version, retried on store errors; a conflict with a record
        that still holds the refresh token just used (another process
        marked it in doubt) is overwritten, any other record wins.

        @return: the written record, or L{None} (kept in memory and retried
            when the store failed; dropped when other tokens won).
        """
        expected = marked
        for attempt in range(3):
            try:
                if await self._host.store.save(slot.account.id, fresh.version, fresh.toJSON(),
                                          expected.version):
                    return fresh
                stored = TokenRecord.fromJSON(await self._host.store.load(slot.account.id))
                if stored is None or stored.tokens.refresh_token != marked.tokens.refresh_token:
                    self._log.warn(
                        "new tokens of {account_id} dropped: the store holds other tokens",
                        event="relay.oauth_refresh_conflict", account_id=slot.account.id,
                    )
                    return None
                expected = stored
                fresh = evolve(fresh, version=stored.version + 1)
            except Exception as e:
                self._log.error(
                    "writing the new tokens of {account_id} failed: {error}",
                    event="relay.oauth_persist_failed", account_id=slot.account.id,
                    error=describeError(e), attempt=attempt + 1,
                )
                await deferLater(self._clock, 0.5 * 2 ** attempt, lambda: None)
        slot.pending = fresh
        self._retryPending(slot, expected)
        return None

    def _retryPending(self, slot: _Slot, expected: TokenRecord) -> None:
        def _again():
            slot.pendingCall = None
            d = Deferred.fromCoroutine(self._flushPending(slot, expected))
            d.addErrback(lambda f: logFailure(self._log, f, "retrying a token write failed"))

        slot.pendingCall = self._clock.callLater(PERSIST_RETRY_SECONDS, _again)

    async def _flushPending(self, slot: _Slot, expected: TokenRecord, conflicts: int = 0) -> None:
        fresh = slot.pending
        if fresh is None:
            return
        try:
            written = await self._host.store.save(
                slot.account.id, fresh.version, fresh.toJSON(), expected.version
            )
            if not written and conflicts < 3:
                stored = TokenRecord.fromJSON(await self._host.store.load(slot.account.id))
                if stored is not None and wentBack(stored, fresh):
                    # The store still holds the refresh token just used: a
                    # peer whose lock wait outlasted this one's (the store
                    # was down) marked it in doubt, or the store went back.
                    # The new tokens still win, as in persist (R96): else
                    # they would be lost and the login with them.
                    slot.pending = evolve(fresh, version=stored.version + 1)
                    await self._flushPending(slot, stored, conflicts + 1)
                    return
        except Exception as e:
            self._log.error(
                "writing the new tokens of {account_id} failed again: {error}",
                event="relay.oauth_persist_failed", account_id=slot.account.id,
                error=describeError(e),
            )
            self._retryPending(slot, expected)
            return
        slot.pending = None
        if written:
            slot.refreshes += 1
            self._host.adopt(slot, fresh, schedule=True)
            self._log.info(
                "new tokens of {account_id} written; now in use",
                event="relay.oauth_refreshed", account_id=slot.account.id, reason="persisted",
                expires_at=fresh.tokens.expires_at,
            )
        else:
            await self.reload(slot)
