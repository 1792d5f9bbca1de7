# -*- test-case-name: tests.test_translate -*-
"""
What every translating sink does the same way: it stands in front of the
client's L{relay.interfaces.ITurnSink} for one attempt, reads the upstream's
Responses events or body and writes the client's shape (chat completions,
Anthropic Messages, images; R115: only the translation is the surface's).
Subclasses set C{_inner} (the client's sink), C{_done}, C{_headers} and
C{committed} in their C{__init__} and write C{writeEvent} / C{writeBody}.
"""

from __future__ import annotations

from typing import Optional

from relay.base.records import ClientError

__all__ = ["TranslatingSink"]


class TranslatingSink:
    """
    The part of a translating sink that passes through to the client's sink.

    @ivar committed: the engine committed this attempt's output.
    """

    _inner = None
    _done = False
    _headers: dict = {}
    committed = False

    @property
    def holdsOutput(self) -> bool:
        """
        Whether the client's sink holds everything until the end (JSON).
        """
        return bool(getattr(self._inner, "holdsOutput", False))

    @property
    def status(self) -> Optional[int]:
        """
        The client sink's HTTP status, for logs.
        """
        return getattr(self._inner, "status", None)

    def attachProducer(self, producer) -> None:
        """
        Let the client socket pause upstream reads.
        """
        attach = getattr(self._inner, "attachProducer", None)
        if attach is not None:
            attach(producer)

    def detachProducer(self) -> None:
        """
        Undo L{attachProducer}.
        """
        detach = getattr(self._inner, "detachProducer", None)
        if detach is not None:
            detach()

    def keepalive(self) -> None:
        self._inner.keepalive()

    def commit(self, headers) -> None:
        """
        The engine committed: remember the headers; the client's sink
        commits with the first translated write (or the error or the body).
        """
        self.committed = True
        self._headers = dict(headers or {})

    def _fail(self, error: ClientError) -> None:
        self._done = True
        self._inner.fail(error)

    def fail(self, error: ClientError) -> None:
        """
        The engine ends the turn with C{error}; after an answer or an
        upstream error this adapter already wrote, only the end remains.
        """
        if self._done:
            self._inner.finish()
            return
        self._fail(error)

    def finish(self) -> None:
        self._inner.finish()
