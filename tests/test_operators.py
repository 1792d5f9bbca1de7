"""
Tests for L{relay.operators} (console operators with roles) and
L{relay.console.masking}: password hashing, sessions and their cookie,
CSRF, the sign-in throttle, the role rules, what a viewer sees, the audit's
actor, and the L{IOperatorDirectory} / L{IOperatorSessions} contract on the
memory and SQLite control stores (Redis: L{tests.integration.test_operators_redis}).
Each rule's test fails without its rule.
"""

from __future__ import annotations

import io
import json

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest
from zope.interface.verify import verifyObject

from relay.base.requestnotes import notesOf
from relay.console.masking import MASK, masked
from relay.control.store.memory import MemoryControlStore
from relay.control.store.sqlite import SQLiteControlStore
from relay.control.web import ControlError
from relay.interfaces import IOperatorDirectory, IOperatorSessions
from relay.operators.directory import OPERATOR, OperatorDirectory
from relay.operators.gate import ConsoleGate
from relay.operators.passwords import checkPassword, hashPassword, isHash, main, verifyPassword
from relay.operators.roles import ADMIN_KEY, Principal, mayManage, refusal
from relay.operators.sessions import (
    SESSION,
    SESSION_SECONDS,
    OperatorSessions,
    cookieHeader,
    sessionIdOf,
)
from relay.operators.throttle import SignInThrottle
from relay.state.settingsdb import SQLiteSettingsStore
from tests.test_settings import synchronousPool

T0 = 1_700_000_000.0

OWNER = Principal("olga", "owner")
ADMIN = Principal("adam", "admin")
VIEWER = Principal("vera", "viewer")


def run(testCase, coroutine):
    """
    @return: the result of C{coroutine}, run at once (stores fire
        synchronously here).
    """
    return testCase.successResultOf(Deferred.fromCoroutine(coroutine))


def failure(testCase, coroutine, kind=ControlError):
    return testCase.failureResultOf(Deferred.fromCoroutine(coroutine), kind).value


class CookieRequest(DummyRequest):
    """
    A L{DummyRequest} with cookies, TLS and headers as the gate reads them.
    """

    def __init__(self, path, method=b"GET", cookie=None, csrf=None, secure=False):
        super().__init__(path)
        self.method = method
        self._cookie = cookie
        self._secure = secure
        if csrf is not None:
            self.requestHeaders.setRawHeaders(b"x-csrf-token", [csrf])

    def getCookie(self, name):
        return self._cookie if name == b"relay_session" else None

    def isSecure(self):
        return self._secure


class PasswordTests(SynchronousTestCase):
    """
    L{relay.operators.passwords}: Argon2id, salted, checked in constant
    work for unknown names.
    """

    def test_argon2id(self):
        encoded = hashPassword("a long enough password")
        self.assertTrue(encoded.startswith("$argon2id$"))
        self.assertTrue(isHash(encoded))
        self.assertNotIn("a long enough password", encoded)

    def test_salted(self):
        self.assertNotEqual(hashPassword("same password 123"), hashPassword("same password 123"))

    def test_verify(self):
        encoded = hashPassword("right password 123")
        self.assertTrue(verifyPassword(encoded, "right password 123"))
        self.assertFalse(verifyPassword(encoded, "wrong password 123"))
        self.assertFalse(verifyPassword(encoded, None))
        self.assertFalse(verifyPassword("not a hash", "right password 123"))

    def test_unknownNameNeverMatches(self):
        """
        An unknown operator (no hash) verifies against a dummy hash and
        fails, even with the dummy's own password.
        """
        self.assertFalse(verifyPassword(None, "relay-no-such-operator"))

    def test_newPasswordRules(self):
        self.assertIsNone(checkPassword("twelve chars"))
        self.assertIn("at least 12", checkPassword("short"))
        self.assertIn("string", checkPassword(5))


