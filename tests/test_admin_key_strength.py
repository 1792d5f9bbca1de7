"""
Tests for the admin key's strength check (L{relay.configuration.parse.secretBits},
L{relay.configuration.parse.checkOperatorKeys}; behaviour.md R99).
"""

from __future__ import annotations

import secrets

from twisted.trial.unittest import SynchronousTestCase

from relay.configuration.parse import MIN_ADMIN_KEY_BITS, secretBits, settingsFromString
from relay.base.records import ConfigError

BASE = "keys: [{name: t, key: sk-client-key-0123456789}]\n"


class AdminKeyStrengthTests(SynchronousTestCase):
    """
    L{checkOperatorKeys}' entropy floor for C{admin_key}.
    """

    def test_weak_keys_refused(self):
        """
        Repeats, runs, one unit repeated and relay's published keys are
        refused outside the demo, in one line naming C{admin_key} and never
        the key.
        """
        for key in ("aaaaaaaaaaaaaaaaaaaa", "0123456789abcdefghij", "passwordpassword",
                    "abababababababababab", "admin-demo-change-me", "admin-change-me-0000",
                    "9876543210zyxwvutsrq"):
            with self.assertRaises(ConfigError, msg=key) as e:
                settingsFromString(BASE + f"admin_key: {key}\n")
            message = str(e.exception)
            self.assertTrue(message.startswith("admin_key: too easy to guess"), message)
            self.assertNotIn(key, message)
            self.assertNotIn("\n", message)

    def test_demo_accepts_them(self):
        """
        C{demo: true} (the offline demo's files) takes the published key.
        """
        config = settingsFromString(BASE + "admin_key: admin-demo-change-me\ndemo: true\n")
        self.assertEqual((config.demo, config.admin_key), (True, "admin-demo-change-me"))
        self.assertFalse(settingsFromString(BASE).demo)

    def test_random_keys_accepted(self):
        """
        Random keys of the usual generators pass, every time.
        """
        for _ in range(500):
            for key in (secrets.token_hex(12), secrets.token_urlsafe(16), secrets.token_hex(24)):
                self.assertGreaterEqual(secretBits(key), MIN_ADMIN_KEY_BITS, key)
                settingsFromString(BASE + f"admin_key: '{key}'\n")
