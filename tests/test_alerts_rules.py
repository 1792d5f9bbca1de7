"""
The shipped Prometheus rules (C{etc/prometheus/relay-rules.yml},
docs/operating.md "Alerts"): valid for C{promtool} and passing their unit
tests (C{relay-rules.test.yml}) when promtool is installed (CI installs
Debian's C{prometheus} package), one rule per alert event, and every
expression names only metrics relay exports.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import yaml
from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from relay.alerts.budgetgauge import KeyBudgetCollector
from relay.alerts.monitor import AlertMetrics
from relay.base.alertsettings import EVENTS
from relay.console.metrics import RelayMetrics
from relay.scheduling.quota import UsageCollector, UsageWindows

RULES = pathlib.Path(__file__).resolve().parent.parent / "etc" / "prometheus" / "relay-rules.yml"

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "unknown": ("",)}


def exportedNames() -> set:
    """
    @return: every sample name relay's metrics registry can serve (with
        the alerts' counters, the usage windows and the budgets' gauge).
    """
    registry = CollectorRegistry()
    metrics = RelayMetrics(registry=registry, multiprocessDir=None)
    metrics.addCollector(UsageCollector(UsageWindows(Clock())))
    metrics.addCollector(KeyBudgetCollector(lambda now: [], Clock()))
    AlertMetrics(registry)
    names = set()
    for family in registry.collect():
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


def rules() -> list:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


class RulesFileTests(SynchronousTestCase):

    def test_everyExpressionNamesExportedMetrics(self):
        """
        Every rule's expression names only metrics relay serves.
        """
        exported = exportedNames()
        for rule in rules():
            named = set(re.findall(r"\brelay_[a-z0-9_]+", rule["expr"]))
            self.assertTrue(named, rule["alert"])
            self.assertEqual(named - exported, set(), rule["alert"])

    def test_everyEventHasARule(self):
        """
        Each alert event has a rule (its C{relay_event} label).
        """
        events = {rule.get("labels", {}).get("relay_event") for rule in rules()}
        self.assertEqual(set(EVENTS) - events, set())

    def test_aMisspeltMetricIsFound(self):
        """
        The check can fail: a name relay does not export is not in the set.
        """
        self.assertIn("relay_cost_usd_total", exportedNames())
        self.assertNotIn("relay_cost_total", exportedNames())

    def test_promtool(self):
        """
        C{promtool check rules} accepts the file.
        """
        promtool = shutil.which("promtool")
        if promtool is None:
            raise SkipTest("promtool is not installed (Debian: apt-get install prometheus)")
        result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                                text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("SUCCESS", result.stdout)

    def test_promtoolUnitTests(self):
        """
        C{promtool test rules}: each rule fires on series that meet its
        condition and not on others (etc/prometheus/relay-rules.test.yml).
        """
        promtool = shutil.which("promtool")
        if promtool is None:
            raise SkipTest("promtool is not installed (Debian: apt-get install prometheus)")
        result = subprocess.run([promtool, "test", "rules", "relay-rules.test.yml"],
                                capture_output=True, text=True, timeout=120, cwd=RULES.parent)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("SUCCESS", result.stdout)


class KeyBudgetGaugeTests(SynchronousTestCase):

    def test_ratio(self):
        """
        The gauge is each budget's used share; budgets without a limit have none.
        """
        registry = CollectorRegistry()
        rows = [{"key": "bob", "daily_tokens": 1000, "daily_used": 850, "monthly_tokens": None,
                 "monthly_used": 850, "daily_usd": 2.0, "daily_spent_usd": 2.5}]
        registry.register(KeyBudgetCollector(lambda now: rows, Clock()))
        value = registry.get_sample_value
        self.assertEqual(value("relay_key_budget_used_ratio",
                               {"key": "bob", "budget": "daily_tokens"}), 0.85)
        self.assertEqual(value("relay_key_budget_used_ratio",
                               {"key": "bob", "budget": "daily_usd"}), 1.25)
        self.assertIsNone(value("relay_key_budget_used_ratio",
                                {"key": "bob", "budget": "monthly_tokens"}))
