# -*- test-case-name: tests.integration.test_redis_state -*-
"""
The Redis L{IStateStore} provider, for several relay processes sharing
state. Same contract as L{relay.state.memory.MemoryStateStore}.

Keys (behaviour.md R34 where it names them):

  - C{relay:account:{id}}: a hash with the fields C{blockedUntil},
    C{blockReason}, C{rateLimitedUntil}, C{overloadedUntil}, C{disabled}
    (C{1}), C{disabledReason}, C{model:{upstream model}} (until),
    C{modelreason:{upstream model}} and C{streak:{upstream model}}
    (C{"count:last failure"}, the R11 transient streak). Times are absolute
    Unix seconds from the injected clock. The hash has no TTL (accounts are
    configured, so the key set is bounded); C{clearAccount} deletes it and
    the account's 403 counter.
  - counters: the caller's name (e.g. C{openai_403_count:account:{id}}), a
    string counter with a millisecond TTL (C{PEXPIRE}).
  - values: the caller's key (e.g. C{sticky_session:...}), a string set
    with C{SET ... PX}.

Every command carries the constructor's C{timeout} (R4: 5 s; trap T16).

The account state view (L{relay.interfaces.IAccountStateView}): every state write
(mark, clear) also bumps C{relay:accounts:seq} and notes the account in the
C{relay:accounts:changes} ZSET (score = that sequence number), in the same
script. The store keeps a mirror of the account hashes: the first view reads
them all (C{MHGETALL}), each later view sends one small C{RELAY_SYNC}
(the sequence, and the ids written since the mirror's) and reads again only
the hashes of those accounts, so a selection costs the changed accounts,
not the pool. A Redis whose epoch (C{relay:accounts:epoch}) is not the
mirror's (flushed, replaced) is read again whole. Streaks are not mirrored
state (selection does not read them; L{getAccountStates} reads Redis).

Every call of one reactor turn (account states, values, marks,
counters, streaks) goes out, in issue order, in one round trip
(L{relay.state.redisbatch.RedisBatch}); each call's Deferred still fires
once its own command has run in Redis.

C{on_redis_error} (R35):

  - C{fail_open} (default): reads degrade (C{getAccountStates} returns the
    default L{AccountRuntime} for every id, C{getValue} returns L{None} -
    "no binding"), writes are dropped, C{incrementCounter} fires 0; each
    logs C{relay.redis_state_error} at warn level.
  - C{fail_closed}: the Deferred fails with
    L{relay.wire.redisclient.RedisUnavailable}.
"""

from __future__ import annotations

from typing import Optional

from attrs import define, evolve, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from relay.state.runtime import AccountRuntime
from relay.interfaces import IAccountStateView, IStateStore
from relay.wire.redisclient import RedisService, RedisUnavailable, describe
from relay.state import MARK_KINDS, accountKey, counter403Key
from relay.state.memory import FlaggedStates
from relay.state.redisbatch import RedisBatch

CHANGE_SEQ_KEY = "relay:accounts:seq"
"""A counter bumped by every account state write (mark, clear)."""
CHANGES_KEY = "relay:accounts:changes"
"""ZSET account id -> the sequence number of its last state write."""
EPOCH_KEY = "relay:accounts:epoch"
"""Set once (Redis TIME) with the change log; a flushed or new
Redis has another, so a mirror of the old one is read again whole."""

_KEEPS_SYNC = frozenset(("GET", "MHGETALL", "RELAY_SYNC", "RELAY_MSET", "SET", "PEXPIRE",
                         "RELAY_INCR", "DEL"))
"""The store's operations that write no account state (a queued
C{RELAY_SYNC} stays shareable across them, L{RedisStateStore._sync})."""

STREAK_FIELD = "streak:"
"""Hash field prefix of the R11 transient streak of one model."""


def _ms(seconds: float) -> int:
    """
    @return: C{seconds} as a positive whole number of milliseconds.
    """
    return max(1, int(round(seconds * 1000)))


