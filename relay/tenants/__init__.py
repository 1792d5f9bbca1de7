"""
Client keys as tenants: what one key may do and what it cost.

  - L{relay.tenants.keypolicy}: the per-key policy checked before every turn
    (behaviour.md R102): disabled, expiry, model allow/deny lists, account
    groups, money and token budgets, request and token rates;
  - L{relay.tenants.ratelimit}: the sliding-window request/token counters
    behind C{rpm}/C{tpm}, in memory or shared through Redis;
  - L{relay.tenants.prices}: the price table and the cost of a turn;
  - L{relay.tenants.record}: the one per-turn record the engine fills at a
    turn's end;
  - L{relay.tenants.requestlog}: where those records are kept (SQLite,
    a capped Redis stream, memory) and how they are searched;
  - L{relay.console.explain}: which account the next turn would get and
    why not the others, from the scheduler's own selection code, without
    admitting anything;
  - L{relay.console.tenants}: C{GET /admin/requests} and C{GET /admin/explain}.
"""
