"""
Tests for issue 22's admin API (L{relay.control.keys},
L{relay.control.groups}, L{relay.control.prices}): keys issued with a
secret shown once and kept only as a digest, edited, disabled (file keys
too, kept across reloads), revoked at once; account groups; prices over
the file's and the shipped table; all audited without a secret; on a relay
built with a L{MemoryReactorClock} and the memory control store.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from relay.control.plane import LOADING_GRACE_SECONDS
from relay.control.store import ANY
from relay.entry.http import KeyRing
from relay.base.logs import _registered
from relay.base.records import ClientKey
from relay.tenants.keydigest import KEY_PREFIX, keyDigest
from relay.usage.tokens import TokenCounts
from tests.test_control import ADMIN, FILE_KEY, NOW, ControlFixture

FILE_SECRET = "sk-file-key-bob-secret"

KEYS_CONFIG = f"""
listen: "tcp:0:interface=127.0.0.1"
admin_key: {ADMIN}
keys:
  - {{name: bob, key: {FILE_SECRET}, rpm: 5}}
  - {{name: carol, key: sk-file-key-carol-secret, disabled: true}}
groups: {{contractors: [a1]}}
prices: {{gpt-5.5: {{input: 9, output: 90}}}}
accounts:
  - {{id: a1, type: apikey, api_key: {FILE_KEY}, base_url: "http://127.0.0.1:9/v1"}}
  - {{id: a2, type: apikey, api_key: sk-file-account-a2-secret, base_url: "http://127.0.0.1:9/v1"}}
