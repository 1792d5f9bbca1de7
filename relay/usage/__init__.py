"""
Token accounting per client key, account and model.

  - L{relay.usage.tokens}: L{TokenCounts} and reading C{usage} objects;
  - L{relay.usage.reader}: where the turn engine reads them (the terminal
    event, the chat usage chunk), once per turn;
  - L{relay.usage.ledger}: hourly rollup, periodic flush, per-key budgets;
  - L{relay.usage.store}: the SQLite, Redis and memory stores;
  - L{relay.usage.query}: C{GET /admin/usage} parameters;
  - L{relay.usage.service}: the flush timer.
"""
