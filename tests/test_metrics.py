"""
Tests for L{relay.console.metrics}.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.console.metrics import NO_ACCOUNT, RelayMetrics, withoutCreated


class RelayMetricsTests(SynchronousTestCase):
    """
    Every record method shows up under its C{relay_} name and labels.
    """

    def setUp(self):
        self.clock = Clock()
        self.metrics = RelayMetrics(CollectorRegistry(), clock=self.clock)

    def scrape(self) -> str:
        """
        The text exposition, as C{/metrics} serves it.
        """
        return generate_latest(withoutCreated(self.metrics.registry)).decode("utf-8")

    def test_namesAndLabels(self):
        """
        After one call of each method the exposition holds each metric
        with its labels and values.
        """
        m = self.metrics
        m.turnFinished("ws", "ok")
        m.turnFinished("ws", "ok")
        m.failoverTo(m.failover("transport_transient", "a2"), "a1")
        m.sameAccountRetry("status_429")
        m.cooldown("temp_unschedulable")
        m.waitFinished("http", "queue_full", 0.0)
        m.waitFinished("ws", "acquired", 2.5)
        m.firstOutput(1.5)
        m.upstreamStatus(503)
        m.addedLatency(0.004)
        m.wsClose(1013)
        m.setSlotsSource(lambda: {"a1": (2, 1), "a2": (0, 0)})
        text = self.scrape()
        for line in [
            'relay_turns_total{entrypoint="ws",outcome="ok"} 2.0',
            ('relay_failovers_total{from_account="a2",reason="transport_transient",'
             'to_account="a1"} 1.0'),
            'relay_same_account_retries_total{reason="status_429"} 1.0',
            'relay_cooldowns_total{reason="temp_unschedulable"} 1.0',
            'relay_waits_total{entrypoint="http",outcome="queue_full"} 1.0',
            'relay_waits_total{entrypoint="ws",outcome="acquired"} 1.0',
            'relay_wait_seconds_count{entrypoint="ws"} 1.0',
            'relay_wait_seconds_sum{entrypoint="ws"} 2.5',
            'relay_wait_seconds_bucket{entrypoint="ws",le="5.0"} 1.0',
            "relay_first_output_seconds_count 1.0",
            'relay_upstream_status_total{status="503"} 1.0',
            "relay_added_latency_seconds_count 1.0",
            'relay_ws_closes_total{code="1013"} 1.0',
            'relay_slots_in_use{account="a1"} 2.0',
            'relay_slots_waiting{account="a1"} 1.0',
            'relay_slots_in_use{account="a2"} 0.0',
        ]:
            self.assertIn(line + "\n", text)

    def test_perTurnUpdatesAsPrometheusOwn(self):
        """
        The per-turn record methods (bound value updates, not
        prometheus_client's C{inc} and C{observe}) leave the exposition
        exactly as C{inc} and C{observe} on the same metrics would: every
        bucket edge, sums, counts; a zero token count adds nothing and a
        negative one is refused as C{inc} refuses it.
        """
        from relay.usage.tokens import TokenCounts

        fast = self.metrics
        slow = RelayMetrics(CollectorRegistry(), clock=self.clock)
        counts = TokenCounts(requests=1, input=7, cached=0, output=3, reasoning=2)
        for seconds in (0.0, 0.001, 0.0011, 0.1, 0.25, 3.0, 600.0, 601.0, float("inf"), -1.0):
            fast.firstOutput(seconds)
            fast.addedLatency(seconds)
            slow.firstOutputSeconds.observe(max(0.0, seconds))
            slow.addedLatencyHistogram.observe(max(0.0, seconds))
        for status in (200, 200, 503):
            fast.upstreamStatus(status)
            slow.upstreamStatuses.labels(status=str(status)).inc()
        for outcome in ("completed", "completed", "failed"):
            fast.turnFinished("http", outcome)
            slow.turns.labels(entrypoint="http", outcome=outcome).inc()
        for _ in range(2):
            fast.tokens("k", "a1", "gpt-5.5", counts)
            slow.usageTurns.labels(key="k", account="a1", model="gpt-5.5").inc()
            for kind, n in (("input", 7), ("cached_input", 0), ("output", 3), ("reasoning", 2)):
                child = slow.tokenCounter.labels(key="k", account="a1", model="gpt-5.5", type=kind)
                if n:
                    child.inc(n)
        self.assertEqual(
            self.scrape(), generate_latest(withoutCreated(slow.registry)).decode("utf-8"))
        self.assertRaises(ValueError, fast.tokens, "k", "a1", "gpt-5.5",
                          TokenCounts(requests=1, input=-1))

    def test_boundUpdatesFallBack(self):
        """
        A metric without the prometheus_client internals the bound updates
        use (another version of the library) is updated through its own
        C{inc} and C{observe}.
        """
        from relay.console.metrics import _adder, _observer

        seen = []

        class Plain:
            def inc(self, amount=1):
                seen.append(("inc", amount))

            def observe(self, amount):
                seen.append(("observe", amount))

        _adder(Plain())(3)
        _observer(Plain())(0.5)
        self.assertEqual(seen, [("inc", 3), ("observe", 0.5)])

    def test_noCreatedSeries(self):
        """
        Issue 15: the exposition has no C{_created} series (counters and
        histograms alike), while the registry itself still has them.
        """
        m = self.metrics
        m.turnFinished("http", "completed")
        m.firstOutput(0.2)
        m.failover("status_503", "a2", "a1")
        text = self.scrape()
        self.assertIn('relay_turns_total{entrypoint="http",outcome="completed"} 1.0', text)
        self.assertIn("relay_first_output_seconds_count 1.0", text)
        self.assertNotIn("_created", text)
        self.assertIn("_created", generate_latest(m.registry).decode("utf-8"))

    def test_openMetricsWithoutCreated(self):
        """
        The OpenMetrics exposition (chosen by C{Accept}) has no C{_created}
        samples either.
        """
        from prometheus_client.openmetrics.exposition import (
            generate_latest as openMetrics,
        )

        self.metrics.turnFinished("http", "completed")
        text = openMetrics(withoutCreated(self.metrics.registry)).decode("utf-8")
        self.assertIn("relay_turns_total", text)
        self.assertNotIn("_created", text)

    def test_failoverCountedWithItsNextAccount(self):
        """
        Issue 15: a failover is counted under C{from_account},
        C{to_account} and C{reason} once the next account is known; one no
        account took over counts as C{to_account="none"}. The status
        page's entry gets the next account too.
        """
        m = self.metrics
        entry = m.failover("status_503", "a2", None, "http", 503)
        self.assertNotIn("relay_failovers_total{", self.scrape())
        m.failoverTo(entry, "a1")
        m.failoverTo(m.failover("transport_transient", "a1", None, "ws", 502), None)
        text = self.scrape()
        self.assertIn(
            'relay_failovers_total{from_account="a2",reason="status_503",to_account="a1"} 1.0',
            text,
        )
        self.assertIn(
            'relay_failovers_total{from_account="a1",reason="transport_transient",'
            f'to_account="{NO_ACCOUNT}"}} 1.0',
            text,
        )
        self.assertEqual(
            [f["next_account_id"] for f in m.recentFailovers()], [None, "a1"]
        )

    def test_slotsSourceReadAtScrape(self):
        """
        The slot gauges follow their source on every scrape.
        """
        loads = {"a1": (1, 0)}
        self.metrics.setSlotsSource(lambda: loads)
        self.assertIn('relay_slots_in_use{account="a1"} 1.0', self.scrape())
        loads["a1"] = (3, 2)
        text = self.scrape()
        self.assertIn('relay_slots_in_use{account="a1"} 3.0', text)
        self.assertIn('relay_slots_waiting{account="a1"} 2.0', text)

    def test_slotsSourceError(self):
        """
        A failing slot source is logged; the scrape still works.
        """
        self.metrics.turnFinished("http", "ok")

        def broken():
            raise RuntimeError("boom")

        self.metrics.setSlotsSource(broken)
        text = self.scrape()
        self.assertIn("relay_turns_total", text)
        self.assertNotIn("relay_slots_in_use{", text)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_recentFailovers(self):
        """
        Failovers are remembered newest first, with the clock's time, up to
        the limit.
        """
        metrics = RelayMetrics(CollectorRegistry(), clock=self.clock, recentLimit=2)
        for i in range(3):
            self.clock.advance(1)
            metrics.failover("status_503", f"a{i}", f"b{i}", "http", 503)
        recent = metrics.recentFailovers()
        self.assertEqual([f["account_id"] for f in recent], ["a2", "a1"])
        self.assertEqual(recent[0]["at"], 3)
        self.assertEqual(recent[0]["upstream_status"], 503)

    def test_separateRegistries(self):
        """
        Two instances with their own registries do not collide.
        """
        RelayMetrics(CollectorRegistry())
        RelayMetrics()
