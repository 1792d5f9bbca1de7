# -*- test-case-name: tests.test_oauth -*-
"""
Token stores (L{relay.interfaces.ITokenStore}).

  - L{MemoryTokenStore}: one process, nothing survives a restart (tests,
    and a relay without a C{database});
  - L{SQLiteTokenStore}: the embedded C{database} (tables C{oauth_tokens}
    and C{oauth_locks}, created by L{relay.state.settingsdb}'s migration 2),
    sharing the settings store's single connection; a commit is durable
    before the write's Deferred fires. The lock is a row with an expiry,
    so relay processes on one machine sharing the file also single-flight;
  - L{RedisTokenStore}: C{state.backend: redis}; the record is a hash
    C{relay:oauth:{id}} (C{version}, C{record}) written by a
    compare-and-set script, the lock is C{SET relay:oauth:lock:{id} owner NX
    PX ttl} (renewed by its owner) released by a compare-and-delete script. Durability across a
    Redis restart is Redis's own (AOF); with Sentinel a record write also
    waits for a replica (C{WAIT}, L{relay.wire.redisclient.RedisService.executeDurable})
    so a failover cannot lose it (and should an unacknowledged
    one be lost, L{relay.oauth.credentials} writes its newer record back
    after the promotion); see docs/deploying.md (Redis).

Every call is bounded by a timeout on the injected clock (style.md trap
T16).
"""

from __future__ import annotations

from typing import Any, Optional

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from relay.interfaces import ITokenStore

STORE_TIMEOUT_SECONDS = 5.0
"""Every store call has this long, seconds."""

REDIS_RECORD_PREFIX = "relay:oauth:"
REDIS_LOCK_PREFIX = "relay:oauth:lock:"

_SAVE_SCRIPT = """
local current = redis.call('HGET', KEYS[1], 'version')
if ARGV[1] == '' then
  if current then return 0 end
elseif current ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'record', ARGV[3])
return 1
"""

_ACQUIRE_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@implementer(ITokenStore)
@define(eq=False)
class MemoryTokenStore:
    """
    An in-process L{ITokenStore}.

    @ivar _clock: for lock expiry.
    @ivar records: account id -> (version, record JSON).
    @ivar locks: account id -> (owner, until).
    @ivar failing: when true every call fails (tests of store outages).
    """

    _clock: IReactorTime
    records: dict = field(factory=dict)
    locks: dict = field(factory=dict)
    failing: bool = False

    def _check(self) -> None:
        if self.failing:
            raise ConnectionError("token store unavailable")

    def load(self, accountId: str) -> Deferred:
        """
        See L{ITokenStore.load}.
        """
        try:
            self._check()
        except ConnectionError as e:
            return _fail(e)
        entry = self.records.get(accountId)
        return succeed(entry[1] if entry else None)

    def save(self, accountId: str, version: int, record: str, expected: Optional[int]) -> Deferred:
        """
        See L{ITokenStore.save}.
        """
        try:
            self._check()
        except ConnectionError as e:
            return _fail(e)
        entry = self.records.get(accountId)
        current = entry[0] if entry else None
        if current != expected:
            return succeed(False)
        self.records[accountId] = (version, record)
        return succeed(True)

    def acquireLock(self, accountId: str, owner: str, ttl: float) -> Deferred:
        """
        See L{ITokenStore.acquireLock}.
        """
        try:
            self._check()
        except ConnectionError as e:
            return _fail(e)
        now = self._clock.seconds()
        holder = self.locks.get(accountId)
        if holder is not None and holder[1] > now and holder[0] != owner:
            return succeed(False)
        self.locks[accountId] = (owner, now + ttl)
        return succeed(True)

    def releaseLock(self, accountId: str, owner: str) -> Deferred:
        """
        See L{ITokenStore.releaseLock}.
        """
        holder = self.locks.get(accountId)
        if holder is not None and holder[0] == owner:
            del self.locks[accountId]
        return succeed(None)


def _fail(e: Exception) -> Deferred:
    d = Deferred()
    d.errback(e)
    return d


