# -*- test-case-name: tests.test_requestnotes -*-
"""
What relay notes about one HTTP request while it is read and answered, in
one typed record (L{RequestNotes}, C{request.notes}) instead of loose
attributes on the request.
"""

from __future__ import annotations

from typing import Optional

from attrs import define

__all__ = ["RequestNotes", "notesOf"]


@define(slots=True)
class RequestNotes:
    """
    One request's notes.

    @ivar route: the route class (L{relay.entry.intake.routeClass}), or
        L{None} before the headers are read.
    @ivar startedAt: when the headers were in (site clock seconds), for the
        access line's duration (L{relay.process.app._Site.log}), or L{None}.
    @ivar bodyBlank: the body was empty or blank (C{relayJSON}).
    @ivar sseStarted: keepalives were written while the key's slot was
        awaited (L{relay.entry.bodywait.SlotWait}, R85): 200 and the SSE
        headers are sent.
    @ivar quietSince: when the last of them was written (site clock
        seconds), or L{None}.
    @ivar quietRefusal: the intake refused the request without its own log
        line (a counted admin-key guess, already throttled).
    @ivar audit: what an admin write leaves for the audit record
        (L{relay.control.audit}), or L{None}.
    @ivar requestId: relay's own id of the request once
        L{relay.base.requestid.requestIdOf} chose it (R111), or L{None}.
    @ivar clientRequestId: the client's well-formed C{X-Request-Id} /
        C{X-Client-Request-Id} (R111), or L{None}; read once
        (C{clientRequestIdRead}).
    @ivar operator: who made an admin request (the admin key or a console
        operator: a L{relay.operators.roles.Principal}), set by the intake,
        or L{None}.
    """

    route: Optional[str] = None
    startedAt: Optional[float] = None
    bodyBlank: bool = False
    sseStarted: bool = False
    quietSince: Optional[float] = None
    quietRefusal: bool = False
    audit: Optional[dict] = None
    requestId: Optional[str] = None
    clientRequestId: Optional[str] = None
    clientRequestIdRead: bool = False
    operator: Optional[object] = None


def notesOf(request) -> RequestNotes:
    """
    @param request: a request: relay's own (which has its notes from the
        start) or a stand-in (a test's C{DummyRequest}), which gets them
        on first use.
    @return: its L{RequestNotes}.
    """
    notes = getattr(request, "notes", None)
    if notes is None:
        notes = request.notes = RequestNotes()
    return notes
