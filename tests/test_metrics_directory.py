"""
L{relay.process.workers.MetricsDirectory}: the workers' prometheus_client
multiprocess directory (issue 23). The scrape across real workers is
L{tests.integration.test_metrics_workers}.
"""

from __future__ import annotations

import os
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from relay.console.metrics import MULTIPROCESS_ENV, RelayMetrics, multiprocessDirectory
from relay.process.workers import MetricsDirectory


class MetricsDirectoryTests(SynchronousTestCase):
    def test_ownTemporaryDirectory(self):
        """
        Without the variable the supervisor makes a directory, names it in
        the workers' environment and removes it when it stops.
        """
        environ = {}
        directory = MetricsDirectory()
        path = directory.prepare(environ)
        self.assertEqual(environ[MULTIPROCESS_ENV], path)
        self.assertTrue(os.path.isdir(path))
        directory.remove()
        self.assertFalse(os.path.exists(path))

    def test_operatorsDirectoryEmptied(self):
        """
        The operator's directory is used, its old C{.db} files removed (a
        previous run's counts must not be added), and it is kept.
        """
        path = tempfile.mkdtemp(prefix="relay-test-metrics-")
        self.addCleanup(lambda: [os.unlink(os.path.join(path, n)) for n in os.listdir(path)]
                        and os.rmdir(path))
        for name in ("counter_1.db", "keep.txt"):
            open(os.path.join(path, name), "w").close()
        environ = {MULTIPROCESS_ENV: path}
        directory = MetricsDirectory()
        self.assertEqual(directory.prepare(environ), path)
        self.assertEqual(os.listdir(path), ["keep.txt"])
        directory.remove()
        self.assertTrue(os.path.isdir(path))

    def test_singleProcessServesItsRegistry(self):
        """
        Outside a supervisor the served registry is the metrics' own.
        """
        self.assertIsNone(multiprocessDirectory({}))
        metrics = RelayMetrics(multiprocessDir=None)
        self.assertIs(metrics.exposed, metrics.registry)