class PasswordToolTests(SynchronousTestCase):
    """
    C{python -m relay.operators.passwords} (L{main}): the hash for a file
    operator's C{password_hash_env}, and one line, never a traceback, when
    it cannot read a password.
    """

    def ask(self, *answers):
        """
        @return: a C{getpass}-like callable answering C{answers} in turn, then
            raising L{EOFError} as C{getpass} does at the end of its input.
        """
        left = list(answers)

        def ask(prompt):
            if not left:
                raise EOFError()
            return left.pop(0)
        return ask

    def test_printsTheHash(self):
        out = io.StringIO()
        self.assertEqual(main([], self.ask("correct horse battery", "correct horse battery"), out), 0)
        encoded = out.getvalue().strip()
        self.assertTrue(isHash(encoded))
        self.assertTrue(verifyPassword(encoded, "correct horse battery"))

    def test_noInputIsOneLine(self):
        """
        Without a terminal and with nothing on standard input (C{</dev/null},
        a script), the tool exits with one line saying how to give the
        password, not an L{EOFError} traceback.
        """
        for answers in ((), ("correct horse battery",)):
            with self.assertRaises(SystemExit) as caught:
                main([], self.ask(*answers), io.StringIO())
            self.assertIn("no password read", str(caught.exception.code))

    def test_refusals(self):
        with self.assertRaises(SystemExit) as caught:
            main([], self.ask("short", "short"), io.StringIO())
        self.assertIn("at least 12", caught.exception.code)
        with self.assertRaises(SystemExit) as caught:
            main([], self.ask("correct horse battery", "another password"), io.StringIO())
        self.assertEqual(caught.exception.code, "the two passwords differ")
        with self.assertRaises(SystemExit) as caught:
            main(["--bogus"], self.ask(), io.StringIO())
        self.assertEqual(caught.exception.code, 2)

    def test_help(self):
        out = io.StringIO()
        self.assertEqual(main(["--help"], self.ask(), out), 0)
        self.assertIn("password_hash_env", out.getvalue())


class ThrottleTests(SynchronousTestCase):
    """
    L{SignInThrottle}: five failures free per address, then a doubling
    wait; a success clears it.
    """

    def setUp(self):
        self.clock = Clock()
        self.throttle = SignInThrottle(clock=self.clock)

    def test_freeFailuresThenWait(self):
        for _ in range(4):
            self.throttle.failed("10.0.0.1")
            self.assertIsNone(self.throttle.retryAfter("10.0.0.1"))
        self.throttle.failed("10.0.0.1")
        self.assertEqual(self.throttle.retryAfter("10.0.0.1"), 2)
        self.assertIsNone(self.throttle.retryAfter("10.0.0.2"))

    def test_doubles(self):
        for _ in range(6):
            self.throttle.failed("10.0.0.1")
        self.assertEqual(self.throttle.retryAfter("10.0.0.1"), 4)
        self.clock.advance(4)
        self.assertIsNone(self.throttle.retryAfter("10.0.0.1"))

    def test_successClears(self):
        for _ in range(5):
            self.throttle.failed("10.0.0.1")
        self.throttle.succeeded("10.0.0.1")
        self.assertIsNone(self.throttle.retryAfter("10.0.0.1"))

    def test_failuresAgeOut(self):
        for _ in range(4):
            self.throttle.failed("10.0.0.1")
        self.clock.advance(301)
        self.throttle.failed("10.0.0.1")
        self.assertIsNone(self.throttle.retryAfter("10.0.0.1"))

    def test_ipv6CountsPerSlash64(self):
        for i in range(5):
            self.throttle.failed(f"2001:db8::{i + 1}")
        self.assertIsNotNone(self.throttle.retryAfter("2001:db8::99"))
        self.assertIsNone(self.throttle.retryAfter("2001:db8:0:1::1"))


class RoleTests(SynchronousTestCase):
    """
    L{relay.operators.roles}: a viewer changes nothing; only an owner
    manages owners; the admin key is an owner.
    """

    def test_viewerReadsOnly(self):
        self.assertIsNone(refusal(VIEWER, "GET"))
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            self.assertIn("viewer", refusal(VIEWER, method))
        self.assertIsNone(refusal(ADMIN, "DELETE"))

    def test_onlyOwnersManageOwners(self):
        self.assertIn("only an owner", mayManage(ADMIN, "owner"))
        self.assertIn("only an owner", mayManage(ADMIN, "viewer", "owner"))
        self.assertIsNone(mayManage(ADMIN, "viewer", "admin"))
        self.assertIsNone(mayManage(OWNER, "owner"))
        self.assertIsNone(mayManage(ADMIN_KEY, "owner"))
        self.assertIsNotNone(mayManage(VIEWER, "viewer"))

    def test_adminKeyIsOwner(self):
        self.assertEqual((ADMIN_KEY.name, ADMIN_KEY.role), ("admin-key", "owner"))


