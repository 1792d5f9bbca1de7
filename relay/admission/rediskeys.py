# -*- test-case-name: tests.test_redis_liveness,tests.integration.test_redis_admission -*-
"""
The Redis names of L{relay.admission.redis.RedisSlotAdmission}: its Lua
scripts (C{relay/admission/*.lua}, loaded once), the batch operations it
shares with the state store, the R34 key names and the R30 poll figures
(see L{relay.admission.redis} for what each key holds).
"""

from __future__ import annotations

import os
import random

from twisted.internet.interfaces import IReactorTime

from relay.state.redisbatch import SOLO, RedisBatch, batchScript
from relay.wire.redisclient import RedisService


def _script(name: str) -> str:
    """
    @return: the text of C{relay/admission/<name>.lua}.
    """
    with open(os.path.join(os.path.dirname(__file__), name + ".lua"), encoding="utf-8") as f:
        return f.read()


ACQUIRE_LUA = _script("acquire")
LEAVE_LUA = _script("leave")
RENEW_LUA = _script("renew")
LOAD_LUA = _script("load")
BUSY_LUA = _script("busy")
HEARTBEAT_LUA = _script("heartbeat")

#: A slot try and the binding refresh as one operation: KEYS the
#: four of C{acquire.lua} and the binding key; ARGV those of C{acquire.lua}
#: (mode C{try}), then the account id and the binding's TTL ms. Returns
#: C{acquire.lua}'s reply with a fifth element, 1 when the binding was
#: refreshed.
ACQUIRE_BIND_LUA = (
    "local function acquire(KEYS, ARGV)\n" + ACQUIRE_LUA + "\nend\n" + """
local r = acquire({KEYS[1], KEYS[2], KEYS[3], KEYS[4]},
                  {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]})
local bound = 0
if tonumber(r[1]) == 1 and redis.call('GET', KEYS[5]) == ARGV[7] then
  redis.call('SET', KEYS[5], ARGV[7], 'PX', ARGV[8])
  bound = 1
end
r[5] = bound
return r
""")

#: The slot commands a turn sends (acquire, leave; release is a plain
#: C{ZREM}), as operations of one batch: alone, each is the
#: script or command it always was.
ADMISSION_SOLO = {"ACQUIRE": ACQUIRE_LUA, "LEAVE": LEAVE_LUA, "ACQUIRE_BIND": ACQUIRE_BIND_LUA}
ADMISSION_BATCH_LUA = batchScript(ADMISSION_SOLO)

#: One batcher for the state store and the admission of a relay
#: process (L{sharedBatch}): a turn's state reads and its account slot acquire
#: travel in one round trip, and its end (slot releases, owner records, the
#: streak reset) in one more.
SHARED_SOLO = {**SOLO, **ADMISSION_SOLO}
SHARED_BATCH_LUA = batchScript(SHARED_SOLO)


def sharedBatch(redis: RedisService, clock: IReactorTime) -> RedisBatch:
    """
    The batcher a L{relay.state.redis.RedisStateStore} and a
    L{relay.admission.redis.RedisSlotAdmission} share: leading (a lone acquire leaves
    at once, as alone), the store's operations and the releases queued to
    the end of the reactor turn.
    """
    return RedisBatch(redis, clock, solo=SHARED_SOLO, script=SHARED_BATCH_LUA, leading=True)

#: The process registry ZSET (see the module docstring; R34 crash recovery).
PROCESSES_KEY = "relay:processes"

#: Seconds between passes over the slot members whose release is in doubt;
#: each member is released on two passes that reached Redis.
RELEASE_RETRY_SECONDS = 1.0

#: With Sentinel: how far back releases are repeated on a new master.
RECENT_RELEASE_SECONDS = 60.0

#: R34: how long the load-balance layer's load read is reused in this
#: process (sub2api's C{load_batch_cache_ttl_ms}, 200 ms). This
#: process's own slot takes and releases since the read are counted into
#: it at once; a pass whose tries all failed reads again uncached.
LOAD_CACHE_SECONDS = 0.2

#: R30 poll loop figures, seconds
BACKOFF_START = 0.1
BACKOFF_FACTOR = 1.5
BACKOFF_MAX = 2.0


def slotKey(kind: str, id: str) -> str:
    """
    @return: the slot ZSET key, C{concurrency:{kind}:{id}} (R34).
    """
    return f"concurrency:{kind}:{id}"


def queueKey(kind: str, id: str) -> str:
    """
    @return: the FIFO queue key: C{wait:account:{id}} or
        C{concurrency:wait:{id}} (R34 names).
    """
    return f"wait:account:{id}" if kind == "account" else f"concurrency:wait:{id}"


_KEYS: dict = {}
"""C{(kind, id)} -> its C{(slot, queue, alive)} keys, built once."""


def _keys(kind: str, id: str) -> tuple:
    """
    @return: C{(slot, queue, alive)} keys of one slot key (cached).
    """
    keys = _KEYS.get((kind, id))
    if keys is None:
        if len(_KEYS) > 4096:
            _KEYS.clear()
        q = queueKey(kind, id)
        keys = _KEYS[kind, id] = (slotKey(kind, id), q, q + ":alive")
    return keys


def keysFor(kind: str, id: str) -> list:
    """
    @return: C{[slot, queue, alive]} keys of one slot key.
    """
    return list(_keys(kind, id))


def nextBackoff(previous: float, rng: random.Random) -> float:
    """
    R30: the next poll delay.

    @param previous: the previous delay, seconds.
    @param rng: the jitter source.
    @return: C{min(previous * 1.5, 2) * U(0.8, 1.2)}, clamped to 0.1-2 s.
    """
    delay = min(previous * BACKOFF_FACTOR, BACKOFF_MAX) * rng.uniform(0.8, 1.2)
    return min(max(delay, BACKOFF_START), BACKOFF_MAX)


def _base36(n: int) -> str:
    """
    @return: C{n} in base 36, lower case.
    """
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out
