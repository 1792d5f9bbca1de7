# -*- test-case-name: tests.test_admin -*-
"""
The operator surface: what an operator sees and can do while relay runs.

  - L{relay.operator.view}: the accounts view (every block selection
    honours), the admin "clear", periodic jobs;
  - L{relay.operator.admin}: the C{/admin} resources and the status page
    (C{status.html});
  - L{relay.operator.metrics}: Prometheus (C{/metrics});
  - L{relay.operator.history}: the per-account last-15-minutes charts;
  - L{relay.operator.report}: C{relay-report}, the seed-style tables from a
    JSON log.
"""
