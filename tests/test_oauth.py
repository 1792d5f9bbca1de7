"""
Issue 12 unit tests (SynchronousTestCase, Clock, fakes): token claims and
records, Codex C{auth.json} and C{relay-import-codex-auth}, the token
endpoint's reply classification, the token stores' contract (memory and a
real SQLite file), and L{OAuthCredentials}: seeding and store precedence,
proactive refresh on the clock, persistence before use, single flight in
the process and across holders of the store lock, C{needs_login}, backoff,
the in-doubt rule, and the 401 invalidation.
"""

from __future__ import annotations

import io
import json
import os
import stat

import jwt
from attrs import define, evolve, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from relay.interfaces import ICredentialSource, ITokenEndpoint, ITokenStore
from relay.base.records import Account, GatewaySettings, OAuthSettings
from relay.oauth import authfile
from relay.oauth.credentials import LOCK_TTL_SECONDS, OAuthCredentials
from relay.oauth.endpoint import NotSent, TokenReply
from relay.oauth.store import MemoryTokenStore, SQLiteTokenStore
from relay.oauth.tokens import (
    AUTH_CLAIM,
    STATUS_IN_DOUBT,
    STATUS_NEEDS_LOGIN,
    TokenRecord,
    TokenSet,
    accountIdOf,
    claims,
    expiresAt,
    fingerprint,
)
from relay.state.settings import RuntimeSettings
from relay.state.settingsdb import SQLiteSettingsStore
from tests.test_settings import synchronousPool

NOW = 1_800_000_000.0


def token(exp, iat=None, account="acct-1", plan="plus") -> str:
    """
    An unsigned-looking JWT (HS256 with a test key) with C{exp}, C{iat} and
    the account claim.
    """
    body = {"exp": int(exp), AUTH_CLAIM: {"chatgpt_account_id": account,
                                          "chatgpt_plan_type": plan}}
    if iat is not None:
        body["iat"] = int(iat)
    return jwt.encode(body, b"k" * 32, algorithm="HS256")


def account(accountId="o1", access=None, refresh="rt-0", **kw) -> Account:
    return Account(
        id=accountId, type="oauth", base_url="https://chatgpt.com/backend-api/codex",
        credential=access if access is not None else token(NOW + 3600, NOW),
        refresh_token=refresh, chatgpt_account_id="acct-1", **kw,
    )


@implementer(ITokenEndpoint)
@define(eq=False)
class FakeEndpoint:
    """
    An L{ITokenEndpoint} whose answers the test controls: each call gets a
    Deferred the test fires (or an immediate reply from C{auto}).

    @ivar calls: (account id, refresh token) per call.
    @ivar pending: the Deferreds of unanswered calls.
    @ivar auto: a callable (refresh token) -> reply, or L{None} to hold.
    """

    calls: list = field(factory=list)
    pending: list = field(factory=list)
    auto: object = None

    def refresh(self, account, refreshToken, timeout):
        """
        See L{ITokenEndpoint.refresh}.
        """
        self.calls.append((account.id, refreshToken))
        if self.auto is not None:
            result = self.auto(refreshToken)
            return fail(result) if isinstance(result, Exception) else succeed(result)
        d = Deferred()
        self.pending.append(d)
        return d


def rotated(n, exp=NOW + 7200) -> TokenReply:
    """
    A successful token reply with access token #n and refresh token rt-n.
    """
    return TokenReply(200, {"access_token": token(exp, NOW, account=f"acct-{n}"),
                            "refresh_token": f"rt-{n}", "id_token": None})


class TokensTests(SynchronousTestCase):
    """
    Token claims and the persisted record.
    """

    def test_claims(self):
        """
        protocol.md 7.4: C{exp} and the C{https://api.openai.com/auth}
        account id are read without verifying the signature; anything that
        is not a JWT has no claims.
        """
        t = token(NOW + 10, NOW, account="acct-x")
        self.assertEqual(expiresAt(t), NOW + 10)
        self.assertEqual(accountIdOf("opaque", t), "acct-x")
        self.assertEqual(claims("not-a-jwt"), {})
        self.assertEqual(claims("a.b.c"), {})
        self.assertIsNone(expiresAt(None))

    def test_recordRoundTrip(self):
        """
        A record survives its JSON form; junk reads as L{None}; the
        fingerprint never contains the secret.
        """
        tokens = TokenSet.fromTokens(token(NOW + 60, NOW), "rt-1", None, NOW)
        record = TokenRecord(tokens=tokens, version=3, seed="abc", status=STATUS_IN_DOUBT,
                             in_flight={"owner": "x", "since": NOW}, failures=2)
        self.assertEqual(TokenRecord.fromJSON(record.toJSON()), record)
        self.assertIsNone(TokenRecord.fromJSON("nope"))
        self.assertIsNone(TokenRecord.fromJSON(None))
        self.assertNotIn("rt-1", fingerprint("rt-1"))
        self.assertEqual(len(fingerprint("rt-1", None)), 16)
        self.assertNotIn("rt-1", repr(tokens))

    def test_expiresIn(self):
        """
        Without a JWC C{exp} the token response's C{expires_in} gives the
        expiry.
        """
        tokens = TokenSet.fromTokens("opaque", "rt", None, NOW, expiresIn=100)
        self.assertEqual((tokens.expires_at, tokens.issued_at), (NOW + 100, NOW))


