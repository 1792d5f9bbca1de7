"""
Admission benchmark: acquire+release round trips per second on the memory
and Redis providers, and Redis commands per admitted turn.

Usage::

    python bench/bench_admission.py [--redis-url redis://127.0.0.1:6379/0]
                                    [--seconds 2] [--concurrency 32]

Without C{--redis-url} it starts its own C{redis-server} on a free port.
Runs on the real reactor (this is a script, so it may import it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import defer, task  # noqa: E402

from relay.admission.memory import MemorySlotAdmission  # noqa: E402
from relay.base.records import CancelSignal, WaitPlan  # noqa: E402


async def _loop(reactor, adm, seconds, concurrency, limit):
    """
    Run C{concurrency} workers doing acquire+release for C{seconds}.

    @return: C{(turns, elapsed)}.
    """
    plan = WaitPlan(kind="account", id="bench", max_concurrency=limit, timeout=30,
                    max_waiting=concurrency)
    end = reactor.seconds() + seconds
    count = [0]

    async def worker():
        while reactor.seconds() < end:
            lease = await adm.acquire(plan, CancelSignal())
            lease.release()
            count[0] += 1
            if count[0] % 200 == 0:
                await task.deferLater(reactor, 0)

    started = reactor.seconds()
    await defer.gatherResults([defer.Deferred.fromCoroutine(worker()) for _ in range(concurrency)])
    return count[0], reactor.seconds() - started


async def main(reactor, args):
    """
    Run the memory and Redis figures and print them.
    """
    mem = MemorySlotAdmission(clock=reactor)
    n, t = await _loop(reactor, mem, args.seconds, 1, 1)
    print(f"memory   : {n / t:10.0f} acquire+release/s (1 worker, fast path)")

    from relay.admission.redis import RedisSlotAdmission
    from relay.wire.redisclient import RedisService

    server = None
    url = args.redis_url
    if url is None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.integration.redis_server import RedisServer

        server = RedisServer()
        server.start()
        url = server.url
    service = RedisService(url=url, clock=reactor, poolsize=args.poolsize)
    service.startService()
    try:
        adm = RedisSlotAdmission(redis=service, clock=reactor, prefix="bench")
        # Fast path: commands per admitted turn on an idle slot.
        before = service.commandCount
        lease = await adm.acquire(
            WaitPlan("account", "bench-rt", 1, 5, 10), CancelSignal()
        )
        acquireCmds = service.commandCount - before
        lease.release()
        releaseCmds = service.commandCount - before - acquireCmds
        print(f"redis    : round trips per admitted turn (fast path): "
              f"{acquireCmds} acquire + {releaseCmds} release")
        for conc, limit in ((1, 1), (args.concurrency, 0), (args.concurrency, args.concurrency)):
            before = service.commandCount
            n, t = await _loop(reactor, adm, args.seconds, conc, limit)
            per = (service.commandCount - before) / max(n, 1)
            label = "unlimited" if limit <= 0 else f"limit {limit}"
            print(f"redis    : {n / t:10.0f} acquire+release/s "
                  f"({conc} workers, {label}, {per:.2f} commands/turn)")
        # Contended: limit below concurrency, so turns queue and poll.
        before = service.commandCount
        n, t = await _loop(reactor, adm, args.seconds, 8, 2)
        per = (service.commandCount - before) / max(n, 1)
        print(f"redis    : {n / t:10.0f} acquire+release/s "
              f"(8 workers, limit 2, contended, {per:.2f} commands/turn)")
    finally:
        await service.stopService()
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--poolsize", type=int, default=4)
    a = parser.parse_args()
    task.react(lambda reactor: defer.Deferred.fromCoroutine(main(reactor, a)))
