"""
L{relay.base.requestnotes}: one typed record of what relay notes about a
request, on both of L{relay.entry.body.LimitedBodyRequest}'s construction
paths, and on a stand-in request.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyChannel, DummyRequest

from relay.entry.body import LimitedBodyRequest
from relay.base.requestnotes import RequestNotes, notesOf


class RequestNotesTests(SynchronousTestCase):
    """
    Every request carries its own L{RequestNotes}; nothing is noted as a
    loose C{request.relay*} attribute.
    """

    def test_eachRequestHasItsOwn(self):
        """
        Two requests of relay's own never share their notes, and each
        starts blank.
        """
        one, two = LimitedBodyRequest(DummyChannel()), LimitedBodyRequest(DummyChannel())
        one.notes.sseStarted = True
        self.assertIsNot(one.notes, two.notes)
        self.assertEqual(two.notes, RequestNotes())

    def test_aStandInGetsNotesOnFirstUse(self):
        """
        L{notesOf} gives a request without notes (a test's stand-in) a
        blank record once, then the same record.
        """
        request = DummyRequest([b""])
        notes = notesOf(request)
        notes.audit = {"changed": "x"}
        self.assertIs(notesOf(request), notes)
        self.assertEqual(notesOf(request).audit, {"changed": "x"})

    def test_noLooseAttributes(self):
        """
        The request class declares none of the attributes the notes
        replaced.
        """
        loose = [name for name in ("relayRoute", "relayStartedAt", "relayBodyBlank",
                                   "relaySSEStarted", "relayQuietSince", "relayQuietRefusal",
                                   "relayAudit", "relayRequestId", "relayClientRequestId")
                 if hasattr(LimitedBodyRequest, name)]
        self.assertEqual(loose, [])