class TokenReplyTests(SynchronousTestCase):
    """
    protocol.md 7.4: which token endpoint answers need a new login.
    """

    def test_classification(self):
        """
        The permanent codes (as C{error} strings or C{error.code}) and any
        401 need a login; 5xx, 429 and other 4xx are transient.
        """
        cases = [
            (400, {"error": "invalid_grant"}, True),
            (401, {"error": {"code": "refresh_token_reused"}}, True),
            (400, {"error": {"code": "refresh_token_expired"}}, True),
            (400, {"error": {"type": "refresh_token_invalidated"}}, True),
            (401, {"error": "invalid_client"}, True),
            (503, {"error": {"code": "refresh_token_reused"}}, False),
            (429, {}, False),
            (400, {"error": "invalid_request"}, False),
            (200, {"access_token": "x"}, False),
        ]
        for status, body, permanent in cases:
            self.assertEqual(TokenReply(status, body).permanent, permanent, (status, body))
        self.assertTrue(TokenReply(200, {"access_token": "x"}).ok)
        self.assertFalse(TokenReply(200, {}).ok)
        self.assertEqual(TokenReply(401, {"error": {"code": "c"}}).describe(), "401 c")


class AuthFileTests(SynchronousTestCase):
    """
    Codex C{auth.json} and C{relay-import-codex-auth}.
    """

    def write(self, document) -> str:
        path = self.mktemp()
        with open(path, "w") as f:
            json.dump(document, f)
        return path

    def test_parse(self):
        """
        The tokens, the account id (else the token's claim) and
        C{last_refresh} (RFC 3339 with nanoseconds) are read; a bare
        C{tokens} object works too.
        """
        access = token(NOW + 60, NOW, account="acct-claim")
        auth = authfile.parseAuth({
            "OPENAI_API_KEY": None, "last_refresh": "2027-01-15T10:00:00.123456789Z",
            "tokens": {"access_token": access, "refresh_token": "rt", "id_token": None},
        })
        self.assertEqual(auth.account_id, "acct-claim")
        self.assertEqual(auth.refresh_token, "rt")
        self.assertAlmostEqual(auth.last_refresh, 1800007200.123456, places=3)
        bare = authfile.parseAuth({"refresh_token": "rt2", "account_id": "acct-2"})
        self.assertEqual((bare.refresh_token, bare.account_id), ("rt2", "acct-2"))

    def test_errors(self):
        """
        No tokens, no usable token, unreadable or not JSON: one message,
        never a secret.
        """
        for document in ([], {"tokens": "x"}, {"tokens": {"id_token": "secret-id"}}):
            e = self.assertRaises(authfile.AuthFileError, authfile.parseAuth, document)
            self.assertNotIn("secret-id", str(e))
        self.assertRaises(authfile.AuthFileError, authfile.readAuthFile, "/nonexistent/a.json")
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("{")
        self.assertRaises(authfile.AuthFileError, authfile.readAuthFile, path)

    def test_importEnv(self):
        """
        C{relay-import-codex-auth} (default C{--secrets env}) prints account
        YAML with C{*_env} references and writes the secrets to a 0600 env
        file; the YAML parses as relay configuration with those variables.
        """
        from relay.configuration.parse import settingsFromString

        access = token(NOW + 60, NOW, account="acct-abc")
        path = self.write({"tokens": {"access_token": access, "refresh_token": "rt-secret",
                                      "account_id": "acct-abc"}})
        envFile = self.mktemp()
        out, err = io.StringIO(), io.StringIO()
        code = authfile.main([path, "--env-file", envFile, "--id", "team1"], out, err)
        self.assertEqual(code, 0, err.getvalue())
        text = out.getvalue()
        self.assertNotIn("rt-secret", text)
        self.assertIn("refresh_token_env: RELAY_TEAM1_REFRESH_TOKEN", text)
        self.assertEqual(stat.S_IMODE(os.stat(envFile).st_mode), 0o600)
        with open(envFile) as f:
            environ = dict(line.strip().split("=", 1) for line in f)
        config = settingsFromString(text, environ=environ)
        [acct] = config.accounts
        self.assertEqual((acct.id, acct.refresh_token, acct.credential, acct.chatgpt_account_id),
                         ("team1", "rt-secret", access, "acct-abc"))

    def test_importEnvMergesAndIsPrivate(self):
        """
        C{--env-file} naming an existing 0644 file: it ends up 0600 (as the
        printed comment says), and importing a second account keeps the
        first one's variables and other lines; importing the first again
        replaces its variables, including one the new file no longer has.
        """
        envFile = self.mktemp()
        with open(envFile, "w") as f:
            f.write("# mine\nOTHER=keep\n")
        os.chmod(envFile, 0o644)
        first = self.write({"tokens": {"access_token": "at-1", "refresh_token": "rt-1",
                                       "account_id": "acct-1"}})
        second = self.write({"tokens": {"refresh_token": "rt-2", "account_id": "acct-2"}})
        out = io.StringIO()
        self.assertEqual(authfile.main([first, "--env-file", envFile, "--id", "o1"], out,
                                       io.StringIO()), 0)
        self.assertIn("(mode 0600)", out.getvalue())
        self.assertEqual(stat.S_IMODE(os.stat(envFile).st_mode), 0o600)
        self.assertEqual(authfile.main([second, "--env-file", envFile, "--id", "o2"],
                                       io.StringIO(), io.StringIO()), 0)
        with open(envFile) as f:
            self.assertEqual(f.read().splitlines(), [
                "# mine", "OTHER=keep", "RELAY_O1_REFRESH_TOKEN=rt-1",
                "RELAY_O1_ACCESS_TOKEN=at-1", "RELAY_O2_REFRESH_TOKEN=rt-2",
            ])
        again = self.write({"tokens": {"refresh_token": "rt-1b", "account_id": "acct-1"}})
        self.assertEqual(authfile.main([again, "--env-file", envFile, "--id", "o1"],
                                       io.StringIO(), io.StringIO()), 0)
        with open(envFile) as f:
            self.assertEqual(f.read().splitlines(), [
                "# mine", "OTHER=keep", "RELAY_O2_REFRESH_TOKEN=rt-2",
                "RELAY_O1_REFRESH_TOKEN=rt-1b",
            ])
        self.assertEqual(stat.S_IMODE(os.stat(envFile).st_mode), 0o600)

    def test_importInlineAndFile(self):
        """
        C{--secrets inline} puts the tokens in the YAML; C{--secrets file}
        references the file (C{auth_file}); both parse as configuration. A
        bad file is exit status 2 with one line.
        """
        from relay.configuration.parse import settingsFromString

        path = self.write({"tokens": {"refresh_token": "rt-x", "account_id": "acct-x"}})
        for mode in ("inline", "file"):
            out = io.StringIO()
            self.assertEqual(authfile.main([path, "--secrets", mode], out, io.StringIO()), 0)
            [acct] = settingsFromString(out.getvalue(), environ={}).accounts
            self.assertEqual((acct.refresh_token, acct.chatgpt_account_id), ("rt-x", "acct-x"))
            self.assertEqual(acct.credential, "")
        err = io.StringIO()
        self.assertEqual(authfile.main(["/nonexistent.json"], io.StringIO(), err), 2)
        self.assertEqual(len(err.getvalue().strip().splitlines()), 1)


