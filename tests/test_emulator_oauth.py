"""
Issue 12: the emulator's token issuer and usage meter
(L{relay.emulator.oauth}) on a Clock.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from relay.emulator import Emulator, EmulatorConfigError, validateConfig
from relay.emulator.oauth import OAuthAuthority, parseTokenFaults
from relay.oauth.tokens import accountIdOf, expiresAt

NOW = 1_800_000_000.0


class AuthorityTests(SynchronousTestCase):
    """
    Rotation, reuse, tokens and usage.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(NOW)
        self.authority = OAuthAuthority(clock=self.clock, accessTtl=60)
        self.authority.addAccount("o1", "rt-0", "acct-o1", "pro")

    def test_rotation(self):
        """
        protocol.md 7.4: a current refresh token rotates once; presenting it
        again is C{refresh_token_reused} (counted); an unknown one is
        C{invalid_grant}; a wrong grant type is refused.
        """
        status, body = self.authority.exchange(
            {"grant_type": "refresh_token", "refresh_token": "rt-0"})
        self.assertEqual(status, 200)
        self.assertNotEqual(body["refresh_token"], "rt-0")
        self.assertEqual(expiresAt(body["access_token"]), NOW + 60)
        self.assertEqual(accountIdOf(body["access_token"]), "acct-o1")
        self.assertEqual(body["expires_in"], 60)
        status, again = self.authority.exchange(
            {"grant_type": "refresh_token", "refresh_token": "rt-0"})
        self.assertEqual((status, again["error"]["code"]), (401, "refresh_token_reused"))
        self.assertEqual(self.authority.stats()["accounts"]["o1"],
                         {"token_requests": 0, "refreshes": 1, "reuse_attempts": 1})
        status, unknown = self.authority.exchange(
            {"grant_type": "refresh_token", "refresh_token": "nope"})
        self.assertEqual((status, unknown["error"]), (400, "invalid_grant"))
        self.assertEqual(self.authority.exchange({"grant_type": "password"})[0], 400)

    def test_authenticate(self):
        """
        Our JWTs map to the account's key; expired or forged ones are 401
        (attributed to the account when it is named); other bearers pass.
        """
        good = self.authority.mintAccessToken("o1")
        self.assertEqual(self.authority.authenticate(good), ("oauth:o1", None))
        expired = self.authority.mintAccessToken("o1", ttl=-1)
        key, error = self.authority.authenticate(expired)
        self.assertEqual((key, error["error"]["code"]), ("oauth:o1", "token_expired"))
        other = OAuthAuthority(clock=self.clock)
        other.addAccount("o1", None, "x")
        key, error = self.authority.authenticate(other.mintAccessToken("o1"))
        self.assertEqual(error["error"]["code"], "invalid_token")
        self.assertEqual(self.authority.authenticate("sk-plain"), ("sk-plain", None))

    def test_parseRequest(self):
        """
        JSON and form bodies give the same fields.
        """
        fields = {"grant_type": "refresh_token", "refresh_token": "rt-0"}
        self.assertEqual(OAuthAuthority.parseRequest(
            b'{"grant_type":"refresh_token","refresh_token":"rt-0"}', "application/json"), fields)
        self.assertEqual(OAuthAuthority.parseRequest(
            b"grant_type=refresh_token&refresh_token=rt-0",
            "application/x-www-form-urlencoded"), fields)

    def test_faults(self):
        """
        Token faults are validated, consumed in order and healed after
        C{times}.
        """
        self.assertRaises(ValueError, parseTokenFaults, {"kind": "nope"})
        self.assertRaises(ValueError, parseTokenFaults, {"kind": "status"})
        self.authority.setFault("o1", [{"kind": "slow", "seconds": 1, "times": 1},
                                       {"kind": "refresh_token_reused"}])
        self.assertEqual(self.authority.takeFault("o1").kind, "slow")
        self.assertEqual(self.authority.takeFault("o1").kind, "refresh_token_reused")
        self.assertEqual(self.authority.takeFault("o1").kind, "refresh_token_reused")
        self.authority.setFault("o1", None)
        self.assertIsNone(self.authority.takeFault("o1"))

    def test_usage(self):
        """
        Used-percent grows with served tokens from the configured base,
        capped at 100, in headers, the WebSocket event and C{wham/usage}.
        """
        self.authority.setUsage("oauth:o1", {"primary_used_percent": 10,
                                             "primary_capacity_tokens": 1000})
        self.authority.served("oauth:o1", 250)
        h = self.authority.usageHeaders("oauth:o1")
        self.assertEqual(h["x-codex-primary-used-percent"], "35")
        self.assertEqual(h["x-codex-plan-type"], "pro")
        self.assertEqual(h["x-codex-primary-reset-at"], str(int(NOW + 300 * 60)))
        event = self.authority.usageEvent("oauth:o1")
        self.assertEqual(event["rate_limits"]["primary"]["used_percent"], 35)
        self.authority.served("oauth:o1", 10**6)
        wham = self.authority.wham("oauth:o1")
        self.assertEqual(wham["rate_limit"]["primary_window"]["used_percent"], 100)
        self.assertTrue(wham["rate_limit"]["limit_reached"])
        self.assertEqual(self.authority.usageHeaders("sk-none"), {})

    def test_reset_credits(self):
        """
        Protocol.md 7.3a: banked resets are listed and counted in
        C{wham/usage}; consuming one restarts both windows at 0 % now and
        spends one credit; the same request id again is C{already_redeemed},
        unused windows C{nothing_to_reset}, none left C{no_credit}.
        """
        self.authority.setUsage("oauth:o1", {"primary_used_percent": 100,
                                             "secondary_used_percent": 40, "reset_credits": 2})
        listed = self.authority.resetCredits("oauth:o1")
        self.assertEqual(listed["available_count"], 2)
        self.assertEqual([c["id"] for c in listed["credits"]], ["rc-1", "rc-2"])
        self.assertEqual(listed["credits"][0]["status"], "available")
        wham = self.authority.wham("oauth:o1")
        self.assertEqual(wham["rate_limit_reset_credits"], {"available_count": 2})
        self.assertTrue(wham["rate_limit"]["limit_reached"])
        self.assertIsNone(self.authority.consumeReset("oauth:o1", {}))
        self.clock.advance(600)
        self.assertEqual(self.authority.consumeReset("oauth:o1", {"redeem_request_id": "r1"}),
                         {"code": "reset", "windows_reset": 2})
        wham = self.authority.wham("oauth:o1")
        self.assertFalse(wham["rate_limit"]["limit_reached"])
        self.assertEqual(wham["rate_limit"]["primary_window"]["used_percent"], 0)
        self.assertEqual(wham["rate_limit"]["primary_window"]["reset_at"],
                         int(NOW + 600 + 300 * 60))
        self.assertEqual(wham["rate_limit_reset_credits"], {"available_count": 1})
        self.assertEqual(self.authority.consumeReset("oauth:o1", {"redeem_request_id": "r1"}),
                         {"code": "already_redeemed", "windows_reset": 0})
        self.assertEqual(self.authority.consumeReset("oauth:o1", {"redeem_request_id": "r2"}),
                         {"code": "nothing_to_reset", "windows_reset": 0})
        self.authority.served("oauth:o1", 1)
        self.authority.setUsage("oauth:o2", {"primary_used_percent": 50})
        self.assertEqual(self.authority.consumeReset("oauth:o2", {"redeem_request_id": "r3"}),
                         {"code": "no_credit", "windows_reset": 0})


class ConfigTests(SynchronousTestCase):
    """
    The emulator configuration's OAuth keys.
    """

    def test_oauthAccounts(self):
        """
        An C{oauth} account needs a name and no credential; C{usage} and
        C{oauth.access_token_ttl} are validated.
        """
        good = {"oauth": {"access_token_ttl": 30},
                "accounts": [{"name": "o1", "type": "oauth", "refresh_token": "rt",
                              "usage": {"primary_used_percent": 5}}]}
        emulator = Emulator(reactor=Clock(), config=good)
        self.assertEqual(emulator.oauth.accessTtl, 30)
        self.assertIn("oauth:o1", emulator.oauth.usage)
        for bad in (
            {"accounts": [{"name": "o1", "type": "oauth", "credential": "x"}]},
            {"accounts": [{"name": "o1", "credential": "x", "refresh_token": "rt"}]},
            {"accounts": [{"name": "o1", "type": "oauth", "usage": {"nope": 1}}]},
            {"oauth": {"access_token_ttl": 0}},
            {"oauth": {"other": 1}},
        ):
            self.assertRaises(EmulatorConfigError, validateConfig, bad)
