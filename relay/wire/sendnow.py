# -*- test-case-name: tests.test_sendnow -*-
"""
L{sendNow}: write to a plain TCP connection at once when nothing is queued
on it.

C{FileDescriptor.write} only queues: it registers the socket for
writability (one C{epoll_ctl}), the reactor's next poll reports it, and
C{doWrite} sends and unregisters it (a second C{epoll_ctl}). A proxy's
writes are small and its sockets nearly always writable, so each answer
and each upstream request paid two system calls and a reactor iteration
for one C{send}. L{sendNow} sends straight away when the connection's
buffers are empty and queues only what the kernel did not take, so the
order of the bytes, the producer's back-pressure and the handling of a
lost connection stay Twisted's.

Anything that is not a plain (non-TLS) TCP connection -- TLS, a test's
L{StringTransport}, a protocol wrapper that overrides C{write} -- gets the
ordinary C{write}.
"""

from __future__ import annotations

from errno import ENOBUFS, EWOULDBLOCK

from twisted.internet import tcp
from twisted.protocols.policies import ProtocolWrapper
from twisted.python.util import untilConcludes

__all__ = ["sendNow", "socketOf"]

_wrapperWrite = ProtocolWrapper.write


def socketOf(transport):
    """
    The plain TCP connection under C{transport}, looking through protocol
    wrappers that do not change what is written; L{None} when there is
    none (TLS, a test double, a wrapper with its own C{write}).
    """
    for _ in range(4):
        kind = type(transport)
        if isinstance(transport, ProtocolWrapper) and kind.write is _wrapperWrite:
            transport = transport.transport
            continue
        if (
            isinstance(transport, tcp.Connection)
            and not getattr(transport, "TLS", False)
            and kind.writeSomeData is tcp.Connection.writeSomeData
        ):
            return transport
        return None
    return None


def sendNow(transport, data) -> None:
    """
    Write C{data} to C{transport}: sent at once when it is a plain TCP
    connection with nothing queued, in one C{sendmsg} of every piece (the
    kernel takes what its buffer holds; a 1 MiB upstream request body
    leaves without being joined to its head or copied); what is left is
    queued as it is, the piece the kernel stopped in with an offset into
    it, never a copy of its rest. Otherwise C{transport.write(data)} (or
    C{writeSequence} of the pieces).

    @param transport: an L{ITransport}.
    @param data: the bytes to send, or a list of bytes-like pieces (sent
        in order; a C{memoryview} is copied only when the ordinary
        C{writeSequence} must take it).
    """
    pieces = data if data.__class__ is list else None
    conn = socketOf(transport)
    if (
        conn is None
        or not data
        or not conn.connected
        or conn.disconnecting
        or conn._writeDisconnected
        or conn._tempDataBuffer
        or conn.offset < len(conn.dataBuffer)
    ):
        if pieces is None:
            transport.write(data)
        else:
            transport.writeSequence(_asBytes(pieces))
        return
    if pieces is None:
        pieces = [data]
    try:
        sent = untilConcludes(conn.socket.sendmsg, pieces)
    except OSError as e:
        if e.args[0] not in (EWOULDBLOCK, ENOBUFS):
            # Lost: let the ordinary path find out and tell the protocol.
            transport.writeSequence(_asBytes(pieces))
            return
        sent = 0
    for at, piece in enumerate(pieces):
        if sent < len(piece):
            break
        sent -= len(piece)
    else:
        return
    # Nothing was queued (checked above): the rest is what doWrite sends
    # next, from the offset, as after a partial send of its own.
    conn.dataBuffer = piece
    conn.offset = sent
    rest = pieces[at + 1:]
    if rest:
        conn._tempDataBuffer.extend(rest)
        conn._tempDataLen += sum(map(len, rest))
    conn._maybePauseProducer()
    conn.startWriting()


def _asBytes(pieces: list) -> list:
    return [p if p.__class__ is bytes else bytes(p) for p in pieces]