class StoreContractMixin:
    """
    The L{ITokenStore} contract, run against each provider.
    """

    def makeStore(self, clock):
        raise NotImplementedError

    def test_contract(self):
        """
        Compare-and-set writes, loads, and a lock with an owner and a TTL
        (re-entrant for its owner, free after release or expiry).
        """
        clock = Clock()
        clock.advance(NOW)
        store = self.makeStore(clock)
        self.assertTrue(verifyObject(ITokenStore, store))
        self.assertIsNone(self.successResultOf(store.load("o1")))
        self.assertTrue(self.successResultOf(store.save("o1", 1, "r1", None)))
        self.assertFalse(self.successResultOf(store.save("o1", 1, "rX", None)))
        self.assertFalse(self.successResultOf(store.save("o1", 2, "rX", 5)))
        self.assertTrue(self.successResultOf(store.save("o1", 2, "r2", 1)))
        self.assertEqual(self.successResultOf(store.load("o1")), "r2")
        self.assertTrue(self.successResultOf(store.acquireLock("o1", "a", 10)))
        self.assertTrue(self.successResultOf(store.acquireLock("o1", "a", 10)))
        self.assertFalse(self.successResultOf(store.acquireLock("o1", "b", 10)))
        self.assertTrue(self.successResultOf(store.acquireLock("o2", "b", 10)))
        self.successResultOf(store.releaseLock("o1", "b"))  # not the owner
        self.assertFalse(self.successResultOf(store.acquireLock("o1", "b", 10)))
        self.successResultOf(store.releaseLock("o1", "a"))
        self.assertTrue(self.successResultOf(store.acquireLock("o1", "b", 10)))
        clock.advance(11)
        self.assertTrue(self.successResultOf(store.acquireLock("o1", "c", 10)))


class MemoryTokenStoreTests(StoreContractMixin, SynchronousTestCase):
    """
    L{MemoryTokenStore} keeps the contract.
    """

    def makeStore(self, clock):
        return MemoryTokenStore(clock=clock)


