# -*- test-case-name: tests.test_admin -*-
"""
The operator surface: what an operator sees and can do while relay runs.

  - L{relay.console.view}: the accounts view (every block selection
    honours), the admin "clear", periodic jobs;
  - L{relay.console.admin}: the C{/admin} resources and the status page
    (static files in C{static/}, served by L{relay.console.assets});
  - L{relay.console.metrics}: Prometheus (C{/metrics});
  - L{relay.console.history}: the per-account last-15-minutes charts;
  - L{relay.console.report}: C{relay-report}, the seed-style tables from a
    JSON log.
"""
