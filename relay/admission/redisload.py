# -*- test-case-name: tests.test_redis_loadcache,tests.test_redis_liveness -*-
"""
L{RedisLoads}: the slot load reads of
L{relay.admission.redis.RedisSlotAdmission} (R29 wait counts, R34's load
cache, R35 on a Redis error): C{load.lua} for a list of ids and
C{busy.lua}, cached for L{LOAD_CACHE_SECONDS}, for the scheduler's
load-balance layer.
"""

from __future__ import annotations

from typing import Any

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from relay.admission.rediskeys import (
    BUSY_LUA,
    LOAD_CACHE_SECONDS,
    LOAD_LUA,
    PROCESSES_KEY,
    keysFor,
)
from relay.wire.redisclient import RedisUnavailable


@define(eq=False, repr=False)
class RedisLoads:
    """
    The load reads of one L{relay.admission.redis.RedisSlotAdmission}.

    @ivar _admission: the admission: its C{timeout}, C{slotTtl},
        C{onRedisError} and error log.
    @ivar _redis: the running L{relay.wire.redisclient.RedisService}.
    @ivar _clock: the injected clock (seconds).
    @ivar _ids: C{(kind, ids)} -> the ids as C{busy.lua}'s one argument.
    @ivar _cache: R34's load cache: C{(kind, ids)} -> C{[read at, loads or
        in-flight Deferred, {id: own slots taken (+) or released (-)
        since}]}.
    """

    _admission: Any
    _redis: Any
    _clock: Any
    _ids: dict = field(factory=dict, init=False)
    _cache: dict = field(factory=dict, init=False)

    def load(self, kind, ids) -> Deferred:
        """
        See L{ISlotAdmission.load}: one C{load.lua} call for all ids.
        """
        ids = list(ids)
        if not ids:
            return succeed({})
        keys = []
        for i in ids:
            keys.extend(keysFor(kind, i))
        keys.append(PROCESSES_KEY)
        d = self._redis.execute(
            self._admission.timeout, "eval", LOAD_LUA, keys, [repr(self._admission.slotTtl)]
        )

        def _cb(flat):
            return {i: (int(flat[2 * n]), int(flat[2 * n + 1])) for n, i in enumerate(ids)}

        def _eb(f: Failure):
            f.trap(RedisUnavailable)
            self._admission._logError("load", f)
            if self._admission.onRedisError == "fail_closed":
                return f
            return {i: (0, 0) for i in ids}

        return d.addCallbacks(_cb, _eb)

    def busy(self, kind, ids=(), fresh=False) -> Deferred:
        """
        The loads of those of C{ids} that hold a slot or have a
        waiter (the scheduler's load-balance layer ranks only these one by
        one; every other id's load is C{(0, 0)}). One C{busy.lua} call for
        C{ids} (L{_read}), reused for L{LOAD_CACHE_SECONDS} (R34's
        in-process load cache): Redis keeps no index of the busy slot keys,
        so the read's work in Redis grows with the ids, and a large pool
        reads it once per 200 ms, not once per turn. This process's own slot
        takes and releases since the read are counted in at once (its view
        of its own slots is exact; other processes' are at most 200 ms old,
        and an acquire checks the limit itself).

        @param ids: a collection the caller passes again unchanged (the
            scheduler's static candidate set) -- the cache is kept per
            C{(kind, ids)}.
        @param fresh: read uncached (R34: after a pass whose tries all
            failed).
        @return: a Deferred firing with id -> C{(inUse, waiting)}; failing
            as L{load} does.
        """
        cacheKey = (kind, ids)
        now = self._clock.seconds()
        entry = self._cache.get(cacheKey)
        if not fresh and entry is not None and now - entry[0] < LOAD_CACHE_SECONDS:
            loads = entry[1]
            if isinstance(loads, Deferred):
                waiter = Deferred()
                entry.append(waiter)
                return waiter
            return succeed(self._withOwn(loads, entry[2]))
        if len(self._cache) > 16:
            self._cache.clear()
        entry = [now, None, {}]
        d = self._read(kind, ids)
        entry[1] = d
        self._cache[cacheKey] = entry

        def _read(busy):
            entry[1] = busy
            waiters = entry[3:]
            del entry[3:]
            out = self._withOwn(busy, entry[2])
            for w in waiters:
                w.callback(dict(out))
            return out

        def _failed(f):
            if self._cache.get(cacheKey) is entry:
                del self._cache[cacheKey]
            waiters = entry[3:]
            del entry[3:]
            for w in waiters:
                w.errback(f)
            return f

        return d.addCallbacks(_read, _failed)

    def _read(self, kind, ids) -> Deferred:
        """
        One C{busy.lua} call: the ids with a load among C{ids}, sent as one
        argument (built once per C{ids}) and answered with the busy ones
        only, so neither side of the round trip grows with the pool (the
        script's work in Redis does: two C{ZCARD}s per idle id).

        @return: a Deferred firing with id -> C{(inUse, waiting)} of the
            busy ids; on a Redis error as L{load} (fail open: every id
            idle, logged).
        """
        blob = self._ids.get((kind, ids))
        if blob is None:
            if len(self._ids) > 16:
                self._ids.clear()
            blob = self._ids[(kind, ids)] = "\n".join(sorted(ids)).encode("utf-8")
        prefix = keysFor(kind, "")
        d = self._redis.execute(self._admission.timeout, "eval", BUSY_LUA, [PROCESSES_KEY],
                                [repr(self._admission.slotTtl), prefix[0], prefix[1], blob])

        def _cb(flat):
            out = {}
            for n in range(0, len(flat), 3):
                i = flat[n]
                out[i.decode("utf-8") if isinstance(i, bytes) else i] = (
                    int(flat[n + 1]), int(flat[n + 2]))
            return out

        def _eb(f: Failure):
            f.trap(RedisUnavailable)
            self._admission._logError("load", f)
            if self._admission.onRedisError == "fail_closed":
                return f
            return {}

        return d.addCallbacks(_cb, _eb)

    @staticmethod
    def _withOwn(busy: dict, own: dict) -> dict:
        """
        A cached busy read with this process's own changes since counted
        in (see L{busy}).
        """
        if not own:
            return dict(busy)
        out = dict(busy)
        for i, n in own.items():
            inUse, waiting = out.get(i, (0, 0))
            inUse = max(0, inUse + n)
            if inUse or waiting:
                out[i] = (inUse, waiting)
            else:
                out.pop(i, None)
        return out

    def noteOwn(self, kind, id, n: int) -> None:
        """
        Count one of this process's slot takes (C{n} 1) or releases (-1)
        into every cached busy read of C{kind} that covers C{id}.
        """
        if not self._cache:
            return
        now = self._clock.seconds()
        stale = []
        for key, entry in self._cache.items():
            if now - entry[0] >= LOAD_CACHE_SECONDS and not isinstance(entry[1], Deferred):
                # Never used again (L{busy} reads anew): dropped, so the
                # turns that follow (a sticky session reads no loads) count
                # nothing into it.
                stale.append(key)
            elif key[0] == kind and id in key[1]:
                own = entry[2]
                own[id] = own.get(id, 0) + n
        for key in stale:
            del self._cache[key]