class SQLiteTokenStoreTests(StoreContractMixin, SynchronousTestCase):
    """
    L{SQLiteTokenStore} keeps the contract on a real SQLite file (the
    settings store's migration 2 creates its tables), and its records
    survive a new connection.
    """

    def makeStore(self, clock):
        path = self.mktemp()
        settings = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(settings.close)
        self.path = path
        return SQLiteTokenStore(settings=settings, clock=clock)

    def test_durable(self):
        """
        A written record is read back through another connection.
        """
        clock = Clock()
        store = self.makeStore(clock)
        self.assertTrue(self.successResultOf(store.save("o1", 1, "rec", None)))
        other = SQLiteSettingsStore(path=self.path, pool=synchronousPool(self.path))
        self.addCleanup(other.close)
        again = SQLiteTokenStore(settings=other, clock=clock)
        self.assertEqual(self.successResultOf(again.load("o1")), "rec")


class _HeldSaves(MemoryTokenStore):
    """
    A memory store whose next save waits for the test (persistence order).
    """

    holdNext: bool = False
    held: list = None

    def save(self, accountId, version, record, expected):
        if self.holdNext:
            self.holdNext = False
            d = Deferred()
            self.held.append((d, (accountId, version, record, expected)))
            return d
        return super().save(accountId, version, record, expected)


class _HeldLoads(MemoryTokenStore):
    """
    A memory store whose loads wait for C{pending} (start-up not done yet).
    """

    pending: Deferred = None

    def load(self, accountId):
        return self.pending.addCallback(lambda _: None)