class MaskingTests(SynchronousTestCase):
    """
    L{masked}: what a viewer sees.
    """

    def test_secretFieldsAndValues(self):
        answer = {"keys": [{"name": "alice", "hint": "…f3a9", "policy": {"rpm": 5}}],
                  "created": {"key": "sk-relay-alice-0123456789"},
                  "account": {"access_token": "abc", "credential": "set", "id": "a1"},
                  "note": "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.sig"}
        out = masked(answer)
        self.assertEqual(out["keys"][0]["hint"], MASK)
        self.assertEqual(out["keys"][0]["name"], "alice")
        self.assertEqual(out["created"]["key"], MASK)
        self.assertEqual(out["account"]["access_token"], MASK)
        self.assertEqual(out["account"]["credential"], "set")
        self.assertEqual(out["note"], MASK)
        self.assertEqual(answer["keys"][0]["hint"], "…f3a9")  # a copy

    def test_respondMasksForAViewerOnly(self):
        """
        L{relay.console.admin.respond} masks an answer to a viewer, and only
        to a viewer.
        """
        from relay.console.admin import respond

        body = {"key": "sk-relay-alice-0123456789"}
        for who, expected in ((VIEWER, MASK), (ADMIN, body["key"]), (None, body["key"])):
            request = DummyRequest([b"keys"])
            notesOf(request).operator = who
            self.assertEqual(json.loads(respond(request, 200, dict(body)))["key"], expected)


def _directory(testCase, store, clock, files=()):
    directory = OperatorDirectory(store=store, clock=clock, fileOperators=lambda: files)
    testCase.successResultOf(directory.start())
    return directory


