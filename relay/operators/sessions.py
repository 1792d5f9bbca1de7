# -*- test-case-name: tests.test_operators -*-
"""
L{OperatorSessions}: server-side console sessions
(L{relay.interfaces.IOperatorSessions}).

Signing in opens a session: a random 256-bit cookie secret goes to the
browser once (C{relay_session}, C{HttpOnly}, C{SameSite=Strict}, C{Secure}
over TLS, C{Max-Age} = L{SESSION_SECONDS}: L{cookieHeader}); the store
keeps a record of kind L{SESSION} under the cookie's SHA-256 (never the
cookie), with the operator's name, how they signed in, the session's CSRF
token and its expiry. A session ends when it expires, when its operator
signs out, is removed, gets a new password or a lower role, or when an
owner or admin signs the operator out everywhere (every process: the
store's change feed keeps each process's mirror current, within a second
on Redis).

B{CSRF.} A state-changing request (anything but GET and HEAD)
authenticated by the cookie must carry the session's token in
C{X-CSRF-Token} (L{csrfMatches}); the page reads the token from
C{GET /auth/session}. C{SameSite=Strict} already keeps the cookie off
cross-site requests; the token is the second line.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any, Callable, Optional

from attrs import define, field, frozen
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from zope.interface import implementer

from relay.control.store import ANY
from relay.interfaces import IOperatorSessions

__all__ = ["COOKIE", "CSRF_HEADER", "SESSION", "SESSION_SECONDS", "OperatorSessions",
           "Session", "cookieHeader", "csrfMatches", "sessionIdOf"]

SESSION = "op_session"
"""The store kind of console sessions."""

SESSION_SECONDS = 8 * 3600.0
"""How long a session lasts after sign-in, seconds (a working day)."""

COOKIE = b"relay_session"
"""The session cookie's name."""

MAX_SESSIONS = 20
"""The most sessions one operator holds at once: signing in again past it
ends the oldest (so repeated sign-ins cannot grow the store)."""

CSRF_HEADER = b"x-csrf-token"
"""The header a state-changing request carries its session's token in."""


def sessionIdOf(cookie) -> str:
    """
    @param cookie: the cookie's value (str or bytes).
    @return: the session's id: the SHA-256 of the cookie, hex.
    """
    if isinstance(cookie, str):
        cookie = cookie.encode("utf-8")
    return hashlib.sha256(cookie).hexdigest()


@frozen
class Session:
    """
    One console session.

    @ivar id: its id (L{sessionIdOf} its cookie).
    @ivar operator: the operator's name.
    @ivar role: the role it was opened with (the gate reads the
        operator's current one).
    @ivar via: C{password} or C{oidc}.
    @ivar csrf: the CSRF token of its state-changing requests.
    @ivar expires_at: Unix seconds.
    """

    id: str
    operator: str
    role: str
    via: str
    csrf: str = field(repr=False)
    expires_at: float


def csrfMatches(session: Session, given) -> bool:
    """
    @param given: the request's C{X-CSRF-Token} (bytes, str or L{None}).
    @return: whether it is the session's token (constant time).
    """
    if not given:
        return False
    if isinstance(given, str):
        given = given.encode("utf-8")
    return hmac.compare_digest(given, session.csrf.encode("ascii"))


def cookieHeader(value: str, secure: bool, maxAge: float = SESSION_SECONDS) -> bytes:
    """
    @param value: the cookie secret, or C{""} to clear the cookie.
    @param secure: add C{Secure} (the request came over TLS).
    @return: a C{Set-Cookie} value.
    """
    parts = [COOKIE.decode("ascii") + "=" + value, "Path=/", "HttpOnly", "SameSite=Strict",
             f"Max-Age={int(maxAge) if value else 0}"]
    if secure:
        parts.append("Secure")
    return "; ".join(parts).encode("ascii")