"""


def bearer(secret) -> DummyRequest:
    request = DummyRequest([b"v1", b"responses"])
    request.requestHeaders.setRawHeaders(b"authorization", [b"Bearer " + (
        secret.encode() if isinstance(secret, str) else secret)])
    return request


class KeysFixture(ControlFixture):
    configText = KEYS_CONFIG

    def issue(self, name="alice", **policy):
        status, body = self.call(b"POST", "keys", dict({"name": name}, **policy))
        self.assertEqual(status, 201, body)
        return body

    @property
    def ring(self):
        return self.app.keys

    def policy(self):
        return self.app.extras["keyPolicy"]

    def storeDump(self) -> str:
        store = self.parts.store
        out = []
        for kind in ("key", "key_disabled", "audit", "group", "prices"):
            for record in self.successResultOf(store.list(kind)):
                out.append(json.dumps(record.data))
        return "\n".join(out)


class IssueTests(KeysFixture, SynchronousTestCase):
    """
    C{POST /admin/keys}.
    """

    def test_secretShownOnceStoredAsDigest(self):
        """
        The answer holds the new secret (C{sk-relay-} and 43 random
        characters) once; the store holds its SHA-256 digest and never the
        secret; reading the keys back shows neither; the ring authenticates
        the secret; the secret is registered for log redaction; the audit
        names the key and the fields only.
        """
        body = self.issue("alice", rpm=3, models=["gpt-5.5"], label="Alice's laptop")
        secret = body["secret"]
        self.assertTrue(secret.startswith(KEY_PREFIX))
        self.assertEqual(len(secret), len(KEY_PREFIX) + 43)
        self.assertEqual(body["key"]["policy"]["rpm"], 3)
        self.assertEqual(body["key"]["source"], "admin")
        self.assertEqual(body["key"]["hint"], KEY_PREFIX + "\u2026" + secret[-4:])
        record = self.successResultOf(self.parts.store.get("key", "alice"))
        self.assertEqual(record.data["digest"], hashlib.sha256(secret.encode()).hexdigest())
        self.assertNotIn(secret, self.storeDump())
        self.assertNotIn(secret[len(KEY_PREFIX):], self.storeDump())
        for path in ("keys", "keys/alice"):
            status, _ = self.call(b"GET", path)
            self.assertEqual(status, 200)
            self.assertNotIn(secret.encode(), self.lastRaw)
            self.assertNotIn(record.data["digest"].encode(), self.lastRaw)
        key = self.ring.authenticate(bearer(secret))
        self.assertEqual((key.name, key.rpm, key.models, key.key), ("alice", 3, ("gpt-5.5",), ""))
        self.assertIn(secret, _registered)
        [entry] = [e for e in self.audit() if e["action"] == "key.create"]
        self.assertEqual((entry["target"], entry["address"], entry["status"]),
                         ("alice", "10.1.2.3", 201))
        self.assertNotIn(secret, json.dumps(entry))
        self.assertEqual(entry["detail"]["fields"], ["label", "models", "name", "rpm"])

    def test_storedDigestIsNotAKey(self):
        """
        The stored digest (hex, as a stolen database holds it, or raw) is
        refused by the ring on every way a key is presented.
        """
        secret = self.issue()["secret"]
        digest = self.successResultOf(self.parts.store.get("key", "alice")).data["digest"]
        for stolen in (digest, digest.upper(), bytes.fromhex(digest)):
            self.assertIsNone(self.ring.authenticate(bearer(stolen)))
            if isinstance(stolen, str):
                self.assertIsNone(self.ring.authenticateHeader("Bearer " + stolen))
                self.assertIsNone(self.ring.authenticateHeader(stolen))
            request = DummyRequest([b"v1"])
            request.requestHeaders.setRawHeaders(
                b"x-api-key", [stolen.encode() if isinstance(stolen, str) else stolen])
            self.assertIsNone(self.ring.authenticate(request))
        self.assertIsNotNone(self.ring.authenticateHeader("Bearer " + secret))

    def test_everySecretIsNew(self):
        """
        Two keys never get the same secret.
        """
        self.assertNotEqual(self.issue("k1")["secret"], self.issue("k2")["secret"])

    def test_validation(self):
        """
        Each bad field is a 400 naming it; nothing is written.
        """
        cases = [
            ({"name": "bad name"}, "name"),
            ({}, "name"),
            ({"name": "x", "key": "sk-mine"}, "key"),
            ({"name": "x", "key_env": "K"}, "key_env"),
            ({"name": "x", "disabled": True}, "disabled"),
            ({"name": "x", "colour": "red"}, "colour"),
            ({"name": "x", "rpm": 0}, "rpm"),
            ({"name": "x", "rpm": "many"}, "rpm"),
            ({"name": "x", "expires_at": "next tuesday"}, "expires_at"),
            ({"name": "x", "accounts": ["nope"]}, "accounts"),
            ({"name": "x", "group": "nope"}, "group"),
            ({"name": "x", "models": "gpt-5.5"}, "models"),
            ({"name": "x", "label": 7}, "label"),
            ({"name": "x", "max_turn_output_tokens": "lots"}, "max_turn_output_tokens"),
            ({"name": "x", "max_turn_output_tokens": 0}, "max_turn_output_tokens"),
        ]
        for body, param in cases:
            status, answer = self.call(b"POST", "keys", body)
            self.assertEqual((status, answer["error"]["param"]), (400, param), (body, answer))
        status, answer = self.call(b"POST", "keys", {"name": "x", "accounts": ["a1"],
                                                     "group": "contractors"})
        self.assertEqual(status, 400, answer)
        self.assertIn("not both", answer["error"]["message"])
        self.assertEqual(self.successResultOf(self.parts.store.list("key")), [])

    def test_nameClash(self):
        """
        A name the file uses or an admin key has is a 409.
        """
        status, body = self.call(b"POST", "keys", {"name": "bob"})
        self.assertEqual(status, 409)
        self.assertIn(self.path, body["error"]["message"])
        self.issue("alice")
        self.assertEqual(self.call(b"POST", "keys", {"name": "alice"})[0], 409)

    def test_expiresAtAcceptsISO(self):
        """
        C{expires_at} is an ISO 8601 time or Unix seconds, as in the file.
        """
        body = self.issue("c", expires_at="2027-03-01T00:00:00Z")
        self.assertEqual(body["key"]["policy"]["expires_at"], 1803859200.0)
        self.assertFalse(body["key"]["expired"])

    def test_expiresAtBeforeTheEpoch(self):
        """
        An C{expires_at} before 1970 is a 400 naming it, in ISO 8601 as in
        Unix seconds, and nothing is written: once stored, such a time
        (negative seconds) would no longer validate, and the key would be
        saved but never in force, missing from the list, and its name
        taken. The epoch itself is accepted (a key already expired).
        """
        for value in ("0001-01-01T00:00:00Z", "1900-01-01T00:00:00Z",
                      "1969-12-31T23:59:59Z", -1):
            status, answer = self.call(b"POST", "keys", {"name": "old", "expires_at": value})
            self.assertEqual((status, answer["error"]["param"]), (400, "expires_at"), value)
            if isinstance(value, str):
                self.assertIn("1970-01-01", answer["error"]["message"])
        self.assertEqual(self.successResultOf(self.parts.store.list("key")), [])
        self.assertEqual(self.issue("old", expires_at="1970-01-01T00:00:00Z")["key"]["expired"],
                         True)

    def test_storedPolicyReadsBack(self):
        """
        Whatever C{POST /admin/keys} accepts is stored in a form that
        validates again when the key is read back (L{keyFromRecord}) to the
        same values: ISO 8601 times from year 1 to 9999, Unix seconds,
        the other policy fields.
        """
        import datetime

        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        from relay.configuration.parse import ConfigError
        from relay.control.keys.records import storedPolicy, validatePolicy

        instants = st.one_of(
            st.datetimes(timezones=st.just(datetime.timezone.utc)).map(
                lambda d: d.isoformat().replace("+00:00", "Z")),
            st.datetimes().map(datetime.datetime.isoformat),
            st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12),
            st.integers(min_value=-10**12, max_value=10**12),
        )
        policies = st.fixed_dictionaries({}, optional={
            "expires_at": instants,
            "rpm": st.integers(min_value=-2, max_value=10**6),
            "daily_usd": st.floats(allow_nan=False, allow_infinity=False, min_value=-5,
                                   max_value=1e6),
            "models": st.lists(st.sampled_from(["gpt-5.5", "gpt-5.4-mini"]), max_size=2),
        })

        @settings(max_examples=300, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(policies)
        def readsBack(values):
            try:
                converted = validatePolicy(values)
            except ConfigError:
                return
            stored = storedPolicy(converted)
            self.assertEqual(storedPolicy(validatePolicy(json.loads(json.dumps(stored)))),
                             stored)

        readsBack()

    def test_guarded(self):
        """
        R99: without the admin key, a client key (even a new one) gets 401
        and nothing is issued.
        """
        secret = self.issue()["secret"]
        for key in (None, secret, FILE_SECRET):
            self.assertEqual(self.call(b"POST", "keys", {"name": "z"}, key=key)[0], 401)
            self.assertEqual(self.call(b"GET", "keys", key=key)[0], 401)
        self.assertIsNone(self.ring.byName("z"))


class EditTests(KeysFixture, SynchronousTestCase):
    """
    C{PATCH /admin/keys/{name}}.
    """

    def test_patch(self):
        """
        Policy fields change at once (a socket's key object finds the new
        version through L{KeyRing.current}); C{null} removes a limit;
        setting C{group} drops C{accounts}; audited with field names.
        """
        secret = self.issue("alice", rpm=3, accounts=["a2"])["secret"]
        before = self.ring.authenticate(bearer(secret))
        status, body = self.call(b"PATCH", "keys/alice", {"rpm": None, "tpm": 900,
                                                           "group": "contractors",
                                                           "label": "team"})
        self.assertEqual(status, 200, body)
        self.assertEqual(body["changed"], ["group", "label", "rpm", "tpm"])
        now = self.ring.current(before)
        self.assertEqual((now.rpm, now.tpm, now.group, now.accounts), (None, 900, "contractors",
                                                                         None))
        self.assertEqual(self.policy().allowedAccounts(now), frozenset({"a1"}))
        self.assertEqual(body["key"]["label"], "team")
        self.assertEqual(self.audit()[0]["action"], "key.update")

    def test_refused(self):
        """
        A file key's fields are the file's (409 naming the file); unknown
        keys are 404; an empty or bad change is a 400.
        """
        status, body = self.call(b"PATCH", "keys/bob", {"rpm": 9})
        self.assertEqual(status, 409)
        self.assertIn(self.path, body["error"]["message"])
        self.assertIn("disable", body["error"]["message"])
        self.assertEqual(self.call(b"PATCH", "keys/zz", {"rpm": 9})[0], 404)
        self.issue("alice")
        self.assertEqual(self.call(b"PATCH", "keys/alice", {})[0], 400)
        self.assertEqual(self.call(b"PATCH", "keys/alice", {"name": "x"})[0], 400)
        self.assertEqual(self.call(b"PATCH", "keys/alice", {"key": "sk-x"})[0], 400)
        self.assertEqual(self.call(b"PATCH", "keys/alice", {"daily_usd": -1})[0], 400)

    def test_patchExpiresAtBeforeTheEpoch(self):
        """
        A C{PATCH} to an C{expires_at} before 1970 is a 400 naming it and
        changes nothing: the key stays listed, in force, with its old
        C{expires_at}.
        """
        secret = self.issue("alice", expires_at="2030-01-01T00:00:00Z")["secret"]
        status, answer = self.call(b"PATCH", "keys/alice", {"expires_at": "1900-01-01T00:00:00Z"})
        self.assertEqual((status, answer["error"]["param"]), (400, "expires_at"), answer)
        self.assertEqual([k["name"] for k in self.call(b"GET", "keys")[1]["keys"]
                          if k["name"] == "alice"], ["alice"])
        key = self.ring.authenticate(bearer(secret))
        self.assertEqual(key.expires_at, 1893456000.0)

    def test_budgetsFollow(self):
        """
        A budget set or removed through the API is enforced from the next
        turn (the usage ledger's budgets follow the ring).
        """
        usage = self.app.extras["usage"]
        self.issue("alice", daily_tokens=100, daily_usd=2.5)
        self.assertEqual(usage.budgets["alice"], (100, None))
        self.assertEqual(usage.moneyBudgets["alice"], (2.5, None))
        usage.record("alice", "a1", "gpt-5.5", TokenCounts(1, 80, 0, 30, 0))
        self.assertEqual(usage.overBudget("alice", NOW).code, "insufficient_quota")
        self.call(b"PATCH", "keys/alice", {"daily_tokens": None, "daily_usd": None})
        self.assertNotIn("alice", usage.budgets)
        self.assertIsNone(usage.overBudget("alice", NOW))


class RevokeTests(KeysFixture, SynchronousTestCase):
    """
    C{DELETE /admin/keys/{name}}.
    """

    def test_revokedAtOnce(self):
        """
        Once answered, the key authenticates nowhere and a socket's key
        object has no current version (its next turn is a close 1008);
        audited; the file's keys stay.
        """
        secret = self.issue("alice")["secret"]
        held = self.ring.authenticate(bearer(secret))
        status, body = self.call(b"DELETE", "keys/alice")
        self.assertEqual((status, body), (200, {"deleted": "alice"}))
        self.assertIsNone(self.ring.authenticate(bearer(secret)))
        self.assertIsNone(self.ring.authenticateHeader(secret))
        self.assertIsNone(self.ring.current(held))
        self.assertEqual(self.call(b"DELETE", "keys/alice")[0], 404)
        self.assertEqual(self.audit()[0]["action"], "key.delete")
        self.assertEqual(self.ring.authenticate(bearer(FILE_SECRET)).name, "bob")

    def test_fileKeyIsTheFiles(self):
        """
        A file key cannot be deleted (409 naming the file).
        """
        status, body = self.call(b"DELETE", "keys/bob")
        self.assertEqual(status, 409)
        self.assertIn(self.path, body["error"]["message"])

    def test_anotherProcessesRevocationApplies(self):
        """
        A key deleted by another process (its store write's notification)
        is gone here too.
        """
        secret = self.issue("alice")["secret"]
        self.successResultOf(self.parts.store.delete("key", "alice", ANY))
        self.assertIsNone(self.ring.authenticate(bearer(secret)))

    def test_newKeyOfTheSameNameIsAnotherKey(self):
        """
        A key issued again under a revoked key's name has a new secret: the
        old one stays refused, and an old disable does not carry over.
        """
        old = self.issue("alice")["secret"]
        self.call(b"POST", "keys/alice/disable")
        self.successResultOf(self.parts.store.delete("key", "alice", ANY))
        new = self.issue("alice")["secret"]
        self.assertIsNone(self.ring.authenticate(bearer(old)))
        self.assertFalse(self.ring.authenticate(bearer(new)).disabled)


class DisableTests(KeysFixture, SynchronousTestCase):
    """
    C{POST /admin/keys/{name}/disable} and C{/enable}.
    """

    def test_disableAFileKey(self):
        """
        A file key disabled through the API is refused (401
        C{api_key_disabled}, close 1008) until enabled; the view says who
        disabled it and why.
        """
        status, body = self.call(b"POST", "keys/bob/disable", {"reason": "left the team"})
        self.assertEqual(status, 200, body)
        view = body["key"]
        self.assertEqual((view["disabled"], view["disabled_by"], view["disabled_reason"],
                          view["source"]), (True, "admin", "left the team", "file"))
        key = self.ring.authenticate(bearer(FILE_SECRET))
        error = self.policy().keyRefusal(key, NOW)
        self.assertEqual((error.status, error.code, error.wsClose[0]),
                         (401, "api_key_disabled", 1008))
        self.assertEqual(self.call(b"POST", "keys/bob/enable")[0], 200)
        self.assertIsNone(self.policy().keyRefusal(self.ring.authenticate(bearer(FILE_SECRET)),
                                                   NOW))
        self.assertEqual([e["action"] for e in self.audit()][:2], ["key.enable", "key.disable"])

    def test_disablePersistsAcrossReload(self):
        """
        A reload of the file keeps an API disable (as account pauses).
        """
        self.call(b"POST", "keys/bob/disable")
        with open(self.path, "w") as f:
            f.write(KEYS_CONFIG.replace("rpm: 5", "rpm: 6"))
        result = self.app.reloader.reload("admin")
        self.assertTrue(result.applied, result.problems)
        key = self.ring.authenticate(bearer(FILE_SECRET))
        self.assertEqual((key.rpm, key.disabled), (6, True))

    def test_fileDisabledStaysDisabled(self):
        """
        A key the file disables cannot be enabled here (409 naming the
        file); unknown keys are 404; a reason is short text.
        """
        status, body = self.call(b"POST", "keys/carol/enable")
        self.assertEqual(status, 409)
        self.assertIn("disabled: true", body["error"]["message"])
        self.assertEqual(self.call(b"POST", "keys/zz/disable")[0], 404)
        self.assertEqual(self.call(b"POST", "keys/bob/disable", {"reason": 5})[0], 400)
        self.assertEqual(self.call(b"POST", "keys/bob/disable", {"why": "x"})[0], 400)

    def test_disableAnAdminKey(self):
        """
        An admin key is disabled the same way; a delete removes its disable.
        """
        secret = self.issue("alice")["secret"]
        self.call(b"POST", "keys/alice/disable")
        self.assertTrue(self.ring.authenticate(bearer(secret)).disabled)
        self.call(b"DELETE", "keys/alice")
        self.assertIsNone(self.successResultOf(self.parts.store.get("key_disabled", "alice")))


class ListTests(KeysFixture, SynchronousTestCase):
    """
    C{GET /admin/keys}.
    """

    def test_everyKeyWithUsageAndCost(self):
        """
        File keys (in file order) then admin keys, each with its source,
        policy, state, and usage and cost today and this month.
        """
        self.issue("alice", daily_usd=5)
        usage = self.app.extras["usage"]
        usage.record("alice", "a1", "gpt-5.5",
                     self.app.extras["prices"].priced("gpt-5.5", TokenCounts(1, 1000, 0, 100, 0)))
        status, body = self.call(b"GET", "keys")
        self.assertEqual(status, 200)
        rows = {k["name"]: k for k in body["keys"]}
        self.assertEqual([k["name"] for k in body["keys"]], ["bob", "carol", "alice"])
        self.assertEqual((rows["bob"]["source"], rows["bob"]["policy"]["rpm"]), ("file", 5))
        self.assertEqual((rows["carol"]["disabled"], rows["carol"]["disabled_by"]), (True, "file"))
        today = rows["alice"]["usage"]["today"]
        # The file's price of gpt-5.5: $9 in, $90 out per 1M.
        self.assertEqual((today["requests"], today["total_tokens"], today["cost_usd"]),
                         (1, 1100, 0.018))
        self.assertEqual(rows["alice"]["usage"]["month"]["cost_usd"], 0.018)
        self.assertEqual(rows["bob"]["usage"]["today"]["requests"], 0)
        self.assertNotIn(FILE_SECRET.encode(), self.lastRaw)
        self.assertEqual(self.call(b"GET", "keys/nope")[0], 404)


class RingTests(SynchronousTestCase):
    """
    L{KeyRing}: one digest and one lookup per request.
    """

    def test_oneDigestOneCompare(self):
        """
        Authenticating among 2,000 keys hashes the presented secret once and
        compares one digest in constant time (no scan of the keys).
        """
        import relay.frontdoor.keyring as http

        ring = KeyRing([ClientKey(name=f"k{i}", key=f"sk-file-{i}") for i in range(2000)])
        digests, compares = [], []
        self.patch(http, "keyDigest", lambda s: digests.append(s) or keyDigest(s))
        real = hmac.compare_digest
        self.patch(http.hmac, "compare_digest", lambda a, b: compares.append(1) or real(a, b))
        self.assertEqual(ring.authenticate(bearer("sk-file-1234")).name, "k1234")
        self.assertEqual((len(digests), len(compares)), (1, 1))
        self.assertIsNone(ring.authenticate(bearer("sk-file-nope")))
        self.assertEqual(len(digests), 2)

    def test_layers(self):
        """
        Admin keys come after the file's; an admin name wins over a file
        entry of the same name; disables set C{disabled}; a change is told
        to subscribers once.
        """
        ring = KeyRing([ClientKey(name="a", key="sk-a"), ClientKey(name="b", key="sk-b")])
        told = []
        ring.subscribe(lambda: told.append(1))
        admin = ClientKey(name="b", key="", digest=keyDigest("sk-new-b"))
        ring.replaceAdmin([admin], {"a"})
        self.assertEqual([(k.name, k.disabled) for k in ring.keys], [("a", True), ("b", False)])
        self.assertIsNone(ring.authenticateHeader("sk-b"))
        self.assertEqual(ring.authenticateHeader("sk-new-b").name, "b")
        ring.replaceAdmin([admin], {"a"})
        self.assertEqual(told, [1])


class LoadingTests(KeysFixture, SynchronousTestCase):
    """
    Until the control store is first read (a Redis store at start), no key
    is served: a disable must not slip through.
    """

    def test_pendingUntilRead(self):
        never = Deferred()
        self.patch(type(self.parts.store), "list", lambda this, kind: never)
        self.plane._loaded = False
        self.plane.start()
        key = self.ring.authenticate(bearer(FILE_SECRET))
        error = self.policy().keyRefusal(key, NOW)
        self.assertEqual((error.status, error.code), (503, "keys_loading"))
        self.assertFalse(self.plane.ready)
        self.reactor.advance(LOADING_GRACE_SECONDS + 1)
        self.assertIsNone(self.policy().keyRefusal(key, NOW))
        self.flushLoggedErrors()

    def test_readyOnceRead(self):
        """
        A store that answers ends the wait at once.
        """
        self.plane._loaded = False
        self.plane.start()
        self.assertFalse(self.ring.pending)
        self.assertTrue(self.plane.ready)


class ReloadTests(KeysFixture, SynchronousTestCase):
    """
    A reload keeps the admin keys and refuses a clash.
    """

    def write(self, text):
        with open(self.path, "w") as f:
            f.write(text)

    def test_reloadKeepsAdminKeys(self):
        secret = self.issue("alice")["secret"]
        self.write(KEYS_CONFIG.replace("rpm: 5", "rpm: 7"))
        self.assertTrue(self.app.reloader.reload("admin").applied)
        self.assertEqual(self.ring.authenticate(bearer(secret)).name, "alice")

    def test_reloadRefusesAKeyNameClash(self):
        self.issue("alice")
        self.write(KEYS_CONFIG.replace("keys:\n", "keys:\n  - {name: alice, key: sk-f-alice}\n"))
        result = self.app.reloader.reload("admin")
        self.assertFalse(result.applied)
        self.assertIn("'alice' is already a key issued through the admin API",
                      " ".join(result.problems))

    def test_reloadRefusesDroppingAGroupAnAdminKeyUses(self):
        self.issue("alice", group="contractors")
        self.write(KEYS_CONFIG.replace("groups: {contractors: [a1]}\n", ""))
        result = self.app.reloader.reload("admin")
        self.assertFalse(result.applied)
        self.assertIn("'contractors' is the group of the admin key 'alice'",
                      " ".join(result.problems))


class GroupTests(KeysFixture, SynchronousTestCase):
    """
    C{/admin/groups}.
    """

    def test_addUseDelete(self):
        """
        An admin group can be added, a key bound to it reaches only its
        accounts, it cannot be deleted while bound, and the file's group is
        read-only.
        """
        status, body = self.call(b"PUT", "groups/staff", {"accounts": ["a2"], "label": "s"})
        self.assertEqual(status, 201, body)
        self.issue("alice", group="staff")
        key = self.ring.byName("alice")
        self.assertEqual(self.policy().allowedAccounts(key), frozenset({"a2"}))
        status, body = self.call(b"GET", "groups")
        self.assertEqual([(g["name"], g["source"], g["accounts"], g["keys"])
                          for g in body["groups"]],
                         [("contractors", "file", ["a1"], []), ("staff", "admin", ["a2"],
                                                                ["alice"])])
        self.assertEqual(self.call(b"PUT", "groups/staff", {"accounts": ["a1", "a2"]})[0], 200)
        self.assertEqual(self.policy().allowedAccounts(key), frozenset({"a1", "a2"}))
        status, body = self.call(b"DELETE", "groups/staff")
        self.assertEqual(status, 409)
        self.assertIn("alice", body["error"]["message"])
        self.call(b"PATCH", "keys/alice", {"group": None})
        self.assertEqual(self.call(b"DELETE", "groups/staff")[0], 200)
        self.assertEqual(self.call(b"PUT", "groups/contractors", {"accounts": ["a2"]})[0], 409)
        self.assertEqual(self.call(b"DELETE", "groups/contractors")[0], 409)
        self.assertEqual(self.call(b"PUT", "groups/x", {"accounts": ["zz"]})[0], 400)
        self.assertEqual(self.call(b"PUT", "groups/x", {"accounts": []})[0], 400)
        self.assertEqual([e["action"] for e in self.audit()][:2], ["group.delete",
                                                                   "key.update"])


class PriceTests(KeysFixture, SynchronousTestCase):
    """
    C{/admin/prices}.
    """

    def prices(self):
        status, body = self.call(b"GET", "prices")
        self.assertEqual(status, 200)
        return body["prices"]

    def test_layers(self):
        """
        The admin API's prices win over the file's, which win over the
        shipped ones; each says its source; the cost of a turn follows;
        C{PUT {}} brings the file's back.
        """
        table = self.app.extras["prices"]
        self.assertEqual(self.prices()["gpt-5.5"]["source"], "config")
        self.assertEqual(self.prices()["gpt-5.4"]["source"], "default")
        status, body = self.call(b"PUT", "prices", {"prices": {
            "gpt-5.5": {"input": 1, "output": 2}, "my-model": {"input": 3, "output": 4,
                                                               "cached_input": 0.5}}})
        self.assertEqual(status, 200, body)
        self.assertEqual(body["prices"]["gpt-5.5"], {"input": 1, "cached_input": 1, "output": 2,
                                                     "reasoning": 2, "source": "admin"})
        self.assertEqual(body["prices"]["my-model"]["source"], "admin")
        self.assertEqual(table.cost("gpt-5.5", TokenCounts(1, 1_000_000, 0, 0, 0)), 10**9)
        self.assertEqual(self.call(b"PUT", "prices", {"prices": {}})[0], 200)
        self.assertEqual(self.prices()["gpt-5.5"]["source"], "config")
        self.assertNotIn("my-model", self.prices())
        self.assertEqual(self.audit()[0]["action"], "prices.update")

    def test_oneModel(self):
        """
        One model's price set and removed; removing a price the API did not
        set is a 404.
        """
        self.assertEqual(self.call(b"PUT", "prices/o3", {"input": 5, "output": 6})[0], 200)
        self.assertEqual(self.prices()["o3"]["input"], 5)
        self.assertEqual(self.call(b"DELETE", "prices/o3")[0], 200)
        self.assertEqual(self.prices()["o3"]["source"], "default")
        self.assertEqual(self.call(b"DELETE", "prices/o3")[0], 404)
        self.assertEqual([e["action"] for e in self.audit()][:2], ["prices.delete",
                                                                   "prices.set"])

    def test_validation(self):
        """
        A bad price is a 400 naming the field; nothing changes.
        """
        for body in ({"prices": {"m": {"input": 1}}}, {"prices": {"m": {"input": -1,
                                                                          "output": 1}}},
                     {"prices": {"m": {"input": 1, "output": 1, "cost": 2}}}, {"prices": 3},
                     {"other": {}}):
            status, answer = self.call(b"PUT", "prices", body)
            self.assertEqual(status, 400, (body, answer))
        self.assertEqual(self.call(b"PUT", "prices/m", {"output": 1})[0], 400)
        self.assertNotIn("m", self.prices())

    def test_servedPrices(self):
        """
        R109: tier multipliers, hosted tools per call and C{default} are set
        like a model's price, type-checked (400 naming the field), listed
        with their source, and in force.
        """
        table = self.app.extras["prices"]
        status, body = self.call(b"PUT", "prices", {"prices": {
            "ft:x": {"input": 1, "output": 2, "priority": 3, "flex": 0.25},
            "image_generation": {"per_call": 0.04},
            "default": {"input": 9, "output": 9, "per_call": 0.5}}})
        self.assertEqual(status, 200, body)
        self.assertEqual(body["prices"]["image_generation"], {"per_call": 0.04, "source": "admin"})
        self.assertEqual(body["prices"]["web_search"], {"per_call": 0.01, "source": "default"})
        self.assertEqual(body["prices"]["default"]["per_call"], 0.5)
        self.assertEqual(body["prices"]["ft:x"]["priority"], 3)
        self.assertEqual(table.missing("ft:x", "priority", ("image_generation",)), [])
        self.assertEqual(table.default.input, 9)
        for bad in ({"image_generation": {"per_call": "1"}}, {"web_search": {"input": 1}},
                    {"ft:x": {"input": 1, "output": 1, "priority": [2]}},
                    {"ft:x": {"input": 1, "output": 1, "per_call": 1}},
                    {"default": {"input": 1, "output": 1, "flex": True}}):
            status, answer = self.call(b"PUT", "prices", {"prices": bad})
            self.assertEqual(status, 400, (bad, answer))
        self.assertEqual(self.call(b"PUT", "prices/default", {"output": 1})[0], 400)
        self.assertEqual(self.prices()["image_generation"]["per_call"], 0.04)

    def test_persistsAcrossReload(self):
        """
        A reload replaces the file's prices and keeps the admin API's.
        """
        self.call(b"PUT", "prices/o3", {"input": 5, "output": 6})
        with open(self.path, "w") as f:
            f.write(KEYS_CONFIG.replace("gpt-5.5: {input: 9, output: 90}",
                                        "gpt-5.5: {input: 8, output: 80}"))
        self.assertTrue(self.app.reloader.reload("admin").applied)
        prices = self.prices()
        self.assertEqual((prices["o3"]["source"], prices["gpt-5.5"]["input"]), ("admin", 8))

    def test_anotherProcessesPricesApply(self):
        """
        Prices written by another process are in force here.
        """
        self.successResultOf(self.parts.store.put("prices", "admin", {"prices": {
            "o3": {"input": 7, "output": 7}}}, None))
        self.assertEqual(self.prices()["o3"]["source"], "admin")


class OwnerIdentityTests(KeysFixture, SynchronousTestCase):
    """
    R104 across key names (issues 19 and 22 merged): what a key creates is
    owned by its owner identity (L{ClientKey.ownerId}) -- an admin key's
    name and its issuance, a file key's name -- so a key issued again under
    a revoked key's name cannot continue the old key's conversations, while
    an edit, or a file key whose secret an operator rotates, keeps them.
    (Before, owner records held the bare name: the new "alice" continued
    the revoked "alice"'s chains.)
    """

    def turn(self, key, previous=None):
        from relay.base.records import Turn

        return Turn(entrypoint="http", endpoint="responses", client=key, model="gpt-5.5",
                    body={"input": "hi"}, stream=False, requestId="req-owner",
                    previousResponseId=previous)

    def record(self, key, responseId):
        account = self.app.live.accounts.byId("a1")
        self.successResultOf(self.app.scheduler.recordResponse(self.turn(key), responseId,
                                                               account))

    def test_reissuedNameIsAnotherOwner(self):
        old = self.ring.authenticate(bearer(self.issue("alice")["secret"]))
        self.record(old, "resp_alice_1")
        found = self.successResultOf(self.app.scheduler.lookupResponse("resp_alice_1"))
        self.assertEqual(found, ("a1", old.ownerId))
        self.assertNotEqual(old.ownerId, "alice")
        status, _ = self.call(b"DELETE", "keys/alice")
        self.assertEqual(status, 200)
        new = self.ring.authenticate(bearer(self.issue("alice")["secret"]))
        self.assertEqual(new.name, "alice")
        self.assertNotEqual(new.ownerId, old.ownerId)
        failure = self.failureResultOf(
            self.app.scheduler.select(self.turn(new, "resp_alice_1")))
        error = failure.value.error
        self.assertEqual((error.status, error.param), (400, "previous_response_id"))
        self.assertNotIn(old.ownerId.partition("#")[2],
                         json.dumps(self.call(b"GET", "keys/alice")[1]))

    def test_editKeepsTheOwner(self):
        before = self.ring.authenticate(bearer(self.issue("alice")["secret"]))
        self.record(before, "resp_alice_2")
        status, _ = self.call(b"PATCH", "keys/alice", {"rpm": 9})
        self.assertEqual(status, 200)
        after = self.ring.current(before)
        self.assertEqual((after.rpm, after.ownerId), (9, before.ownerId))
        selection = self.successResultOf(
            self.app.scheduler.select(self.turn(after, "resp_alice_2")))
        self.assertEqual(selection.account.id, "a1")
        selection.lease.release()

    def test_fileKeyRotationKeepsTheOwner(self):
        bob = self.ring.authenticate(bearer(FILE_SECRET))
        self.assertEqual(bob.ownerId, "bob")
        self.record(bob, "resp_bob_1")
        self.ring.replace([ClientKey(name="bob", key="sk-file-key-bob-rotated")])
        rotated = self.ring.authenticate(bearer("sk-file-key-bob-rotated"))
        self.assertEqual(rotated.ownerId, "bob")
        selection = self.successResultOf(
            self.app.scheduler.select(self.turn(rotated, "resp_bob_1")))
        self.assertEqual(selection.account.id, "a1")
        selection.lease.release()