class DirectoryContractMixin:
    """
    The L{IOperatorDirectory} and L{IOperatorSessions} contract; subclasses
    give L{makeStore}.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)

    def test_interfaces(self):
        store = self.makeStore()
        self.assertTrue(verifyObject(IOperatorDirectory, _directory(self, store, self.clock)))
        self.assertTrue(verifyObject(IOperatorSessions,
                                     OperatorSessions(store=store, clock=self.clock)))

    def test_addListChangeRemove(self):
        from relay.configuration.operators import OperatorSpec

        store = self.makeStore()
        files = (OperatorSpec(name="ana", role="owner", password_hash=hashPassword("x" * 12)),)
        directory = _directory(self, store, self.clock, files)
        view = run(self, directory.add("vic", "viewer", "vic-password-123", None, OWNER))
        self.assertEqual((view["name"], view["role"], view["source"], view["created_by"]),
                         ("vic", "viewer", "admin", "olga"))
        self.assertNotIn("password_hash", json.dumps(directory.list()))
        self.assertEqual([v["name"] for v in directory.list()], ["ana", "vic"])
        stored = self.successResultOf(store.get(OPERATOR, "vic"))
        self.assertTrue(stored.data["password_hash"].startswith("$argon2id$"))
        self.assertTrue(verifyPassword(directory.passwordHash("vic"), "vic-password-123"))
        view, revoke = run(self, directory.change("vic", {"role": "admin"}, OWNER))
        self.assertEqual((view["role"], revoke), ("admin", False))
        view, revoke = run(self, directory.change("vic", {"role": "viewer"}, OWNER))
        self.assertTrue(revoke)
        _, revoke = run(self, directory.change("vic", {"password": "new-password-456"}, ADMIN))
        self.assertTrue(revoke)
        self.assertTrue(verifyPassword(directory.passwordHash("vic"), "new-password-456"))
        run(self, directory.remove("vic", ADMIN))
        self.assertIsNone(directory.find("vic"))
        self.assertIsNone(self.successResultOf(store.get(OPERATOR, "vic")))

    def test_anotherProcessSees(self):
        """
        A second directory on the same store (another process) sees an
        operator added by the first once it re-reads or hears the change.
        """
        store = self.makeStore()
        first = _directory(self, store, self.clock)
        second = _directory(self, store, self.clock)
        run(self, first.add("vic", "viewer", "vic-password-123", None, OWNER))
        self.successResultOf(second.start())
        self.assertEqual(second.find("vic")["role"], "viewer")

    def test_refusals(self):
        from relay.configuration.operators import OperatorSpec

        store = self.makeStore()
        files = (OperatorSpec(name="ana", role="owner", password_hash=hashPassword("x" * 12)),)
        directory = _directory(self, store, self.clock, files)
        self.assertEqual(failure(self, directory.add("boss", "owner", "p" * 12, None,
                                                     ADMIN)).status, 403)
        self.assertEqual(failure(self, directory.add("v", "viewer", "p" * 12, None,
                                                     VIEWER)).status, 403)
        self.assertEqual(failure(self, directory.add("ana", "viewer", "p" * 12, None,
                                                     OWNER)).status, 409)
        self.assertEqual(failure(self, directory.add("x y", "viewer", "p" * 12, None,
                                                     OWNER)).param, "name")
        self.assertEqual(failure(self, directory.add("w", "root", "p" * 12, None,
                                                     OWNER)).param, "role")
        self.assertEqual(failure(self, directory.add("w", "viewer", "short", None,
                                                     OWNER)).param, "password")
        self.assertEqual(failure(self, directory.change("ana", {"role": "viewer"},
                                                        OWNER)).code, "file_operator")
        run(self, directory.add("o2", "owner", "p" * 12, None, OWNER))
        self.assertEqual(failure(self, directory.change("o2", {"role": "viewer"},
                                                        ADMIN)).status, 403)
        self.assertEqual(failure(self, directory.remove("o2", ADMIN)).status, 403)
        self.assertEqual(failure(self, directory.remove("nobody", OWNER)).status, 404)

    def test_lastOwnerStays(self):
        store = self.makeStore()
        directory = _directory(self, store, self.clock)
        run(self, directory.add("o1", "owner", "p" * 12, None, ADMIN_KEY))
        self.assertEqual(failure(self, directory.remove("o1", ADMIN_KEY)).code, "last_owner")
        self.assertEqual(failure(self, directory.change("o1", {"role": "admin"},
                                                        ADMIN_KEY)).code, "last_owner")

    def test_byEmail(self):
        store = self.makeStore()
        directory = _directory(self, store, self.clock)
        run(self, directory.add("vic", "viewer", None, "Vic@Example.com", OWNER))
        self.assertEqual(directory.byEmail("vic@example.com"), "vic")
        self.assertEqual(directory.byEmail("vic"), "vic")
        self.assertIsNone(directory.byEmail("eve@example.com"))

    def test_sessions(self):
        """
        A session is found by its cookie until it expires or is revoked;
        only the cookie's digest is stored; another process's mirror hears
        of a revocation.
        """
        store = self.makeStore()
        sessions = OperatorSessions(store=store, clock=self.clock)
        other = OperatorSessions(store=store, clock=self.clock)
        self.successResultOf(sessions.start())
        self.successResultOf(other.start())
        cookie, session = run(self, sessions.open("vic", "viewer", "password"))
        self.assertEqual(sessions.lookup(cookie), session)
        self.assertIsNone(sessions.lookup(cookie + "x"))
        self.assertIsNone(sessions.lookup(None))
        records = self.successResultOf(store.list(SESSION))
        self.assertEqual([r.id for r in records], [sessionIdOf(cookie)])
        self.assertNotIn(cookie, json.dumps(records[0].data))
        self.successResultOf(other.start())
        self.assertEqual(other.lookup(cookie), session)
        self.clock.advance(SESSION_SECONDS - 1)
        self.assertIsNotNone(sessions.lookup(cookie))
        self.clock.advance(1)
        self.assertIsNone(sessions.lookup(cookie))
        cookie, _ = run(self, sessions.open("vic", "viewer", "password"))
        second, _ = run(self, sessions.open("vic", "viewer", "password"))
        self.successResultOf(other.start())
        self.assertEqual(run(self, sessions.revokeOperator("vic")), 2)
        self.assertIsNone(sessions.lookup(cookie))
        self.assertIsNone(sessions.lookup(second))
        self.successResultOf(other.start())
        self.assertIsNone(other.lookup(second))


class SessionBoundTests(SynchronousTestCase):
    def test_oldestEndsPastTheBound(self):
        """
        Signing in past L{relay.operators.sessions.MAX_SESSIONS} ends the
        operator's oldest session (another operator's are untouched).
        """
        clock = Clock()
        store = MemoryControlStore(clock=clock)
        sessions = OperatorSessions(store=store, clock=clock, most=3)
        other, _ = run(self, sessions.open("ana", "owner"))
        cookies = []
        for _ in range(4):
            clock.advance(1)
            cookies.append(run(self, sessions.open("vic", "viewer"))[0])
        self.assertIsNone(sessions.lookup(cookies[0]))
        self.assertTrue(all(sessions.lookup(c) for c in cookies[1:]))
        self.assertIsNotNone(sessions.lookup(other))
        self.assertEqual(len(self.successResultOf(store.list(SESSION))), 4)


class MemoryDirectoryTests(DirectoryContractMixin, SynchronousTestCase):
    def makeStore(self):
        return MemoryControlStore(clock=self.clock)


class SQLiteDirectoryTests(DirectoryContractMixin, SynchronousTestCase):
    def makeStore(self):
        path = self.mktemp()
        database = SQLiteSettingsStore(path=path, pool=synchronousPool(path))
        self.addCleanup(database.close)
        return SQLiteControlStore(database=database, clock=self.clock)


class CookieTests(SynchronousTestCase):
    """
    L{cookieHeader}: HttpOnly, SameSite=Strict, Secure over TLS, expiring.
    """

    def test_attributes(self):
        header = cookieHeader("abc", secure=False).decode()
        self.assertIn("relay_session=abc", header)
        for part in ("HttpOnly", "SameSite=Strict", "Path=/", f"Max-Age={int(SESSION_SECONDS)}"):
            self.assertIn(part, header)
        self.assertNotIn("Secure", header)
        self.assertIn("; Secure", cookieHeader("abc", secure=True).decode())

    def test_clear(self):
        self.assertIn("Max-Age=0", cookieHeader("", secure=False).decode())


class GateTests(SynchronousTestCase):
    """
    L{ConsoleGate}: the session, its CSRF token, the role.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(T0)
        store = MemoryControlStore(clock=self.clock)
        self.directory = _directory(self, store, self.clock)
        run(self, self.directory.add("ana", "owner", "p" * 12, None, ADMIN_KEY))
        run(self, self.directory.add("vic", "viewer", "p" * 12, None, ADMIN_KEY))
        self.sessions = OperatorSessions(store=store, clock=self.clock)
        self.gate = ConsoleGate(sessions=self.sessions, directory=self.directory)

    def open(self, name):
        return run(self, self.sessions.open(name, self.directory.find(name)["role"]))

    def test_readNeedsNoToken(self):
        cookie, _ = self.open("ana")
        request = CookieRequest([b"keys"], cookie=cookie.encode())
        self.assertIsNone(self.gate.authenticate(request))
        self.assertEqual(notesOf(request).operator.name, "ana")

    def test_changeNeedsTheToken(self):
        cookie, session = self.open("ana")
        for csrf in (None, b"wrong"):
            request = CookieRequest([b"keys"], b"POST", cookie=cookie.encode(), csrf=csrf)
            error = self.gate.authenticate(request)
            self.assertEqual((error.status, error.code), (403, "csrf_failed"))
            self.assertIsNone(notesOf(request).operator)
        request = CookieRequest([b"keys"], b"POST", cookie=cookie.encode(),
                                csrf=session.csrf.encode())
        self.assertIsNone(self.gate.authenticate(request))

    def test_anotherSessionsTokenIsRefused(self):
        cookie, _ = self.open("ana")
        _, other = self.open("ana")
        request = CookieRequest([b"keys"], b"DELETE", cookie=cookie.encode(),
                                csrf=other.csrf.encode())
        self.assertEqual(self.gate.authenticate(request).code, "csrf_failed")

    def test_viewerRefused(self):
        cookie, session = self.open("vic")
        request = CookieRequest([b"settings"], b"PUT", cookie=cookie.encode(),
                                csrf=session.csrf.encode())
        error = self.gate.authenticate(request)
        self.assertEqual((error.status, error.code), (403, "forbidden"))
        self.assertIn("viewer", error.message)

    def test_unknownOrRemoved(self):
        request = CookieRequest([b"keys"], cookie=b"made-up")
        self.assertEqual(self.gate.authenticate(request).code, "session_invalid")
        cookie, _ = self.open("vic")
        run(self, self.directory.remove("vic", ADMIN_KEY))
        request = CookieRequest([b"keys"], cookie=cookie.encode())
        self.assertEqual(self.gate.authenticate(request).status, 401)

    def test_roleIsTheCurrentOne(self):
        """
        A session opened as an owner acts as a viewer once the operator is
        made one (the role is read per request).
        """
        run(self, self.directory.add("bo", "admin", "p" * 12, None, ADMIN_KEY))
        cookie, session = self.open("bo")
        run(self, self.directory.change("bo", {"role": "viewer"}, ADMIN_KEY))
        request = CookieRequest([b"keys"], b"POST", cookie=cookie.encode(),
                                csrf=session.csrf.encode())
        self.assertEqual(self.gate.authenticate(request).code, "forbidden")


class AuditActorTests(SynchronousTestCase):
    """
    Every audit entry names its actor: the operator, or C{admin-key}.
    """

    def test_actor(self):
        from relay.control.audit.resource import ControlAdmin
        from relay.control.audit.service import AuditTrail

        clock = Clock()
        store = MemoryControlStore(clock=clock)
        trail = AuditTrail(store=store, clock=clock)
        admin = ControlAdmin(inner=None, trail=trail, routes={})
        for who in (ADMIN, None):
            request = DummyRequest([b"keys"])
            request.method = b"POST"
            notesOf(request).operator = who
            admin._record(request, [b"keys"])
        entries = run(self, trail.recent(10))
        self.assertEqual([e["actor"] for e in entries], ["admin-key", "adam"])
