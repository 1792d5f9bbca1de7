"""
Webhook alerts (config.md C{alerts:}, docs/operating.md "Alerts"): relay
tells an operator when a login needs sign-in, an account is disabled, the
pool cannot serve a model, the pool's 5-hour windows will run out soon, a
key reaches a share of its budget, or the spend rate is over a threshold.

  - L{relay.alerts.book}: once per condition, the cool-off, the resolved
    notice;
  - L{relay.alerts.conditions}: what is in force now, from readings;
  - L{relay.alerts.forecast}: the usage windows' rate of use and when they
    run out;
  - L{relay.alerts.delivery}: the webhook bodies and their delivery with
    retries;
  - L{relay.alerts.monitor}: the timer that reads relay's state, off the
    turn path, and sends what the book says.
"""
