# -*- test-case-name: tests.test_eager -*-
"""
L{eagerDeferred}: a coroutine as a L{Deferred}, without the machinery when
it never waits.

C{Deferred.fromCoroutine} wraps every coroutine in Twisted's inline-callback
driver: a Deferred, a copied C{contextvars} context, a cancellation status
and a trampoline step for each await. Many of relay's coroutines finish
without waiting on anything (the memory state store and admission answer
with fired Deferreds), and each relayed request paid that driver for five
of them. L{eagerDeferred} runs the coroutine's first step at once; one that
finishes there is a fired Deferred, one that waits is handed to
C{Deferred.fromCoroutine} where it stands.

Only for coroutines that set no C{contextvars}: their first step runs in
the caller's context, not in a copy of it.
"""

from __future__ import annotations

import types
from collections.abc import Coroutine

from twisted.internet.defer import Deferred, fail, succeed


def eagerDeferred(coro: Coroutine) -> Deferred:
    """
    Run C{coro} until it finishes or first waits.

    @param coro: a coroutine that awaits only L{Deferred}s and sets no
        context variables.
    @return: a fired L{Deferred} when it finished (with its value or its
        exception), else a Deferred driven by C{Deferred.fromCoroutine}
        (cancellable the same way) from where it waits.
    """
    try:
        pending = coro.send(None)
    except StopIteration as stop:
        return succeed(stop.value)
    except BaseException:  # noqa: BLE001 - delivered as the Deferred's failure
        return fail()
    return Deferred.fromCoroutine(_resume(coro, pending))


@types.coroutine
def _resume(coro: Coroutine, pending):
    """
    Drive C{coro} on from the awaitable it is waiting on (C{pending}):
    re-yield each awaitable to Twisted's driver and pass back what it
    sends or throws.
    """
    while True:
        try:
            value = yield pending
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as e:  # noqa: BLE001 - thrown into the coroutine
            try:
                pending = coro.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                pending = coro.send(value)
            except StopIteration as stop:
                return stop.value
