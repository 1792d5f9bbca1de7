# -*- test-case-name: tests.test_scheduler -*-
"""
Which account serves a turn (behaviour.md group E):

  - L{relay.scheduling.session}: the session hash that sticky routing keys
    on (R37);
  - L{relay.scheduling.scheduler}: C{AccountScheduler}, the façade over
    the rooms of selection (R38-R46, R-B6): L{relay.scheduling.layers}
    (previous_response_id -> session hash -> load balance, wait plans, the
    decision record), L{relay.scheduling.bindings} (session bindings,
    response owners, affinity records), L{relay.scheduling.eligibility}
    (compatibility checks), L{relay.scheduling.balance} (the pool, load
    balance, fallback), L{relay.scheduling.preview} (the dry run) and
    L{relay.scheduling.quick} (the sticky fast path);
  - L{relay.scheduling.selection}: what a selection returns, and relay's own
    "no account can serve this" answers (R44, R83);
  - L{relay.scheduling.quota}: OAuth usage windows and quota-aware order.

Slot admission (waiting for a slot once an account is chosen) is its own
seam, L{relay.admission}.
"""
