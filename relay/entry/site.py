# -*- test-case-name: tests.test_site -*-
"""
The HTTP transport under every route: relay answers in OpenAI's error
format even where twisted.web would answer on its own (issue 14's fuzzed
inputs found both):

  - a request line or header block twisted.web cannot parse (an unknown
    HTTP version, a malformed header, a bad C{Content-Length} or chunk,
    headers above twisted's limits): twisted.web writes a bare
    C{400 Bad Request} with no body and drops the connection;
    L{RelayHTTPChannel} writes a JSON 400 envelope first;
  - a method a resource has no C{render_*} for: twisted.web answers an
    HTML 405 page, or an HTML C{501 Huh?} for a method it does not know;
    L{JSONMethodErrors} answers a JSON 405 with C{Allow}.

Both hook twisted.web where it offers no public seam:
C{HTTPChannel._respondToBadRequestAndDisconnect} and the
C{_GenericHTTPChannelProtocol} wrapper L{RelaySite.protocol} builds
(Twisted 26); C{tests.test_site} pins them so an upgrade that moves them
fails loudly.
"""

from __future__ import annotations

from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol
from twisted.web.resource import UnsupportedMethod
from twisted.web.server import NOT_DONE_YET, Site

from relay.entry.sinks import errorBody, writeError
from relay.model import ClientError
from relay.requestid import newRequestId, requestIdOf

BAD_REQUEST = ClientError(
    400, "invalid_request_error", "The HTTP request could not be parsed.",
    code="malformed_http_request",
)
"""The answer to HTTP twisted.web cannot parse."""


class RelayHTTPChannel(HTTPChannel):
    """
    An L{HTTPChannel} whose answer to unparseable HTTP is OpenAI's error
    envelope (still a 400 and still the end of the connection), with the
    request's id like every other answer (issue 15).
    """

    def _respondToBadRequestAndDisconnect(self) -> None:
        """
        Write a JSON 400 with a length, C{X-Request-Id} and C{Connection:
        close}, then drop the connection (twisted.web's own writes only the
        status line). The id is the one of the request being read
        (L{requestIdOf}: the client's if the headers parsed so far carry a
        well-formed one), or a new one when the request line itself is what
        failed.
        """
        request = self.requests[-1] if self.requests else None
        requestId = requestIdOf(request) if request is not None else newRequestId()
        body = errorBody(BAD_REQUEST, requestId)
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\n"
            b"Content-Type: application/json\r\n"
            b"X-Request-Id: " + requestId.encode("ascii") + b"\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n"
            b"Connection: close\r\n\r\n" + body
        )
        self.loseConnection()


class RelaySite(Site):
    """
    The relay's L{Site}: its connections are L{RelayHTTPChannel}s.
    """

    def protocol(self):
        """
        Build one connection's protocol (L{Site.buildProtocol} calls this
        with no arguments, as twisted.web's own factory function is).
        """
        return _GenericHTTPChannelProtocol(RelayHTTPChannel())


class JSONMethodErrors:
    """
    Wraps the resource a request renders: a method the resource does not
    handle is a JSON 405 with C{Allow} (OpenAI's envelope, code
    C{method_not_allowed}) instead of twisted.web's HTML 405 or 501. A
    C{HEAD} on a C{GET} resource still goes to twisted.web, which fakes it.
    """

    def __init__(self, resource):
        """
        @param resource: the L{IResource} found for the request.
        """
        self._resource = resource

    def render(self, request):
        """
        Render the wrapped resource, answering an unsupported method.
        """
        try:
            return self._resource.render(request)
        except UnsupportedMethod as e:
            allowed = list(e.allowedMethods or ())
            if request.method == b"HEAD" and b"GET" in allowed:
                raise
            if allowed:
                request.setHeader(b"allow", b", ".join(allowed))
            method = request.method.decode("latin-1")
            path = request.path.decode("latin-1")
            writeError(request, ClientError(
                405, "invalid_request_error", f"Method {method} is not allowed on {path}",
                code="method_not_allowed",
            ))
            return NOT_DONE_YET