def _session(record) -> Optional[Session]:
    data = record.data
    try:
        return Session(id=record.id, operator=data["operator"], role=data["role"],
                       via=data.get("via", "password"), csrf=data["csrf"],
                       expires_at=float(data["expires_at"]))
    except (KeyError, TypeError, ValueError):
        return None


@implementer(IOperatorSessions)
@define(eq=False)
class OperatorSessions:
    """
    See the module docstring.

    @ivar store: the L{relay.interfaces.IControlStore}.
    @ivar clock: the injected clock (expiry).
    @ivar lifetime: seconds a session lasts (L{SESSION_SECONDS}).
    @ivar most: sessions one operator holds at most (L{MAX_SESSIONS}).
    """

    store: Any
    clock: Any
    lifetime: float = SESSION_SECONDS
    most: int = MAX_SESSIONS
    _sessions: dict = field(factory=dict)
    _unsubscribe: Optional[Callable] = None
    _log = Logger()

    async def open(self, name: str, role: str, via: str = "password") -> tuple:
        cookie = secrets.token_urlsafe(32)
        sid = sessionIdOf(cookie)
        now = self.clock.seconds()
        data = {"operator": name, "role": role, "via": via, "csrf": secrets.token_urlsafe(24),
                "created_at": now, "expires_at": now + self.lifetime}
        record = await self.store.put(SESSION, sid, data, None)
        session = _session(record)
        self._sessions[sid] = session
        self._sweep(now)
        mine = sorted((s for s in self._sessions.values() if s.operator == name),
                      key=lambda s: s.expires_at)
        for old in mine[:max(0, len(mine) - self.most)]:
            await self.revoke(old.id)
        return cookie, session

    def lookup(self, cookie) -> Optional[Session]:
        if not cookie:
            return None
        session = self._sessions.get(sessionIdOf(cookie))
        if session is None or session.expires_at <= self.clock.seconds():
            return None
        return session

    def byOperator(self, name: str) -> list:
        """
        @return: the live sessions of operator C{name}.
        """
        now = self.clock.seconds()
        return [s for s in self._sessions.values() if s.operator == name and s.expires_at > now]

    async def revoke(self, sessionId: str) -> None:
        self._sessions.pop(sessionId, None)
        await self.store.delete(SESSION, sessionId, ANY)

    async def revokeOperator(self, name: str) -> int:
        ended = [s.id for s in self._sessions.values() if s.operator == name]
        for sid in ended:
            await self.revoke(sid)
        return len(ended)

    def _sweep(self, now: float) -> None:
        """
        Forget and delete expired sessions (best effort).
        """
        for sid in [s for s, v in self._sessions.items() if v.expires_at <= now]:
            self._sessions.pop(sid, None)
            self.store.delete(SESSION, sid, ANY).addErrback(lambda f: None)

    # -- the mirror -------------------------------------------------------

    def start(self) -> Deferred:
        if self._unsubscribe is None:
            self._unsubscribe = self.store.subscribe(self._changed)
        return self._reload()

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _reload(self) -> Deferred:
        d = self.store.list(SESSION)

        def _cbRecords(records):
            found = {}
            for record in records:
                session = _session(record)
                if session is not None:
                    found[record.id] = session
            self._sessions = found
            self._sweep(self.clock.seconds())

        d.addCallback(_cbRecords)
        d.addErrback(lambda f: self._log.error(
            "reading the console sessions failed: {error}", error=str(f.value),
            event="relay.sessions_read_failed"))
        return d

    def _changed(self, change) -> None:
        if change.kind is None:
            self._reload()
            return
        if change.kind != SESSION:
            return
        if change.deleted:
            self._sessions.pop(change.id, None)
            return
        d = self.store.get(SESSION, change.id)

        def _cbRecord(record):
            session = None if record is None else _session(record)
            if session is None:
                self._sessions.pop(change.id, None)
            else:
                self._sessions[change.id] = session

        d.addCallback(_cbRecord)
        d.addErrback(lambda f: self._reload())
