"""
Tests for the admin key's strength check (L{relay.configuration.parse.secretBits},
L{relay.configuration.parse.checkOperatorKeys}; behaviour.md R99).
"""

from __future__ import annotations

import glob
import os
import re
import secrets

from twisted.trial.unittest import SynchronousTestCase

from relay.configuration.parse import (
    MIN_ADMIN_KEY_BITS,
    PUBLISHED_KEYS,
    secretBits,
    settingsFromString,
)
from relay.base.records import ConfigError

BASE = "keys: [{name: t, key: sk-client-key-0123456789}]\n"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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

    def test_documented_keys_refused(self):
        """
        A key relay's own guides or example files print (C{RELAY_ADMIN_KEY=...},
        C{admin_key: ...}) is known to everyone: it is a published key,
        refused outside the demo however random it looks -- also the one
        C{docs/running.md} printed before it made a fresh key, which readers
        may have copied.
        """
        files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "compose.yaml")]
        files += glob.glob(os.path.join(ROOT, "docs", "*.md"))
        files += glob.glob(os.path.join(ROOT, "etc", "*.yaml"))
        printed = {"3f9c07b4d2a86e5c0f7b19d3e4a2c8b6f1d0e9a7"}
        for path in files:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            printed.update(re.findall(r"RELAY_ADMIN_KEY=([A-Za-z0-9_.:-]{16,})", text))
            printed.update(re.findall(r"^\s*admin_key:\s*([A-Za-z0-9_.:-]{16,})", text, re.M))
        self.assertEqual(printed - PUBLISHED_KEYS, set())
        for key in printed:
            with self.assertRaises(ConfigError, msg=key):
                settingsFromString(BASE + f"admin_key: '{key}'\n")

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