class CredentialsTests(SynchronousTestCase):
    """
    L{OAuthCredentials} on a Clock with a memory store and a fake endpoint.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(NOW)
        self.settings = RuntimeSettings(current=GatewaySettings(
            oauth=OAuthSettings(refresh_margin_seconds=600)))
        self.store = MemoryTokenStore(clock=self.clock)
        self.endpoint = FakeEndpoint()

    def make(self, *accounts, store=None, start=True) -> OAuthCredentials:
        credentials = OAuthCredentials(
            clock=self.clock, settings=self.settings, store=store or self.store,
            endpoint=self.endpoint, accounts=list(accounts),
        )
        if start:
            self.successResultOf(credentials.start())
        self.addCleanup(credentials.stop)
        return credentials

    def stored(self, accountId="o1") -> TokenRecord:
        return TokenRecord.fromJSON(self.successResultOf(self.store.load(accountId)))

    def test_interfaces(self):
        """
        The real classes and the fake provide their interfaces.
        """
        self.assertTrue(verifyObject(ICredentialSource, self.make(account())))
        self.assertTrue(verifyObject(ITokenEndpoint, self.endpoint))

    def test_apiKeysUntouched(self):
        """
        API-key accounts are dialled as configured and never blocked.
        """
        key = Account(id="k", type="apikey", base_url="https://x/v1", credential="sk-1")
        credentials = self.make(key)
        self.assertIs(credentials.current(key), key)
        self.assertIsNone(credentials.ready(key))
        self.assertFalse(credentials.canRefresh(key))
        self.assertIsNone(credentials.blockReason(key, NOW))
        self.assertEqual(credentials.view(key), {})

    def test_viewWhileLoading(self):
        """
        Until an OAuth account's record is read from the store the account
        is blocked C{tokens_loading} and the operator view says
        C{token_status: "loading"} (not a row without token fields).
        """
        acct = account()
        held = Deferred()
        store = _HeldLoads(clock=self.clock)
        store.pending = held
        credentials = self.make(acct, store=store, start=False)
        started = credentials.start()
        self.assertNoResult(started)
        view = credentials.view(acct)
        self.assertEqual(view["token_status"], "loading")
        self.assertEqual(credentials.blockReason(acct, NOW)[0], "tokens_loading")
        held.callback(None)
        self.successResultOf(started)
        self.assertEqual(credentials.view(acct)["token_status"], "ok")

    def test_seedThenStoreWins(self):
        """
        Start-up seeds the store from the configuration; once the store
        holds newer tokens of the same lineage they win over the
        configuration on the next start; a configuration with other tokens
        (a new login) starts a new lineage.
        """
        acct = account()
        first = self.make(acct)
        self.assertEqual(self.stored().version, 1)
        self.assertEqual(first.current(acct).credential, acct.credential)
        self.endpoint.auto = lambda rt: rotated(1)
        self.assertTrue(self.successResultOf(first.refresh(acct, force=True)))
        first.stop()
        second = self.make(acct)
        self.assertEqual(second.current(acct).refresh_token, "rt-1")
        relogin = account(refresh="rt-new")
        third = self.make(relogin)
        self.assertEqual(third.current(relogin).refresh_token, "rt-new")
        self.assertEqual(self.stored().version, self.stored().version)
        self.assertEqual(self.stored().tokens.refresh_token, "rt-new")

    def test_reloadAddsRemovesAndRenews(self):
        """
        Issue 12 + 14: an OAuth account a reload adds gets managed tokens at
        once (seeded into the store, a proactive refresh planned); a removed
        one is forgotten; a renewed one starts again from its new
        configured tokens; a changed one dials with its new settings.
        """
        from relay.process.live import AccountSetChange

        first = account("o1")
        credentials = self.make(first)
        added = account("o2", refresh="rt-2")
        changed = evolve(first, priority=7)
        self.successResultOf(credentials.accountsChanged(
            [changed, added], AccountSetChange(added=frozenset({"o2"}),
                                               changed=frozenset({"o1"}))))
        self.assertIsNotNone(credentials.refreshAt(added))
        self.assertEqual(self.stored("o2").tokens.refresh_token, "rt-2")
        self.assertEqual(credentials.current(changed).priority, 7)
        renewed = evolve(added, refresh_token="rt-new", credential=token(NOW + 3600, NOW))
        self.successResultOf(credentials.accountsChanged(
            [changed, renewed], AccountSetChange(changed=frozenset({"o2"}),
                                                 renewed=frozenset({"o2"}))))
        self.assertEqual(self.stored("o2").tokens.refresh_token, "rt-new")
        self.successResultOf(credentials.accountsChanged(
            [renewed], AccountSetChange(removed=frozenset({"o1"}))))
        self.assertIsNone(credentials.refreshAt(first))
        self.assertIs(credentials.current(first), first)

    def test_proactiveOnTheClock(self):
        """
        The proactive refresh runs at C{exp} minus the margin (at most half
        the token's lifetime), on the injected clock, not before.
        """
        acct = account(access=token(NOW + 3600, NOW))
        self.endpoint.auto = lambda rt: rotated(1)
        credentials = self.make(acct)
        due = credentials.refreshAt(acct)
        self.assertEqual(due, NOW + 3600 - 600)
        self.clock.advance(due - NOW - 61)
        self.assertEqual(self.endpoint.calls, [])
        self.clock.advance(62)
        self.assertEqual(self.endpoint.calls, [("o1", "rt-0")])
        self.assertEqual(credentials.current(acct).refresh_token, "rt-1")
        short = account("o2", access=token(NOW + 100, NOW))
        self.assertEqual(self.make(short).refreshAt(short), NOW + 50)

    def test_persistBeforeUse(self):
        """
        The new tokens are written before the new access token is used, and
        an in-flight marker is written before the request is sent.
        """
        store = _HeldSaves(clock=self.clock)
        store.held = []
        self.store = store
        acct = account()
        credentials = self.make(acct, store=store)
        d = credentials.refresh(acct, force=True)
        marker = self.stored()
        self.assertIsNotNone(marker.in_flight)  # written before the request
        self.assertEqual(len(self.endpoint.pending), 1)
        store.holdNext = True
        self.endpoint.pending[0].callback(rotated(1))
        self.assertEqual(credentials.current(acct).credential, acct.credential)  # not yet
        [(held, args)] = store.held
        self.assertTrue(MemoryTokenStore.save(store, *args).result)
        held.callback(True)
        self.assertTrue(self.successResultOf(d))
        self.assertEqual(credentials.current(acct).refresh_token, "rt-1")
        self.assertIsNone(self.stored().in_flight)

    def test_singleFlight(self):
        """
        Concurrent refreshes share one request; a caller whose failing token
        was already replaced sends nothing.
        """
        acct = account()
        credentials = self.make(acct)
        old = credentials.current(acct).credential
        waiters = [credentials.refresh(acct, stale=old) for _ in range(5)]
        self.assertEqual(len(self.endpoint.calls), 1)
        self.endpoint.pending[0].callback(rotated(1))
        self.assertEqual([self.successResultOf(w) for w in waiters], [True] * 5)
        self.assertTrue(self.successResultOf(credentials.refresh(acct, stale=old)))
        self.assertEqual(len(self.endpoint.calls), 1)

    def test_otherHolderRefreshed(self):
        """
        Cross-process single flight: while another owner holds the lock the
        refresh waits; once it is free the store is re-read and its newer
        tokens are used without a request.
        """
        acct = account()
        credentials = self.make(acct)
        old = credentials.current(acct).credential
        self.successResultOf(self.store.acquireLock("o1", "other", LOCK_TTL_SECONDS))
        d = credentials.refresh(acct, stale=old)
        self.clock.advance(1)
        self.assertNoResult(d)
        record = self.stored()
        newer = record.next(NOW + 1, tokens=TokenSet.fromTokens(
            token(NOW + 7200, NOW), "rt-other", None, NOW))
        self.assertTrue(self.successResultOf(
            self.store.save("o1", newer.version, newer.toJSON(), record.version)))
        self.successResultOf(self.store.releaseLock("o1", "other"))
        self.clock.advance(1)
        self.assertTrue(self.successResultOf(d))
        self.assertEqual(self.endpoint.calls, [])
        self.assertEqual(credentials.current(acct).refresh_token, "rt-other")

    def test_permanentNeedsLogin(self):
        """
        A permanent failure puts the account in C{needs_login}: blocked
        with the reason, no refresh, until new tokens arrive.
        """
        acct = account()
        self.endpoint.auto = lambda rt: TokenReply(401, {"error": {"code": "refresh_token_reused"}})
        credentials = self.make(acct)
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        self.assertEqual(self.stored().status, STATUS_NEEDS_LOGIN)
        self.assertEqual(credentials.blockReason(acct, NOW),
                         ("needs_login: refresh_token_reused", 0))
        self.assertFalse(credentials.canRefresh(acct))
        self.assertIsNone(credentials.current(acct).refresh_token)
        self.assertFalse(self.successResultOf(credentials.refresh(acct)))
        self.assertEqual(len(self.endpoint.calls), 1)
        view = self.successResultOf(credentials.setTokens("o1", None, "rt-fresh"))
        self.assertEqual(view["token_status"], "ok")
        self.assertIsNone(credentials.blockReason(acct, NOW))
        self.assertIsNotNone(credentials.ready(acct))  # no access token: refresh first

    def test_adminTokensSource(self):
        """
        Tokens put by an operator show C{token_source} C{admin} instead of
        the configured file, also after a refresh and after a restart (the
        stored lineage wins); the record without it reads as configured.
        """
        acct = account(token_source="auth_file:/etc/relay/auth-o1.json")
        credentials = self.make(acct)
        self.assertEqual(credentials.view(acct)["token_source"],
                         "auth_file:/etc/relay/auth-o1.json")
        view = self.successResultOf(credentials.setTokens("o1", token(NOW + 3600, NOW), "rt-a"))
        self.assertEqual(view["token_source"], "admin")
        self.endpoint.auto = lambda rt: rotated(1)
        self.assertTrue(self.successResultOf(credentials.refresh(acct, force=True)))
        credentials.stop()
        again = self.make(acct)
        self.assertEqual(again.view(acct)["token_source"], "admin")
        self.assertEqual(self.stored().source, "admin")

    def test_tokenStatusMetrics(self):
        """
        C{relay_oauth_token_status{account,status}} is 1 for the account's
        current token status and 0 for the others, so C{needs_login} can be
        alerted on; C{relay_oauth_refresh_failures_total} counts the failed
        token requests -- a counter of L{RelayMetrics} fed by
        C{onRefreshFailure} (wired as L{relay.process.app} does), so that it adds
        up across workers like the other counters (issue 23; the summing
        itself: tests.integration.test_metrics_workers). No token appears
        in the scrape.
        """
        from prometheus_client import generate_latest

        from relay.console.metrics import RelayMetrics, withoutCreated
        from relay.scheduling.quota import UsageCollector, UsageWindows

        acct = account(refresh="rt-secret-0")
        credentials = self.make(acct)
        metrics = RelayMetrics(multiprocessDir=None)
        metrics.addCollector(UsageCollector(UsageWindows(clock=self.clock), credentials, [acct]))
        metrics.oauthAccounts([acct.id])
        credentials.onRefreshFailure = metrics.oauthRefreshFailed

        def scrape():
            return generate_latest(withoutCreated(metrics.exposed)).decode()

        text = scrape()
        self.assertIn('relay_oauth_token_status{account="o1",status="ok"} 1.0', text)
        self.assertIn('relay_oauth_token_status{account="o1",status="needs_login"} 0.0', text)
        self.assertIn('relay_oauth_refresh_failures_total{account="o1"} 0.0', text)
        self.assertEqual(text.count("# TYPE relay_oauth_refresh_failures_total counter"), 1)
        replies = [TokenReply(503, {}),
                   TokenReply(400, {"error": {"code": "refresh_token_reused"}})]
        self.endpoint.auto = lambda rt: replies.pop(0)
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        text = scrape()
        self.assertIn('relay_oauth_token_status{account="o1",status="needs_login"} 1.0', text)
        self.assertIn('relay_oauth_token_status{account="o1",status="ok"} 0.0', text)
        self.assertIn('relay_oauth_refresh_failures_total{account="o1"} 2.0', text)
        self.assertEqual(credentials.view(acct)["refresh_failures_total"], 2)
        self.assertNotIn("rt-secret", text)
        self.assertNotIn(acct.credential, text)

    def test_transientKeepsTokenAndBacksOff(self):
        """
        A 5xx keeps the current (valid) token and schedules the next try
        after a backoff of about 5 s, then about 10 s.
        """
        acct = account(access=token(NOW + 100, NOW - 1000))  # refresh already due
        replies = [TokenReply(503, {}), TokenReply(502, {}), rotated(1)]
        self.endpoint.auto = lambda rt: replies.pop(0)
        credentials = self.make(acct)
        before = credentials.current(acct)
        self.clock.advance(0)
        self.assertEqual(len(self.endpoint.calls), 1)
        self.assertIs(credentials.current(acct).credential, before.credential)
        self.assertIsNone(credentials.blockReason(acct, NOW))
        self.assertEqual(self.stored().failures, 1)
        due = credentials.refreshAt(acct)
        self.assertTrue(NOW + 4 <= due <= NOW + 6, due)
        self.clock.advance(6)
        self.assertEqual(len(self.endpoint.calls), 2)
        self.assertTrue(NOW + 6 + 8 <= credentials.refreshAt(acct) <= NOW + 6 + 12)
        self.clock.advance(12)
        self.assertEqual(len(self.endpoint.calls), 3)
        self.assertEqual(credentials.current(acct).refresh_token, "rt-1")
        self.assertEqual(self.stored().failures, 0)

    def test_backoffRetryWhenLogged(self):
        """
        A transient failure of a refresh made before the proactive time (an
        admin's forced refresh, the refresh after a 401) is retried when the
        log line and C{refresh_next_attempt} say (about 5 s), not at the
        later proactive time.
        """
        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import globalLogPublisher

        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        acct = account(access=token(NOW + 40, NOW))  # proactive refresh due at NOW + 20
        replies = [TokenReply(503, {}), rotated(1)]
        self.endpoint.auto = lambda rt: replies.pop(0)
        credentials = self.make(acct)
        self.assertFalse(self.successResultOf(
            credentials.refresh(acct, reason="admin", force=True)))
        [failed] = [e for e in events if e.get("event") == "relay.oauth_refresh_failed"]
        nextAttempt = credentials.view(acct)["refresh_next_attempt"]
        self.assertAlmostEqual(nextAttempt, NOW + failed["delay"], places=6)
        self.assertEqual(credentials.refreshAt(acct), nextAttempt)
        self.clock.advance(nextAttempt - NOW - 0.01)
        self.assertEqual(len(self.endpoint.calls), 1)
        self.clock.advance(0.01)
        self.assertEqual(len(self.endpoint.calls), 2)
        self.assertEqual(credentials.current(acct).refresh_token, "rt-1")

    def test_notSentIsNotInDoubt(self):
        """
        A failure before the request left (L{NotSent}) is transient; any
        other failure leaves the refresh token in doubt: it is never sent
        again by itself, the account serves while its token lasts, then
        needs a login; only an explicit C{retryInDoubt} sends it.
        """
        acct = account(access=token(NOW + 100, NOW))
        self.endpoint.auto = lambda rt: NotSent("refused")
        credentials = self.make(acct)
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        self.assertEqual(self.stored().status, "ok")
        self.endpoint.auto = lambda rt: ConnectionResetError("lost after sending")
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        self.assertEqual(self.stored().status, STATUS_IN_DOUBT)
        calls = len(self.endpoint.calls)
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        self.clock.advance(1000)
        self.assertEqual(len(self.endpoint.calls), calls)
        self.assertEqual(credentials.blockReason(acct, NOW + 1000),
                         ("needs_login: refresh_in_doubt", 0))
        self.assertIsNone(credentials.blockReason(acct, NOW + 50))
        self.endpoint.auto = lambda rt: rotated(1)
        self.assertTrue(self.successResultOf(
            credentials.refresh(acct, force=True, retryInDoubt=True)))
        self.assertEqual(self.stored().status, "ok")

    def test_inDoubtExpiryLogsNeedsLoginOnce(self):
        """
        An in-doubt account whose access token then expires turns
        C{needs_login} (C{refresh_in_doubt}): C{relay.oauth_needs_login} is
        logged once, at the expiry on the clock, not again on later syncs;
        new tokens cancel the pending call.
        """
        from twisted.internet.testing import EventLoggingObserver
        from twisted.logger import globalLogPublisher

        events = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)

        def needsLogin():
            return [e for e in events if e.get("event") == "relay.oauth_needs_login"]

        acct = account(access=token(NOW + 100, NOW))
        self.endpoint.auto = lambda rt: ConnectionResetError("lost after sending")
        credentials = self.make(acct)
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        self.assertEqual(self.stored().status, STATUS_IN_DOUBT)
        self.clock.advance(99)
        self.successResultOf(credentials.sync())
        self.assertEqual(needsLogin(), [])
        self.clock.advance(1)
        [event] = needsLogin()
        self.assertEqual((event["account_id"], event["code"]), ("o1", "refresh_in_doubt"))
        self.successResultOf(credentials.sync())
        self.clock.advance(1000)
        self.assertEqual(len(needsLogin()), 1)
        self.assertEqual(credentials.view(acct)["token_status"], STATUS_NEEDS_LOGIN)

        other = account("o2", access=token(NOW + 2000, NOW), refresh="rt-o2")
        credentials2 = self.make(other)
        self.assertFalse(self.successResultOf(credentials2.refresh(other, force=True)))
        self.assertEqual(self.stored("o2").status, STATUS_IN_DOUBT)
        def doubtCalls():
            return [c for c in self.clock.getDelayedCalls()
                    if c.func == credentials2._onDoubtExpired]

        self.assertEqual(len(doubtCalls()), 1)
        self.successResultOf(credentials2.setTokens("o2", token(NOW + 9000, NOW), "rt-new"))
        self.assertEqual(doubtCalls(), [])

    def test_lastErrorIsReadable(self):
        """
        C{refresh_last_error} names the exception and its message, also for
        Twisted's wrapper exceptions holding Failures (never a C{Failure}
        repr): a request that may have been sent, and one that was not.
        """
        from twisted.internet.error import ConnectionLost, ConnectionRefusedError
        from twisted.python.failure import Failure
        from twisted.web._newclient import (
            RequestTransmissionFailed,
            ResponseNeverReceived,
        )

        from relay.oauth.endpoint import describeError

        acct = account(access=token(NOW + 3600, NOW))
        self.endpoint.auto = lambda rt: NotSent(describeError(
            RequestTransmissionFailed([Failure(ConnectionRefusedError("no"))])))
        credentials = self.make(acct)
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        error = credentials.view(acct)["refresh_last_error"]
        self.assertEqual(
            error, "NotSent: RequestTransmissionFailed: ConnectionRefusedError: Connection was"
            " refused by other side: no.")
        self.endpoint.auto = lambda rt: ResponseNeverReceived([Failure(ConnectionLost("gone"))])
        self.assertFalse(self.successResultOf(credentials.refresh(acct, force=True)))
        error = credentials.view(acct)["refresh_last_error"]
        self.assertTrue(error.endswith("ResponseNeverReceived: ConnectionLost: Connection to the"
                                       " other side was lost in a non-clean fashion: gone."), error)
        self.assertNotIn("<twisted", error)

    def test_orphanedMarkerAtStart(self):
        """
        A stored in-flight marker whose owner's lock is gone means a process
        died mid-refresh: in doubt. While the lock is held it is left alone.
        """
        acct = account()
        self.make(acct).stop()
        record = self.stored()
        marked = record.next(NOW, in_flight={"owner": "dead", "since": NOW})
        self.successResultOf(self.store.save("o1", marked.version, marked.toJSON(), record.version))
        self.successResultOf(self.store.acquireLock("o1", "dead", LOCK_TTL_SECONDS))
        self.make(acct).stop()
        self.assertEqual(self.stored().status, "ok")
        self.clock.advance(LOCK_TTL_SECONDS + 1)
        self.make(acct)
        self.assertEqual(self.stored().status, STATUS_IN_DOUBT)
        self.assertIsNone(self.stored().in_flight)

    def test_persistFailureHoldsTokens(self):
        """
        When the new tokens cannot be written they are not used; the write
        is retried and the tokens are used once it succeeds.
        """
        acct = account()
        credentials = self.make(acct)
        d = credentials.refresh(acct, force=True)
        self.store.failing = True
        self.endpoint.pending[0].callback(rotated(1))
        self.clock.pump([1] * 4)  # the write's own retries (0.5 + 1 + 2 s)
        self.assertFalse(self.successResultOf(d))
        self.assertEqual(credentials.current(acct).refresh_token, "rt-0")
        self.assertFalse(credentials.canRefresh(acct))
        self.assertTrue(credentials.view(acct)["token_unpersisted"])
        self.store.failing = False
        self.clock.advance(5)
        self.assertEqual(credentials.current(acct).refresh_token, "rt-1")
        self.assertEqual(self.stored().tokens.refresh_token, "rt-1")

    def test_invalidateAndExpiry(self):
        """
        R11: an invalidated token is refreshed before the next dial; so is
        one within 5 s of its C{exp}; a fresh one needs nothing.
        """
        acct = account(access=token(NOW + 3600, NOW))
        self.endpoint.auto = lambda rt: rotated(1)
        credentials = self.make(acct)
        self.assertIsNone(credentials.ready(acct))
        credentials.invalidate(acct)
        self.assertTrue(self.successResultOf(credentials.ready(acct)))
        soon = account("o2", access=token(NOW + 3, NOW - 100), refresh="rt-x")
        credentials2 = self.make(soon)
        self.assertIsNotNone(credentials2.ready(soon))

    def test_staticOAuth(self):
        """
        An OAuth account without a refresh token cannot refresh; once its
        JWT expires it needs a login.
        """
        acct = account(access=token(NOW + 10, NOW), refresh=None)
        credentials = self.make(acct)
        self.assertFalse(credentials.canRefresh(acct))
        self.assertIsNone(credentials.ready(acct))
        self.assertIsNone(credentials.blockReason(acct, NOW))
        self.assertEqual(credentials.blockReason(acct, NOW + 11)[0],
                         "needs_login: access token expired and no refresh token")
        self.assertIsNone(credentials.refreshAt(acct))

    def test_lockRenewedDuringFlight(self):
        """
        The refresh lock is renewed while the token request runs, so a slow
        request longer than the lock's TTL never lets another process in;
        it is released when the refresh ends.
        """
        acct = account()
        credentials = self.make(acct)
        d = credentials.refresh(acct, force=True)
        self.clock.pump([LOCK_TTL_SECONDS / 3] * 6)  # twice the TTL
        self.assertFalse(self.successResultOf(
            self.store.acquireLock("o1", "other", LOCK_TTL_SECONDS)))
        self.endpoint.pending[0].callback(rotated(1))
        self.assertTrue(self.successResultOf(d))
        self.assertTrue(self.successResultOf(
            self.store.acquireLock("o1", "other", LOCK_TTL_SECONDS)))
