"""
Tests for config.md C{operators:} and C{oidc:}
(L{relay.configuration.operators}): parsed exactly as config.md shows, each
problem one line naming the key.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import ConfigError
from relay.configuration.parse import secretsOf, settingsFromString
from relay.operators.passwords import hashPassword

HASH = hashPassword("ana-password-123")
ADMIN = "admin_key: Zq8vN3kP0xL2mR7tY5wBq\n"
ENV = {"RELAY_OP_ANA": HASH, "RELAY_OIDC_SECRET": "oidc-client-secret-xyz"}


def parse(text, env=ENV):
    return settingsFromString(ADMIN + text, env)


class OperatorsConfigTests(SynchronousTestCase):
    def refused(self, text, env=ENV, admin=True):
        with self.assertRaises(ConfigError) as e:
            settingsFromString((ADMIN if admin else "") + text, env)
        message = str(e.exception)
        self.assertNotIn("\n", message)
        self.assertNotIn(HASH, message)
        return message

    def test_asConfigMdShows(self):
        config = parse("operators:\n"
                       "  - {name: ana, role: owner, password_hash_env: RELAY_OP_ANA}\n")
        (ana,) = config.operators
        self.assertEqual((ana.name, ana.role, ana.password_hash), ("ana", "owner", HASH))
        self.assertNotIn(HASH, repr(config))

    def test_noneByDefault(self):
        config = parse("keys: []\n")
        self.assertEqual((config.operators, config.oidc), ((), None))

    def test_problems(self):
        cases = {
            "operators:\n  - {name: ana, role: root, password_hash_env: RELAY_OP_ANA}\n":
                "operators[0].role",
            "operators:\n  - {name: ana, role: owner, password_hash_env: UNSET}\n":
                "operators[0].password_hash_env: environment variable UNSET is not set",
            "operators:\n  - {name: ana, role: owner, pasword_hash_env: RELAY_OP_ANA}\n":
                "unknown key operators[0].pasword_hash_env",
            "operators:\n  - {name: ana, role: owner}\n": "operators[0] (ana): password_hash_env",
            "operators:\n  - {role: owner, password_hash_env: RELAY_OP_ANA}\n":
                "operators[0]: name is required",
            ("operators:\n  - {name: ana, role: owner, password_hash_env: RELAY_OP_ANA}\n"
             "  - {name: ana, role: viewer, password_hash_env: RELAY_OP_ANA}\n"):
                "operators[1].name: duplicate operator name 'ana'",
            "operators:\n  - {name: ana, role: owner, password_hash_env: RELAY_OIDC_SECRET}\n":
                "does not hold an Argon2 hash",
            "operators: 5\n": "operators: expected a list",
            "oidc: {client_id: relay}\n": "oidc: issuer is required",
            "oidc: {issuer: ftp://x, client_id: relay}\n": "oidc.issuer",
            "oidc: {issuer: https://id.example, client_id: r, scopes: [email]}\n":
                "oidc.scopes: must include openid",
        }
        for text, expected in cases.items():
            self.assertIn(expected, self.refused(text))

    def test_needsAdminKey(self):
        message = self.refused(
            "operators:\n  - {name: ana, role: owner, password_hash_env: RELAY_OP_ANA}\n",
            admin=False)
        self.assertTrue(message.startswith("operators: needs admin_key"))

    def test_oidc(self):
        config = parse("oidc: {issuer: https://id.example/, client_id: relay,"
                       " client_secret_env: RELAY_OIDC_SECRET}\n"
                       "operators:\n  - {name: bo, role: viewer, email: bo@example.com}\n")
        self.assertEqual((config.oidc.issuer, config.oidc.claim, config.oidc.client_secret),
                         ("https://id.example", "email", "oidc-client-secret-xyz"))
        self.assertEqual(config.operators[0].password_hash, None)
        self.assertIn("oidc-client-secret-xyz", secretsOf(config))
        self.assertNotIn("oidc-client-secret-xyz", repr(config))
