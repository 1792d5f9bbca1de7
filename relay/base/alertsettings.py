# -*- test-case-name: tests.test_alerts_config -*-
"""
The C{alerts:} section of the configuration file (config.md): where
relay's webhook alerts go and the thresholds they fire at. Parsed and
checked by L{relay.configuration.alerts}; used by L{relay.alerts}.

Durations are seconds.
"""

from __future__ import annotations

from typing import Optional

from attrs import field, frozen

LOGIN_NEEDED = "login_needed"
ACCOUNT_DISABLED = "account_disabled"
POOL_EXHAUSTED = "pool_exhausted"
CAPACITY_FORECAST = "capacity_forecast"
KEY_BUDGET = "key_budget"
SPEND_RATE = "spend_rate"

EVENTS = (LOGIN_NEEDED, ACCOUNT_DISABLED, POOL_EXHAUSTED, CAPACITY_FORECAST, KEY_BUDGET,
          SPEND_RATE)
"""Every alert event, in the order config.md lists them."""


@frozen
class WebhookTarget:
    """
    One webhook (C{alerts.webhooks[i]}).

    @ivar url: where alerts are POSTed; a secret (Slack's and others'
        URLs carry a token), never logged: logs name the target by
        L{label}.
    @ivar slack: C{True}: Slack's shape C{{"text": ...}}; C{False}: relay's
        plain JSON object.
    @ivar events: the events this target gets (all by default).
    @ivar label: how logs and metrics name it: C{webhooks[i]} and the
        URL's host.
    """

    url: str = field(repr=False)
    slack: bool = False
    events: tuple = EVENTS
    label: str = "webhooks[0]"


@frozen
class AlertSettings:
    """
    The whole C{alerts:} section; its defaults are docs/operating.md's.

    @ivar webhooks: the L{WebhookTarget}s; none (the default) turns
        alerting off.
    @ivar spend_rate_usd_per_hour: C{spend_rate} fires when the pool's
        spend over the last C{spend_window_seconds}, per hour, is above
        this; L{None} (the default) never fires it.
    @ivar spend_window_seconds: the span the spend rate is read over.
    @ivar evaluate_interval_seconds: how often conditions are evaluated
        (also at once after a turn that failed).
    @ivar cooloff_seconds: after a condition fired, the same condition
        (event and subject) does not fire again for this long, even if it
        cleared and came back meanwhile.
    @ivar capacity_forecast_minutes: C{capacity_forecast} fires when the
        pool's 5-hour windows for a model run out in at most this many
        minutes at the current rate (before they reset).
    @ivar forecast_window_seconds: the span the windows' rate of use is
        read over.
    @ivar key_budget_percents: the shares of a key's budget that fire
        C{key_budget}.
    @ivar delivery_attempts: tries per alert and target (the first and its
        retries).
    @ivar delivery_timeout_seconds: one try's time limit.
    """

    webhooks: tuple = ()
    spend_rate_usd_per_hour: Optional[float] = None
    spend_window_seconds: float = 900.0
    evaluate_interval_seconds: float = 15.0
    cooloff_seconds: float = 600.0
    capacity_forecast_minutes: float = 60.0
    forecast_window_seconds: float = 900.0
    key_budget_percents: tuple = (80, 100)
    delivery_attempts: int = 6
    delivery_timeout_seconds: float = 10.0

    @property
    def enabled(self) -> bool:
        """
        Whether any webhook is configured.
        """
        return bool(self.webhooks)
