"""
A property-based (hypothesis) no-leak soak of L{MemorySlotAdmission} on a
L{Clock} (issue 4, behaviour.md R27-R33, R-B2).

Hypothesis draws sequences of: waiting acquires (with random timeouts,
queue bounds and deadlines), immediate C{tryAcquire}s, releases (some
twice), turn cancellations (the L{CancelSignal}), abandoned waits (the
caller cancels the L{Deferred} C{acquire} returned, as when the request's
coroutine is torn down), crashing consumers (the code receiving the lease
raises; its owner's clean-up releases the lease, as the turn runner's
C{finally} does) and clock advances (timeouts, deadlines).

After every step no slot holds more than its limit; at the end, once every
wait has ended and every lease was released, every slot set and wait queue
is empty, every acquire has fired exactly once, and no timer is left.

(Memory leases have no TTL: the memory backend lives and dies with its
process, so a process crash loses its slots with it. The "crashed process
whose leases stay behind" case is the Redis soak,
C{tests/integration/test_redis_soak.py}.)
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock

from relay.admission.memory import MemorySlotAdmission
from relay.base.records import AdmissionError, CancelSignal, WaitPlan

T0 = 1_700_000_000.0

#: slot key -> limit (0 = unlimited)
LIMITS = {("account", "a"): 1, ("account", "b"): 2, ("user", "u"): 1, ("account", "z"): 0}
KEYS = sorted(LIMITS)
REASONS = {"timeout", "queue_full", "client_gone"}


class ConsumerCrashed(Exception):
    """
    Raised by a crashing lease consumer.
    """


key = st.sampled_from(KEYS)
index = st.integers(min_value=0, max_value=50)
timeout = st.sampled_from([0.0, 0.5, 1.0, 3.0, 5.0]) | st.floats(0, 5, allow_nan=False)
acquire = st.tuples(
    st.just("acquire"),
    key,
    timeout,
    st.sampled_from([1, 2, 4]) | st.integers(min_value=0, max_value=4),
    st.none() | st.floats(min_value=-1, max_value=5, allow_nan=False),
)
#: (weight, step): acquires are drawn most often, so queues form.
STEPS = [
    (45, acquire),
    (10, st.tuples(st.just("try"), key)),
    (5, st.tuples(st.just("crashy"), key, timeout)),
    (15, st.tuples(st.just("release"), index, st.booleans())),
    (7, st.tuples(st.just("cancel"), index)),
    (7, st.tuples(st.just("abandon"), index)),
    (11, st.tuples(st.just("advance"), st.floats(min_value=0, max_value=2, allow_nan=False))),
]


@st.composite
def operation(draw):
    """
    One step, drawn by weight.
    """
    n = draw(st.integers(min_value=0, max_value=sum(w for w, _ in STEPS) - 1))
    for weight, step in STEPS:
        if n < weight:
            return draw(step)
        n -= weight
    raise AssertionError("unreachable")


@settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.lists(operation(), min_size=30, max_size=150))
def test_random_sequences_leave_nothing_behind(ops):
    """
    Any sequence of acquire / try / release / cancel / abandon / crashing
    consumer / timeout steps respects every limit at every step and ends
    with no held slot, no queued ticket and no pending timer (R33: every
    exit path gives the slot and the wait place back).
    """
    clock = Clock()
    clock.advance(T0)
    adm = MemorySlotAdmission(clock=clock)
    held = []  # live leases
    waits = []  # (Deferred, CancelSignal) of acquires that may still wait
    outcomes = {}  # id(Deferred) -> list of results seen

    def track(d):
        seen = outcomes.setdefault(id(d), [])

        def _ok(lease):
            seen.append("lease")
            held.append(lease)

        def _err(f):
            f.trap(AdmissionError)
            assert f.value.reason in REASONS, f.value.reason
            seen.append(f.value.reason)

        d.addCallbacks(_ok, _err)
        return d

    for op in ops:
        kind = op[0]
        if kind == "acquire":
            _, (k, i), timeout, maxWaiting, deadline = op
            cancel = CancelSignal()
            plan = WaitPlan(kind=k, id=i, max_concurrency=LIMITS[(k, i)],
                            timeout=timeout, max_waiting=maxWaiting)
            end = None if deadline is None else clock.seconds() + deadline
            d = adm.acquire(plan, cancel, deadline=end)
            waits.append((d, cancel))
            track(d)
        elif kind == "try":
            _, (k, i) = op
            lease = adm.tryAcquire(k, i, LIMITS[(k, i)]).result
            if lease is not None:
                held.append(lease)
        elif kind == "crashy":
            # The consumer raises on receiving the lease; its owner's
            # clean-up (an errback, like the runner's finally) releases it.
            _, (k, i), timeout = op
            got = []
            plan = WaitPlan(kind=k, id=i, max_concurrency=LIMITS[(k, i)],
                            timeout=timeout, max_waiting=2)
            d = adm.acquire(plan, CancelSignal())

            def _crash(lease, got=got):
                got.append(lease)
                raise ConsumerCrashed()

            def _cleanup(f, got=got):
                f.trap(ConsumerCrashed, AdmissionError)
                for lease in got:
                    lease.release()

            d.addCallback(_crash).addErrback(_cleanup)
        elif kind == "release":
            _, n, twice = op
            if held:
                lease = held.pop(n % len(held))
                lease.release()
                if twice:
                    lease.release()
        elif kind == "cancel":
            if waits:
                waits[op[1] % len(waits)][1].cancel()
        elif kind == "abandon":
            if waits:
                waits[op[1] % len(waits)][0].cancel()
        else:
            clock.advance(op[1])
        loads = {}
        for k, i in KEYS:
            loads.update({(k, i): v for i, v in adm.load(k, [i]).result.items()})
        for slot, limit in LIMITS.items():
            if limit > 0:
                assert loads[slot][0] <= limit, (slot, loads[slot])

    # Let every wait end (timeouts are at most 5 s), then release what is held.
    clock.advance(10)
    while held:
        lease = held.pop()
        lease.release()
        lease.release()
    for d, _ in waits:
        assert d.called
        assert len(outcomes[id(d)]) == 1, outcomes[id(d)]
    assert adm._held == {}
    assert adm._queues == {}
    for k, i in KEYS:
        assert adm.load(k, [i]).result == {i: (0, 0)}
    assert clock.getDelayedCalls() == []
