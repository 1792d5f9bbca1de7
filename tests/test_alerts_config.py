"""
The C{alerts:} section (config.md): parsed as config.md shows it, its
defaults, and one-line errors naming the key that never repeat a webhook
URL (it may carry a token).
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from relay.base.alertsettings import EVENTS, AlertSettings
from relay.base.records import ConfigError
from relay.configuration.parse import settingsFromString

CONFIG_MD = """
alerts:
  webhooks:
    - url: https://hooks.example/relay    # plain JSON; slack: true for Slack's shape
      events: [login_needed, account_disabled, pool_exhausted, capacity_forecast,
               key_budget, spend_rate]
  spend_rate_usd_per_hour: 50
"""


class AlertsConfigTests(SynchronousTestCase):

    def error(self, text, environ=None):
        with self.assertRaises(ConfigError) as caught:
            settingsFromString(text, environ=environ or {})
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        return message

    def test_configMdExample(self):
        """
        config.md's example parses; the URL is not in the settings' repr.
        """
        alerts = settingsFromString(CONFIG_MD, environ={}).alerts
        self.assertEqual(len(alerts.webhooks), 1)
        target = alerts.webhooks[0]
        self.assertEqual((target.url, target.slack, target.events),
                         ("https://hooks.example/relay", False, EVENTS))
        self.assertEqual(target.label, "webhooks[0] (hooks.example)")
        self.assertEqual(alerts.spend_rate_usd_per_hour, 50)
        self.assertNotIn("hooks.example/relay", repr(alerts))

    def test_defaults(self):
        """
        No section: alerting off; the documented defaults.
        """
        alerts = settingsFromString("keys: []", environ={}).alerts
        self.assertEqual(alerts, AlertSettings())
        self.assertFalse(alerts.enabled)
        self.assertIsNone(alerts.spend_rate_usd_per_hour)
        self.assertEqual((alerts.evaluate_interval_seconds, alerts.cooloff_seconds,
                          alerts.capacity_forecast_minutes, alerts.key_budget_percents,
                          alerts.delivery_attempts),
                         (15.0, 600.0, 60.0, (80, 100), 6))

    def test_slackAndEventsDefault(self):
        """
        C{slack: true} is kept; without C{events} a webhook takes every event.
        """
        alerts = settingsFromString(
            "alerts: {webhooks: [{url: 'https://hooks.slack.example/T/B/x', slack: true}]}",
            environ={}).alerts
        self.assertTrue(alerts.webhooks[0].slack)
        self.assertEqual(alerts.webhooks[0].events, EVENTS)

    def test_urlFromTheEnvironment(self):
        """
        C{url_env} reads the URL from the environment; an unset variable is an error naming the key.
        """
        alerts = settingsFromString("alerts: {webhooks: [{url_env: HOOK}]}",
                                    environ={"HOOK": "https://h.example/tok"}).alerts
        self.assertEqual(alerts.webhooks[0].url, "https://h.example/tok")
        self.assertEqual(self.error("alerts: {webhooks: [{url_env: HOOK}]}"),
                         "alerts.webhooks[0].url_env: environment variable HOOK is not set")

    def test_errorsNameTheKey(self):
        """
        Each mistake is one line naming the key path.
        """
        self.assertEqual(self.error("alerts: {webhooks: [{url: 'https://h.example/x',"
                                    " events: [login_needed, pool_dry]}]}"),
                         "alerts.webhooks[0].events[1]: unknown event 'pool_dry' (expected one"
                         " of login_needed, account_disabled, pool_exhausted, capacity_forecast,"
                         " key_budget, spend_rate)")
        self.assertEqual(self.error("alerts: {spend_rate_usd_per_hour: -1}"),
                         "alerts.spend_rate_usd_per_hour: must be between 0 and 1e+09, got -1")
        self.assertEqual(self.error("alerts: {spend_rate_usd_per_hour: 0}"),
                         "alerts.spend_rate_usd_per_hour: must be more than 0 (null turns"
                         " spend_rate off)")
        self.assertEqual(self.error("alerts: {spend_rate: 5}"), "unknown key alerts.spend_rate")
        self.assertEqual(self.error("alerts: {webhooks: [{url: 'https://h.example/x',"
                                    " slak: true}]}"), "unknown key alerts.webhooks[0].slak")
        self.assertEqual(self.error("alerts: {webhooks: [{events: [spend_rate]}]}"),
                         "alerts.webhooks[0]: url or url_env is required")
        self.assertEqual(self.error("alerts: {cooloff_seconds: soon}"),
                         "alerts.cooloff_seconds: expected a number, got a string")
        self.assertEqual(self.error("alerts: {webhooks: [{url: 'https://h.example/x',"
                                    " slack: 'yes'}]}"),
                         "alerts.webhooks[0].slack: expected true or false, got a string")

    def test_urlNeverInAnError(self):
        """
        A bad webhook URL is refused without repeating it.
        """
        for url in ("ftp://h.example/SECRET", "https:///SECRET", "https://h.example/SE CRET",
                    "https://h.example:0/SECRET"):
            message = self.error(f"alerts: {{webhooks: [{{url: '{url}'}}]}}")
            self.assertTrue(message.startswith("alerts.webhooks[0].url: "), message)
            self.assertNotIn("SECRET", message)
            self.assertNotIn("SE CRET", message)

    def test_webhookURLsAreSecrets(self):
        """
        The log redactor is given each webhook URL and its path (a token).
        """
        from relay.configuration.parse import secretsOf

        config = settingsFromString(
            "alerts: {webhooks: [{url: 'https://hooks.example/services/T0/B0/XyZ123'}]}",
            environ={})
        self.assertTrue({"https://hooks.example/services/T0/B0/XyZ123",
                         "/services/T0/B0/XyZ123"} <= secretsOf(config))
