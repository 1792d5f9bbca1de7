# -*- test-case-name: tests.test_admission -*-
"""
Concurrency slot admission (L{relay.interfaces.ISlotAdmission}):
per-account and per-user slots with FIFO wait queues (behaviour.md group D,
R-B2).

Providers: L{relay.admission.memory.MemorySlotAdmission} (one process) and
L{relay.admission.redis.RedisSlotAdmission} (import only where txredisapi
may be imported, trap T5).

Common rules of both providers:

  - C{limit <= 0} means unlimited: a lease is granted at once and nothing
    is counted.
  - The wait counter of an account (R29) is the number of tickets in the
    account's FIFO queue; C{load()} reports it as C{waiting} and
    C{WaitPlan.max_waiting} bounds it. A C{max_waiting} below 1 means no
    queue: a busy slot is refused with C{queue_full} at once.
  - Only the head of the queue may take a slot (R-B2); a fast try by a
    newcomer fails while others wait.
  - L{relay.base.records.AdmissionError} instances raised here carry
    C{waitedSeconds} (float) and C{queuePosition} (int, 1-based, 0 when
    the caller never queued) for the engine's wait logs (R32).
"""

from __future__ import annotations

from typing import Optional

from relay.base.records import AdmissionError, WaitPlan

KINDS = ("account", "user")


def admissionError(
    reason: str,
    plan: Optional[WaitPlan],
    waitedSeconds: float = 0.0,
    queuePosition: int = 0,
    detail: str = "",
) -> AdmissionError:
    """
    Build an L{AdmissionError} carrying the wait figures.

    @param reason: C{queue_full}, C{timeout}, C{client_gone} or C{error}.
    @param plan: the L{WaitPlan} in force.
    @param waitedSeconds: seconds spent waiting.
    @param queuePosition: 1-based position when the wait began, or 0.
    @param detail: extra human text.
    @return: the error, with C{waitedSeconds} and C{queuePosition} set.
    """
    err = AdmissionError(reason, plan, detail)
    err.waitedSeconds = waitedSeconds
    err.queuePosition = queuePosition
    return err


__all__ = ["KINDS", "admissionError"]
