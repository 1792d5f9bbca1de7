"""
The intake's part of console sessions (R103: nothing before the
credential): a session cookie on an admin route is checked at the
headers, its CSRF token and role too, before a byte of the body is read;
an C{Authorization} header means the admin key is checked instead; C{/auth}
is a sign-in route (no credential yet, a small body), C{/me/api} a client
route.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from relay.entry.intake import ROUTE_CLIENT, ROUTE_OPEN, ROUTE_SIGNIN, routeClass
from relay.operators.sessions import Session
from tests.test_intake import ADMIN, Conn, head, relaySite

COOKIE = b"cookie-of-ana"


class _Sessions:
    def __init__(self, role):
        self.session = Session(id="s1", operator="ana", role=role, via="password",
                               csrf="token-1", expires_at=2e9)

    def lookup(self, cookie):
        return self.session if cookie == COOKIE else None


class _Directory:
    def __init__(self, role):
        self.role = role

    def find(self, name):
        return {"name": name, "role": self.role} if name == "ana" else None


def site(role="owner"):
    app, _ = relaySite()
    gate = app.extras["operators"].gate
    gate.sessions, gate.directory = _Sessions(role), _Directory(role)
    return app


def cookie(value=COOKIE, csrf=None):
    line = b"Cookie: relay_session=" + value + b"\r\n"
    if csrf:
        line += b"X-CSRF-Token: " + csrf + b"\r\n"
    return line


class SessionAtTheHeadersTests(SynchronousTestCase):
    def test_unknownSessionBeforeTheBody(self):
        conn = Conn(site().site).send(head(b"/admin/settings", b"PUT",
                                           cookie(b"made-up", b"token-1"), length=100))
        self.assertEqual(conn.status(), 401)
        self.assertEqual(conn.error()["code"], "session_invalid")

    def test_changeWithoutTheTokenBeforeTheBody(self):
        conn = Conn(site().site).send(head(b"/admin/settings", b"PUT", cookie(), length=100))
        self.assertEqual((conn.status(), conn.error()["code"]), (403, "csrf_failed"))

    def test_viewerBeforeTheBody(self):
        conn = Conn(site("viewer").site).send(
            head(b"/admin/settings", b"PUT", cookie(csrf=b"token-1"), length=100))
        self.assertEqual((conn.status(), conn.error()["code"]), (403, "forbidden"))

    def test_readsWithTheSession(self):
        conn = Conn(site("viewer").site).send(head(b"/admin/settings", b"GET", cookie()))
        self.assertEqual(conn.status(), 200)

    def test_bearerMeansTheAdminKey(self):
        """
        A request with both a cookie and an C{Authorization} header is the
        admin key's: a wrong key is refused whatever the cookie.
        """
        conn = Conn(site().site).send(head(
            b"/admin/settings", b"GET", cookie() + b"Authorization: Bearer wrong-key\r\n"))
        self.assertEqual(conn.status(), 401)
        conn = Conn(site().site).send(head(
            b"/admin/settings", b"GET", b"Authorization: Bearer " + ADMIN.encode() + b"\r\n"))
        self.assertEqual(conn.status(), 200)

    def test_routes(self):
        self.assertEqual(routeClass(b"/auth/signin", b"POST"), ROUTE_SIGNIN)
        self.assertEqual(routeClass(b"/me", b"GET"), ROUTE_OPEN)
        self.assertEqual(routeClass(b"/me/api/summary", b"GET"), ROUTE_CLIENT)
        conn = Conn(site().site).send(head(b"/me/api/summary", b"GET"))
        self.assertEqual(conn.status(), 401)
        conn = Conn(site().site).send(head(b"/auth/signin", b"POST", length=64 * 1024))
        self.assertEqual(conn.status(), 413)
