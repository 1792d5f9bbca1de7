# -*- test-case-name: tests.test_intake, tests.test_frontdoor -*-
"""
Holding a body within budgets (behaviour.md R103): the bytes of request
bodies and WebSocket frames held now, per client key
(C{gateway.limits.body_bytes_in_flight_per_key}) and in total
(C{gateway.limits.body_bytes_in_flight}); a body counts its raw bytes while
it arrives, then the estimate of its parsed size (L{parsedEstimate}) until
its turn ends. One budget for both entrypoints.
"""

from __future__ import annotations

from typing import Optional

from attrs import define, field

from relay.base.records import ClientError


def tooManyBytes(scope: str, limit: int) -> ClientError:
    """
    The 429 for bodies in flight over a bound.

    @param scope: C{key} or C{total}.
    @param limit: the bound, bytes.
    """
    name = (
        "gateway.limits.body_bytes_in_flight_per_key" if scope == "key"
        else "gateway.limits.body_bytes_in_flight"
    )
    who = "this API key's requests" if scope == "key" else "all requests"
    return ClientError(
        429, "rate_limit_error",
        f"Too many request bytes in flight for {who} (the limit is {limit} bytes, {name});"
        " please retry later.",
        code="body_bytes_in_flight_exceeded", headers=(("Retry-After", "1"),),
    )



@define(eq=False)
class BodyBudget:
    """
    Bytes of request bodies (and WebSocket frames) held now, per client
    key and in total.

    @ivar perKey: key name -> bytes held.
    @ivar total: bytes held by every key.
    """

    perKey: dict = field(factory=dict)
    total: int = 0

    def reserve(self, keyName: str, n: int, perKeyLimit: int, totalLimit: int):
        """
        Hold C{n} more bytes for C{keyName}.

        @param perKeyLimit: the per-key bound (0 = none).
        @param totalLimit: the process bound (0 = none).
        @return: L{None} when held, else the L{ClientError} (nothing held).
        """
        if n <= 0:
            return None
        held = self.perKey.get(keyName, 0)
        if perKeyLimit and held + n > perKeyLimit:
            return tooManyBytes("key", perKeyLimit)
        if totalLimit and self.total + n > totalLimit:
            return tooManyBytes("total", totalLimit)
        self.perKey[keyName] = held + n
        self.total += n
        return None

    def release(self, keyName: str, n: int) -> None:
        """
        Give back C{n} bytes of C{keyName}.
        """
        if n <= 0:
            return
        held = self.perKey.get(keyName, 0) - n
        if held > 0:
            self.perKey[keyName] = held
        else:
            self.perKey.pop(keyName, None)
        self.total = max(0, self.total - n)


_FOLD_STRUCTURE = bytes.maketrans(b"[,", b'{"')
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'{[",')
_CHUNK = 4 * 1024 * 1024


def parsedEstimate(data: bytes) -> int:
    """
    An upper estimate of the memory a JSON body takes once parsed
    (R103): its bytes, plus per opening bracket what CPython's parser
    allocates for a dict (64 B; a list takes 56), and per string quote or
    separator 32 B (a string ~56 B, two quotes; an element pointer or a
    float ~32 B). Measured worst shapes parse to 24x their size
    (C{[{},{},...]}); the estimate stays above the measured size for
    every shape. It costs one C{bytes.translate} pass that keeps only
    those four bytes, folded to two (a quarter of the four C{bytes.count}
    passes it replaces: about 0.4 ms for a 1 MiB Codex history), in
    slices of 4 MiB, so a large body is never copied whole. Strings that
    are not ASCII may hold more than their bytes (2 or 4 bytes a
    character): once a large body is read, L{shapeEstimate} counts them.

    @param data: the decoded body.
    @return: bytes.
    """
    opens = marks = 0
    for at in range(0, len(data), _CHUNK) if len(data) > _CHUNK else (0,):
        part = data if len(data) <= _CHUNK else data[at:at + _CHUNK]
        kept = part.translate(_FOLD_STRUCTURE, _NOT_STRUCTURE)
        found = kept.count(b"{")
        opens += found
        marks += len(kept) - found
    return len(data) + 64 * opens + 32 * marks


def shapeEstimate(length: int, containers: int, pairs: int, elements: int, wide: int = 0) -> int:
    """
    The memory a parsed body takes, estimated from what it holds
    (L{relay.wire.jsoncodec.loadsLarge} counts it while checking the
    value's depth, so this costs no pass over the text): its bytes, plus
    128 B per dict or list, 160 B per dict pair (the key's string, the
    value's object, the table's slot), 96 B per list element. Above the
    size CPython holds for every shape measured, Codex histories
    (about 1.2x their length) and the worst shapes (C{[{},{},...]} at 24x,
    C{{"k1":"v",...}} at 12x) alike; plus what its strings that are not
    ASCII take (C{wide}: such a string holds 2 or 4 bytes a character, a
    megabyte of text up to 4 MiB).

    @param length: the body's bytes.
    @param wide: the bytes of its strings that are not ASCII.
    @return: bytes.
    """
    return length + 128 * containers + 160 * pairs + 96 * elements + wide


SHAPE_BOUND_FACTOR = 113
"""L{shapeEstimate} is at most this many times the body's length (plus
L{SHAPE_BOUND_SLACK}): its bytes once, and a dict or list takes at least
its two brackets, as another's member 128 + 96 B at most (C{[[[...]]]}:
224 B per two bytes); a member that is no container takes a byte and a
separator."""

SHAPE_BOUND_SLACK = 512


def parsedBound(length: int) -> int:
    """
    What a body of C{length} bytes can take once parsed, at most, by
    L{shapeEstimate}: held while it is parsed, in place of
    L{parsedEstimate}'s pass over its bytes, when it fits (R103).

    @return: bytes.
    """
    return SHAPE_BOUND_FACTOR * length + SHAPE_BOUND_SLACK


def parsedOver(estimate: int, limits) -> Optional[tuple]:
    """
    The bound a body's parsed-size estimate can never fit under, whatever
    else is held: C{("key", limit)} or C{("total", limit)}, the per-key
    bound first; L{None} when it fits both.

    @param estimate: L{parsedEstimate} of the body, bytes.
    @param limits: the L{relay.base.records.LimitSettings} in force.
    """
    for scope, limit in (("key", limits.body_bytes_in_flight_per_key),
                         ("total", limits.body_bytes_in_flight)):
        if limit and estimate > limit:
            return scope, limit
    return None