@implementer(ITokenStore)
@define(eq=False)
class SQLiteTokenStore:
    """
    Tokens in the SQLite C{database}, through the settings store's
    connection pool (one connection: writes are serialised).

    @ivar _settings: the L{relay.state.settingsdb.SQLiteSettingsStore} whose pool
        and migrations are used.
    @ivar _clock: the clock for lock expiry and timeouts.
    """

    _settings: Any
    _clock: IReactorTime
    timeout: float = STORE_TIMEOUT_SECONDS

    def _run(self, interaction, *args) -> Deferred:
        d = self._settings._migrate()
        d.addCallback(lambda _: self._settings._getPool().runInteraction(interaction, *args))
        return d.addTimeout(self.timeout, self._clock)

    def load(self, accountId: str) -> Deferred:
        """
        See L{ITokenStore.load}.
        """

        def _load(txn, accountId):
            txn.execute("SELECT record FROM oauth_tokens WHERE account_id = ?", (accountId,))
            row = txn.fetchone()
            return row[0] if row else None

        return self._run(_load, accountId)

    def save(self, accountId: str, version: int, record: str, expected: Optional[int]) -> Deferred:
        """
        See L{ITokenStore.save}: one transaction, committed before the
        Deferred fires.
        """

        def _save(txn, accountId, version, record, expected):
            if expected is None:
                txn.execute(
                    "INSERT OR IGNORE INTO oauth_tokens (account_id, version, record)"
                    " VALUES (?, ?, ?)",
                    (accountId, version, record),
                )
            else:
                txn.execute(
                    "UPDATE oauth_tokens SET version = ?, record = ?"
                    " WHERE account_id = ? AND version = ?",
                    (version, record, accountId, expected),
                )
            return txn.rowcount == 1

        return self._run(_save, accountId, version, record, expected)

    def acquireLock(self, accountId: str, owner: str, ttl: float) -> Deferred:
        """
        See L{ITokenStore.acquireLock}: a row with an expiry, taken in one
        transaction.
        """
        now = self._clock.seconds()

        def _acquire(txn, accountId, owner, now, until):
            txn.execute(
                "INSERT OR IGNORE INTO oauth_locks (account_id, owner, until) VALUES (?, '', 0)",
                (accountId,),
            )
            txn.execute(
                "UPDATE oauth_locks SET owner = ?, until = ?"
                " WHERE account_id = ? AND (until <= ? OR owner = ?)",
                (owner, until, accountId, now, owner),
            )
            return txn.rowcount == 1

        return self._run(_acquire, accountId, owner, now, now + ttl)

    def releaseLock(self, accountId: str, owner: str) -> Deferred:
        """
        See L{ITokenStore.releaseLock}.
        """

        def _release(txn, accountId, owner):
            txn.execute(
                "UPDATE oauth_locks SET owner = '', until = 0 WHERE account_id = ? AND owner = ?",
                (accountId, owner),
            )

        return self._run(_release, accountId, owner)


@implementer(ITokenStore)
@define(eq=False)
class RedisTokenStore:
    """
    Tokens in Redis (see the module docstring).

    @ivar _redis: the L{relay.wire.redisclient.RedisService}.
    """

    _redis: Any
    timeout: float = STORE_TIMEOUT_SECONDS

    def load(self, accountId: str) -> Deferred:
        """
        See L{ITokenStore.load}.
        """
        return self._redis.execute(
            self.timeout, "hget", REDIS_RECORD_PREFIX + accountId, "record"
        )

    def save(self, accountId: str, version: int, record: str, expected: Optional[int]) -> Deferred:
        """
        See L{ITokenStore.save}: a compare-and-set script.
        """
        args = ["" if expected is None else str(expected), str(version), record]
        durable = getattr(self._redis, "executeDurable", None)
        if durable is not None and getattr(self._redis, "durableReplicas", 0):
            # With Sentinel the write is acknowledged by a replica
            # (WAIT) before relay relies on it, so a failover right after a
            # refresh cannot lose the rotated refresh token.
            d = durable(
                self.timeout, ("EVAL", _SAVE_SCRIPT, 1, REDIS_RECORD_PREFIX + accountId, *args)
            )
        else:
            d = self._redis.execute(
                self.timeout, "eval", _SAVE_SCRIPT,
                keys=[REDIS_RECORD_PREFIX + accountId], args=args,
            )
        return d.addCallback(lambda result: int(result or 0) == 1)

    def acquireLock(self, accountId: str, owner: str, ttl: float) -> Deferred:
        """
        See L{ITokenStore.acquireLock}: C{SET key owner NX PX ttl} in a
        script that also renews the TTL for the lock's own owner.
        """
        d = self._redis.execute(
            self.timeout, "eval", _ACQUIRE_SCRIPT,
            keys=[REDIS_LOCK_PREFIX + accountId], args=[owner, str(max(1, int(ttl * 1000)))],
        )
        return d.addCallback(lambda result: int(result or 0) == 1)

    def releaseLock(self, accountId: str, owner: str) -> Deferred:
        """
        See L{ITokenStore.releaseLock}: compare-and-delete.
        """
        d = self._redis.execute(
            self.timeout, "eval", _RELEASE_SCRIPT,
            keys=[REDIS_LOCK_PREFIX + accountId], args=[owner],
        )
        return d.addCallback(lambda _: None)
