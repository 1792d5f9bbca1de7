# -*- test-case-name: tests.test_state -*-
"""
Shared runtime state (L{relay.interfaces.IStateStore}): account cooldowns,
counters and TTL'd values.

Two providers with one contract (architecture invariant 8):
L{relay.state.memory.MemoryStateStore} (one process, the default) and
L{relay.state.redis.RedisStateStore} (several processes; import it only
where txredisapi may be imported, trap T5).

Key names (behaviour.md R34), shared by both providers:

  - account runtime: L{accountKey} C{relay:account:{id}} (a hash in Redis);
  - counters: whatever name the caller passes, e.g.
    C{openai_403_count:account:{id}} (see L{counter403Key});
  - values: whatever key the caller passes (sticky bindings, response
    owners).
"""

from __future__ import annotations

ACCOUNT_KEY_PREFIX = "relay:account:"

#: the runtime-state kinds L{relay.interfaces.IStateStore.markAccount} accepts
MARK_KINDS = frozenset(
    ["temp_unschedulable", "rate_limited", "overloaded", "disabled", "model_block"]
)


def accountKey(accountId: str) -> str:
    """
    @param accountId: an account id.
    @return: the key of the account's runtime state, C{relay:account:{id}}.
    """
    return ACCOUNT_KEY_PREFIX + accountId


def counter403Key(accountId: str) -> str:
    """
    @param accountId: an account id.
    @return: the R34 403-counter name, C{openai_403_count:account:{id}}.
    """
    return "openai_403_count:account:" + accountId


__all__ = ["ACCOUNT_KEY_PREFIX", "MARK_KINDS", "accountKey", "counter403Key"]
