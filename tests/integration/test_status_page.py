"""
The admin status page in a real headless Chromium, against the admin
resource served on a loopback port.

The page reads the admin key from the URL fragment (C{/admin/#key=...}),
stores it in sessionStorage and fetches C{/admin/accounts}; Chromium's
C{--dump-dom} with a virtual time budget gives the DOM after those fetches.
A screenshot is kept as C{artifacts/status.png}.

Skipped only when no Chromium binary is installed (CI installs Debian's
C{chromium}).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from twisted.internet import reactor
from twisted.internet.defer import succeed
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from relay.entry.admin import buildAdminResource
from relay.metrics import RelayMetrics
from relay.settings import RuntimeSettings

KEY = "status-page-key"

CHROMIUM = next(
    (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))
     if p),
    None,
)
TIMEOUT = shutil.which("timeout")

#: Where the screenshot is kept (the repository's C{artifacts/}).
ARTIFACTS = Path(os.environ.get("RELAY_ARTIFACTS") or Path(__file__).resolve().parents[2]
                 / "artifacts")

#: Seconds Chromium may run before it is killed.
CHROMIUM_DEADLINE = 60


class StatusPageBrowserTests(TestCase):
    """
    The status page renders the accounts view in a browser.
    """

    timeout = 3 * CHROMIUM_DEADLINE + 30

    def setUp(self):
        if CHROMIUM is None:
            raise SkipTest("chromium is not installed (apt-get install -y chromium)")
        now = reactor.seconds()
        self.accounts = [
            {
                "id": "acct-cool", "type": "oauth", "priority": 10, "concurrency": 3,
                "in_use": 2, "waiting": 1, "schedulable": False,
                "reason": "upstream transport error", "until": now + 600,
                "rate_limited_until": 0, "breaker": "closed", "disabled": False,
                "last_error": "connection refused", "turns": 7, "failovers": 2,
                "proxy_id": "p1", "proxy_state": "ok",
            },
            {
                "id": "acct-ok", "type": "apikey", "priority": 50, "concurrency": 3,
                "in_use": 0, "waiting": 0, "schedulable": True, "reason": "",
                "until": 0, "rate_limited_until": 0, "breaker": "closed",
                "disabled": False, "last_error": None, "turns": 3, "failovers": 0,
                "proxy_id": None, "proxy_state": None,
            },
        ]
        self.metrics = RelayMetrics(clock=reactor)
        self.metrics.failover("transport_transient", "acct-cool", "acct-ok", "ws", 502)
        self.viewCalls = 0

        def accountsView():
            self.viewCalls += 1
            return succeed(self.accounts)

        root = Resource()
        root.putChild(
            b"admin",
            buildAdminResource(
                KEY, RuntimeSettings(), accountsView, lambda accountId: None,
                self.metrics.registry, recentFailovers=self.metrics.recentFailovers,
                clock=reactor,
            ),
        )
        self.port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.base = f"http://127.0.0.1:{self.port.getHost().port}/admin/"

    async def chromium(self, url, *extra):
        """
        Run headless Chromium on C{url} (bounded by L{CHROMIUM_DEADLINE})
        while the reactor keeps serving.

        @return: C{(stdout, stderr, exit code)}.
        """
        args = [
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage",
            "--user-data-dir=" + os.path.abspath(self.mktemp()),
            "--virtual-time-budget=5000",
            *extra,
            url,
        ]
        if TIMEOUT:
            executable = TIMEOUT
            args = ["-k", "5", str(CHROMIUM_DEADLINE), CHROMIUM, *args]
        else:
            executable = CHROMIUM
        out, err, code = await getProcessOutputAndValue(
            executable, args, env=dict(os.environ), reactor=reactor
        )
        return out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), code

    async def test_cooldownRowRendered(self):
        """
        With the key in the fragment, the page fetches the accounts and
        renders the account in cooldown with its class, reason, slot and
        waiting bars, and the recent failover.
        """
        dom, err, code = await self.chromium(self.base + "#key=" + KEY, "--dump-dom")
        self.assertEqual(code, 0, err[-2000:])
        self.assertGreater(self.viewCalls, 0, "the page never fetched /admin/accounts")
        row = re.search(r'<tr class="account state-cooldown" data-account-id="acct-cool"'
                        r'.*?</tr>', dom, re.S)
        self.assertIsNotNone(row, dom[-3000:])
        self.assertIn("upstream transport error", row.group(0))
        self.assertIn('class="bar slots" title="2 / 3"', row.group(0))
        self.assertIn('class="bar waiting"', row.group(0))
        self.assertRegex(row.group(0), r"in (9m|10m)")
        self.assertIn('<tr class="account state-ok" data-account-id="acct-ok"', dom)
        self.assertRegex(dom, r'<tr class="failover">.*?acct-cool.*?acct-ok.*?'
                              r'transport_transient', )
        self.assertIn('data-loaded="1"', dom)
        self.assertNotIn(KEY, dom)

    async def test_screenshot(self):
        """
        A screenshot of the page is kept as a test artifact.
        """
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        target = ARTIFACTS / "status.png"
        if target.exists():
            target.unlink()
        _, err, code = await self.chromium(
            self.base + "#key=" + KEY, "--window-size=1200,800", "--screenshot=" + str(target)
        )
        self.assertEqual(code, 0, err[-2000:])
        self.assertTrue(target.exists())
        self.assertEqual(target.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")

    async def test_loginWithoutKey(self):
        """
        Without a key the page shows the login form and fetches nothing.
        """
        dom, err, code = await self.chromium(self.base, "--dump-dom")
        self.assertEqual(code, 0, err[-2000:])
        self.assertRegex(dom, r'<div id="login" class="">|<div id="login">')
        self.assertIn('id="dashboard" class="hidden"', dom)
        self.assertEqual(self.viewCalls, 0)

    async def test_wrongKey(self):
        """
        A wrong key is refused (401) and the login form says so.
        """
        dom, err, code = await self.chromium(self.base + "#key=wrong", "--dump-dom")
        self.assertEqual(code, 0, err[-2000:])
        self.assertIn("Invalid admin key", dom)
        self.assertEqual(self.viewCalls, 0)
        self.assertNotIn('data-account-id="acct-cool"', dom)
