# -*- test-case-name: tests.test_alerts_rules -*-
"""
C{relay_key_budget_used_ratio{key,budget}}: the share of each key's budget
used this period (0..1, above 1 when the last turn overshot it; R108), read
at scrape time from the usage ledger's budget view
(L{relay.usage.ledger.UsageLedger.budgetView}); C{budget} is
C{daily_tokens}, C{monthly_tokens}, C{daily_usd} or C{monthly_usd}. What the
shipped Prometheus rules (C{etc/prometheus/relay-rules.yml}) alert on for
C{key_budget}; relay's own alerts read the same view.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.logger import Logger

from relay.alerts.conditions import BUDGETS


class KeyBudgetCollector(Collector):
    """
    See the module docstring.
    """

    _log = Logger()

    def __init__(self, budgets, clock) -> None:
        """
        @param budgets: C{(now) -> rows} (the ledger's C{budgetView}).
        @param clock: the injected L{twisted.internet.interfaces.IReactorTime}.
        """
        self._budgets = budgets
        self._clock = clock

    def describe(self):
        """
        Name the gauge up front.
        """
        return [self._family()]

    @staticmethod
    def _family():
        """
        @return: an empty L{GaugeMetricFamily} of the gauge.
        """
        return GaugeMetricFamily("relay_key_budget_used_ratio",
                                 "Share of a key's budget used this period (1 = all of it)",
                                 labels=["key", "budget"])

    def collect(self):
        """
        Read the budgets at scrape time; a failed read is logged and reports none.
        """
        family = self._family()
        try:
            rows = self._budgets(self._clock.seconds())
        except Exception:  # noqa: BLE001 - a scrape never fails for it
            self._log.failure("reading budgets failed", event="relay.metrics_budgets_failed")
            rows = []
        for row in rows:
            for budget, limitField, usedField, _ in BUDGETS:
                limit, used = row.get(limitField), row.get(usedField)
                if limit and used is not None:
                    family.add_metric([row["key"], budget], used / limit)
        yield family
