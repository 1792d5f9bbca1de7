"""
Tests for L{relay.tenants.prices}: the cost of a turn, the shipped table,
overrides, and unpriced models (issue 22 item 3); and the cost columns of
the usage stores and C{/metrics}.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.console.metrics import RelayMetrics
from relay.state.settingsdb import SQLiteSettingsStore
from relay.tenants.prices import DEFAULT_PRICES, Price, PriceTable, usd
from relay.usage.ledger import UsageLedger
from relay.usage.store import MemoryUsageStore, SQLiteUsageStore, dayStart, hourOf, monthStart
from relay.usage.tokens import TokenCounts
from tests.test_usage import T0, synchronousPool

COUNTS = TokenCounts(requests=1, input=1_000_000, cached=400_000, output=200_000,
                     reasoning=50_000)


class PriceTests(SynchronousTestCase):
    """
    L{Price.nanos}: uncached input, cached input, output and reasoning
    tokens at their own rates.
    """

    def test_formula(self):
        """
        600k uncached x $2 + 400k cached x $0.5 + 150k output x $8 + 50k
        reasoning x $10 = $1.2 + $0.2 + $1.2 + $0.5 = $3.1.
        """
        price = Price(input=2.0, cached_input=0.5, output=8.0, reasoning=10.0)
        self.assertEqual(price.nanos(COUNTS), 3_100_000_000)
        self.assertEqual(usd(price.nanos(COUNTS)), 3.1)

    def test_defaults_of_missing_rates(self):
        """
        Without C{cached_input} cached tokens cost C{input}; without
        C{reasoning} reasoning tokens cost C{output} (OpenAI bills them as
        output).
        """
        price = Price(input=2.0, output=8.0)
        self.assertEqual(price.nanos(COUNTS), 2_000_000_000 + 1_600_000_000)
        self.assertEqual(price.asDict(), {"input": 2.0, "cached_input": 2.0, "output": 8.0,
                                          "reasoning": 8.0})

    def test_table(self):
        """
        The shipped table prices the models relay knows; a dated snapshot is
        priced as its model; an override wins; an unknown model is unpriced
        (L{None}, never 0).
        """
        table = PriceTable()
        for model in ("gpt-5.5", "gpt-5.4", "gpt-5.4-mini", "gpt-4.1"):
            self.assertIn(model, DEFAULT_PRICES)
        self.assertEqual(table.lookup("gpt-5.5"), Price(5.0, 30.0, 0.5))
        self.assertEqual(table.lookup("gpt-4.1-2025-04-14"), DEFAULT_PRICES["gpt-4.1"])
        self.assertIsNone(table.cost("my-finetune", COUNTS))
        table.replace({"gpt-5.5": Price(1.0, 1.0)})
        self.assertEqual(table.cost("gpt-5.5", TokenCounts(1, 10, 0, 10, 0)), 20_000)
        self.assertEqual(table.view()["gpt-5.5"]["source"], "config")
        self.assertEqual(table.view()["gpt-5.4"]["source"], "default")

    def test_priced(self):
        """
        L{PriceTable.priced} fills C{cost}, or counts the turn as unpriced.
        """
        table = PriceTable()
        self.assertEqual(table.priced("gpt-5.5", TokenCounts(1, 1, 0, 1, 0)).cost, 35_000)
        unknown = table.priced("nope", TokenCounts(1, 1, 0, 1, 0))
        self.assertEqual((unknown.cost, unknown.unpriced), (0, 1))
        self.assertEqual(unknown.asDict()["unpriced_requests"], 1)


PRICED = TokenCounts(requests=1, input=100, cached=0, output=10, reasoning=0, cost=1234)
UNPRICED = TokenCounts(requests=1, input=5, cached=0, output=5, reasoning=0, unpriced=1)


class StoreCostTests(SynchronousTestCase):
    """
    The usage stores keep the cost and the unpriced count beside the
    tokens, and sum costs per key for money budgets.
    """

    def check(self, store):
        h = hourOf(T0)
        self.successResultOf(store.add([((h, "k", "a", "m"), PRICED),
                                         ((h, "k", "a", "x"), UNPRICED)]))
        self.successResultOf(store.add([((h, "k", "a", "m"), PRICED)]))
        totals = self.successResultOf(store.totals(0, "model"))
        self.assertEqual((totals["m"].cost, totals["m"].unpriced), (2468, 0))
        self.assertEqual((totals["x"].cost, totals["x"].unpriced), (0, 1))
        day, month = self.successResultOf(store.costTotals(dayStart(T0), monthStart(T0)))
        self.assertEqual((day, month), ({"k": 2468}, {"k": 2468}))

    def test_memory(self):
        self.check(MemoryUsageStore())

    def test_sqlite(self):
        path = self.mktemp()
        database = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(database.close)
        self.check(SQLiteUsageStore(database=database))

    def test_sqlite_table_of_an_older_relay(self):
        """
        A C{usage_hourly} table made before issue 22 gets its cost columns
        on first use; its rows cost 0.
        """
        path = self.mktemp()
        database = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(database.close)

        def old(txn):
            txn.execute(
                "CREATE TABLE usage_hourly (hour INTEGER NOT NULL, key TEXT NOT NULL,"
                " account TEXT NOT NULL, model TEXT NOT NULL, requests INTEGER NOT NULL,"
                " input INTEGER NOT NULL, cached INTEGER NOT NULL, output INTEGER NOT NULL,"
                " reasoning INTEGER NOT NULL, PRIMARY KEY (hour, key, account, model))")
            txn.execute("INSERT INTO usage_hourly VALUES (?, 'k', 'a', 'm', 1, 1, 0, 1, 0)",
                        (hourOf(T0),))

        self.successResultOf(database.runInteraction(old))
        store = SQLiteUsageStore(database=database)
        self.successResultOf(store.add([((hourOf(T0), "k", "a", "m"), PRICED)]))
        totals = self.successResultOf(store.totals(0, "key"))
        self.assertEqual((totals["k"].requests, totals["k"].cost), (2, 1234))


class MetricsCostTests(SynchronousTestCase):
    """
    C{relay_cost_usd_total} and C{relay_unpriced_turns_total} per key,
    account and model.
    """

    def test_metrics(self):
        clock = Clock()
        clock.advance(T0)
        metrics = RelayMetrics(clock=clock)
        ledger = UsageLedger(clock=clock, store=MemoryUsageStore(), metrics=metrics)
        ledger.record("k", "a", "m", TokenCounts(1, 1, 0, 1, 0, cost=2_500_000_000))
        ledger.record("k", "a", "x", UNPRICED)
        labels = {"key": "k", "account": "a", "model": "m"}
        self.assertEqual(metrics.registry.get_sample_value("relay_cost_usd_total", labels), 2.5)
        self.assertEqual(metrics.registry.get_sample_value(
            "relay_unpriced_turns_total", dict(labels, model="x")), 1)