def runtimeFromHash(fields: dict) -> AccountRuntime:
    """
    Build an L{AccountRuntime} from a C{relay:account:{id}} hash.

    @param fields: field name -> str value.
    """
    blocks = {k[6:]: float(v) for k, v in fields.items() if k.startswith("model:")}
    reasons = {k[12:]: v for k, v in fields.items() if k.startswith("modelreason:")}
    streaks = {}
    for k, v in fields.items():
        if k.startswith(STREAK_FIELD):
            count, _, last = str(v).partition(":")
            try:
                streaks[k[len(STREAK_FIELD):]] = (int(count), float(last))
            except ValueError:
                continue
    return AccountRuntime(
        blockedUntil=float(fields.get("blockedUntil", 0)),
        blockReason=fields.get("blockReason", ""),
        rateLimitedUntil=float(fields.get("rateLimitedUntil", 0)),
        overloadedUntil=float(fields.get("overloadedUntil", 0)),
        disabled=fields.get("disabled") == "1",
        disabledReason=fields.get("disabledReason", ""),
        modelBlocks=blocks,
        modelReasons=reasons,
        streaks=streaks,
    )


def markFields(kind: str, until: float, reason: str, model) -> list:
    """
    The hash fields one marking writes.

    @return: a flat C{[field, value, ...]} list.
    @raise ValueError: for an unknown kind or a C{model_block} without model.
    """
    if kind == "temp_unschedulable":
        return ["blockedUntil", repr(float(until)), "blockReason", reason]
    if kind == "rate_limited":
        return ["rateLimitedUntil", repr(float(until))]
    if kind == "overloaded":
        return ["overloadedUntil", repr(float(until))]
    if kind == "disabled":
        return ["disabled", "1", "disabledReason", reason]
    if kind == "model_block":
        if not model:
            raise ValueError("model_block needs a model")
        return ["model:" + model, repr(float(until)), "modelreason:" + model, reason]
    raise ValueError(f"unknown account state kind {kind!r}; expected one of {sorted(MARK_KINDS)}")


@implementer(IStateStore, IAccountStateView)
@define(eq=False)
class RedisStateStore:
    """
    L{IStateStore} on Redis.

    @ivar _redis: the running L{RedisService}.
    @ivar _clock: the clock for per-call timeouts.
    @ivar timeout: per-command timeout, seconds (R4: 5).
    @ivar onRedisError: C{fail_open} or C{fail_closed} (R35).
    """

    _redis: RedisService
    _clock: IReactorTime
    timeout: float = 5.0
    onRedisError: str = "fail_open"
    batch: RedisBatch = field(default=None)
    _mirror: FlaggedStates = field(factory=FlaggedStates, init=False)
    _seq: int = field(default=-1, init=False)
    _epoch: str = field(default="", init=False)
    _mirrored: object = field(default=None, init=False)
    """The id list the mirror was last read whole for."""
    _loaded: set = field(factory=set, init=False)
    """The ids whose hashes the mirror holds (read whole)."""
    _sharedSync: Optional[tuple] = field(default=None, init=False)
    """The queued C{RELAY_SYNC} views may share (L{_sync}): C{(the batch's
    queue it is in, its arguments, the Deferreds of the views sharing it)}."""

    _log = Logger()

    def __attrs_post_init__(self) -> None:
        """
        One L{RedisBatch} per store unless one was given.
        """
        if self.batch is None:
            self.batch = RedisBatch(self._redis, self._clock)

    def _batched(self, operation: str, fallback, name: str, keys: list, args=()) -> Deferred:
        """
        Queue one command in this reactor turn's batch and apply
        C{on_redis_error} to its failure.

        @param operation: the operation name for logs and errors.
        @param fallback: the fail-open result.
        """
        if name not in _KEEPS_SYNC:
            self._sharedSync = None
        return self._applyMode(
            operation, fallback, self.batch.call(self.timeout, name, keys, list(args), lead=False)
        )

    def _sync(self) -> Deferred:
        """
        This view's C{RELAY_SYNC}: one per batch. Views asked
        while one is queued unsent with the same known sequence and epoch,
        and no account state write queued after it by this store, share
        its reply (at load every turn's selection asks one in the same
        reactor turn).

        @return: a Deferred firing with the reply, L{None} on a fail-open
            error, or failing (C{fail_closed}).
        """
        args = [str(self._seq), self._epoch or "-"]
        shared = self._sharedSync
        if shared is not None and shared[0] is self.batch._ops and shared[1] == args:
            w = Deferred()
            shared[2].append(w)
            return w
        d = self._batched(
            "sync_account_states", None, "RELAY_SYNC", [CHANGE_SEQ_KEY, CHANGES_KEY, EPOCH_KEY],
            args,
        )
        entry = self._sharedSync = (self.batch._ops, args, [])

        def _fan(result):
            if self._sharedSync is entry:
                self._sharedSync = None
            for w in entry[2]:
                if isinstance(result, Failure):
                    w.errback(result)
                else:
                    w.callback(result)
            return result

        return d.addBoth(_fan)

    def _applyMode(self, operation: str, fallback, d: Deferred) -> Deferred:
        """
        R35 for one call's Deferred.
        """

        def _ebRedis(f: Failure):
            f.trap(RedisUnavailable)
            self._log.warn(
                "redis state {operation} failed ({error}); {mode}",
                event="relay.redis_state_error",
                operation=operation,
                error=describe(f),
                mode=self.onRedisError,
            )
            if self.onRedisError == "fail_closed":
                return f
            return fallback

        return d.addErrback(_ebRedis)

    def getAccountStates(self, accountIds) -> Deferred:
        """
        See L{IStateStore.getAccountStates}. One operation (C{MHGETALL}).
        """
        ids = list(accountIds)
        if not ids:
            return Deferred.fromCoroutine(_const({}))
        keys = [accountKey(i) for i in ids]
        d = self._batched("get_account_states", None, "MHGETALL", keys)

        def _cbBuild(rows):
            if rows is None:
                return {i: AccountRuntime() for i in ids}
            out = {}
            for aid, flat in zip(ids, rows):
                flat = flat or []
                out[aid] = runtimeFromHash(dict(zip(flat[::2], flat[1::2])))
            return out

        return d.addCallback(_cbBuild)

    def accountStateView(self, accountIds) -> Deferred:
        """
        See L{IAccountStateView.accountStateView}: one C{RELAY_SYNC} in this
        reactor turn's batch; the hashes of the accounts written since the
        last view (all of them the first time, for a new id list, or after
        an epoch change) in a second round trip. A Redis error gives the
        fail-open answer of L{getAccountStates} (every account healthy, an
        empty view) or, with C{fail_closed}, the failure.
        """
        full = accountIds is not self._mirrored and (
            self._mirrored is None or not self._loaded.issuperset(accountIds))
        # Callbacks, not a coroutine (the view is asked every
        # turn; a coroutine costs Twisted's inline-callback driver).
        return self._sync().addCallback(self._synced, accountIds, full)

    def _synced(self, reply, accountIds, full: bool):
        """
        L{accountStateView} after its C{RELAY_SYNC}: the mirror, or a
        Deferred of it after reading the hashes that changed (or all).
        """
        if reply is None:
            return FlaggedStates()
        epoch, seq = _str(reply[0]), int(reply[1])
        changed = [_str(i) for i in reply[2:]]
        if epoch != self._epoch or seq < self._seq:
            full = True
        if full:
            ids = list(dict.fromkeys(list(accountIds) + list(self._mirror.runtimes)))

            def _full(rows):
                if rows is None:
                    return FlaggedStates()
                self._mirror = FlaggedStates()
                self._loaded = set(ids)
                self._apply(ids, rows)
                self._mirrored = accountIds
                self._epoch, self._seq = epoch, seq
                return self._mirror

            return self._read(ids).addCallback(_full)
        if changed:

            def _changed(rows):
                if rows is None:
                    return FlaggedStates()
                self._apply(changed, rows)
                self._epoch, self._seq = epoch, seq
                return self._mirror

            return self._read(changed).addCallback(_changed)
        self._epoch, self._seq = epoch, seq
        return self._mirror

    def _read(self, ids: list) -> Deferred:
        """
        The hashes of C{ids} (one C{MHGETALL}); L{None} on a fail-open error.
        """
        return self._batched("get_account_states", None, "MHGETALL",
                             [accountKey(i) for i in ids])

    def _apply(self, ids: list, rows: list) -> None:
        """
        Put read hashes into the mirror (an empty one forgets the account).
        """
        for aid, flat in zip(ids, rows):
            flat = flat or []
            if flat:
                self._mirror.put(aid, runtimeFromHash(dict(zip(flat[::2], flat[1::2]))))
            else:
                self._mirror.put(aid, None)

    def markAccount(self, accountId, kind, until, reason, model=None) -> Deferred:
        """
        See L{IStateStore.markAccount}. Fails with L{ValueError} for an
        unknown C{kind} without touching Redis.
        """
        try:
            fields = markFields(kind, until, reason, model)
        except ValueError as e:
            d = Deferred()
            d.errback(e)
            return d
        return self._batched(
            "mark_account", None, "RELAY_MARK",
            [accountKey(accountId), CHANGE_SEQ_KEY, CHANGES_KEY], [accountId] + fields,
        ).addCallback(lambda _: None)

    def clearAccount(self, accountId) -> Deferred:
        """
        See L{IStateStore.clearAccount}.
        """
        return self._batched(
            "clear_account", None, "RELAY_CLEAR",
            [accountKey(accountId), counter403Key(accountId), CHANGE_SEQ_KEY, CHANGES_KEY],
            [accountId],
        ).addCallback(lambda _: None)

    def bumpStreak(self, accountId, model, ttl) -> Deferred:
        """
        See L{IStateStore.bumpStreak}. One operation (C{RELAY_STREAK}, on the
        account hash, so L{clearAccount} ends it too). Fail-open result: 0.
        """
        at = float(self._clock.seconds())
        d = self._batched(
            "bump_streak", 0, "RELAY_STREAK", [accountKey(accountId), CHANGE_SEQ_KEY, CHANGES_KEY],
            [STREAK_FIELD + model, repr(at), repr(float(ttl)), accountId],
        ).addCallback(int)

        def _mirror(count):
            # This process's own bump is in its mirror at once, so
            # a success right after it resets it (L{resetStreak}).
            if count and accountId in self._loaded:
                runtime = self._mirror.get(accountId) or AccountRuntime()
                # As the script did: the streaks past the TTL are gone.
                streaks = {m: v for m, v in runtime.streaks.items() if at - v[1] <= ttl}
                streaks[model] = (count, at)
                self._mirror.put(accountId, evolve(runtime, streaks=streaks))
            return count

        return d.addCallback(_mirror)

    def resetStreak(self, accountId, model) -> Deferred:
        """
        See L{IStateStore.resetStreak}. Nothing is sent when the
        mirror (read at this process's last selection, with its own bumps
        since) holds no streak of that model: a success's reset then costs
        no command. A streak bumped elsewhere after that read is reset by
        the next success that reads it.
        """
        if accountId in self._loaded and self._epoch:
            runtime = self._mirror.get(accountId)
            if runtime is None or model not in runtime.streaks:
                return succeed(None)
            streaks = dict(runtime.streaks)
            del streaks[model]
            self._mirror.put(accountId, evolve(runtime, streaks=streaks))
        return self._batched(
            "reset_streak", None, "HDEL", [accountKey(accountId)], [STREAK_FIELD + model]
        ).addCallback(lambda _: None)

    def incrementCounter(self, name, ttl, refresh=True) -> Deferred:
        """
        See L{IStateStore.incrementCounter}. One operation (C{RELAY_INCR}).
        Fail-open result: 0.
        """
        return self._batched(
            "increment_counter", 0, "RELAY_INCR", [name], [_ms(ttl), "1" if refresh else "0"]
        ).addCallback(int)

    def resetCounter(self, name) -> Deferred:
        """
        See L{IStateStore.resetCounter}.
        """
        return self._batched("reset_counter", None, "DEL", [name]).addCallback(lambda _: None)

    def getValue(self, key) -> Deferred:
        """
        See L{IStateStore.getValue}. Fail-open result: L{None} (R35: a
        sticky read error is no binding).
        """
        return self._batched("get_value", None, "GET", [key])

    def setValue(self, key, value, ttl) -> Deferred:
        """
        See L{IStateStore.setValue}.
        """
        return self._batched(
            "set_value", None, "SET", [key], [value, "PX", _ms(ttl)]
        ).addCallback(lambda _: None)

    def setValues(self, pairs, ttl) -> Deferred:
        """
        L{setValue} of several keys, together (one operation,
        atomic; a response's routing binding and owner record, R39/R40/R104).

        @param pairs: C{[(key, value), ...]}, or C{(key, value, ttl)}
            triples for a key with a TTL of its own.
        @param ttl: seconds (for the pairs without one).
        """
        keys, args = [], []
        for pair in pairs:
            keys.append(pair[0])
            args.append(_ms(pair[2] if len(pair) > 2 else ttl))
            args.append(pair[1])
        return self._batched(
            "set_values", None, "RELAY_MSET", keys, args,
        ).addCallback(lambda _: None)

    def touchValue(self, key, ttl) -> Deferred:
        """
        See L{IStateStore.touchValue}.
        """
        return self._batched(
            "touch_value", None, "PEXPIRE", [key], [_ms(ttl)]
        ).addCallback(lambda _: None)

    def deleteValue(self, key) -> Deferred:
        """
        See L{IStateStore.deleteValue}.
        """
        return self._batched("delete_value", None, "DEL", [key]).addCallback(lambda _: None)


def _str(value) -> str:
    """
    A reply element as text.
    """
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


async def _const(value):
    """
    @return: C{value} (an already-fired coroutine result).
    """
    return value
