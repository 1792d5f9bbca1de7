# -*- test-case-name: tests.test_intake -*-
"""
One log line per second per kind of intake refusal.

An unauthenticated client can make relay refuse as many connections or
requests as it can open (connection caps, the header deadline, the body
rate, header lines over the limit); a line per refusal would let it fill
the disk and drown the log. L{LogThrottle} lets one line per key per
second of the site's clock through, and that line counts the refusals of
the same key left unlogged since the one before (its C{suppressed} field).
"""

from __future__ import annotations


class LogThrottle:
    """
    At most one log line per key per L{interval} seconds.

    @ivar interval: seconds between two lines of one key.
    """

    interval = 1.0

    def __init__(self, clock):
        """
        @param clock: an L{IReactorTime} (the site's reactor).
        """
        self._clock = clock
        self._last = {}

    def admit(self, key) -> int | None:
        """
        Whether a line of C{key} may be written now.

        @param key: any hashable naming the kind of line (e.g.
            C{("refused", "max_connections")}).
        @return: L{None} when the line is to be dropped (counted for the
            next one), else how many lines of C{key} were dropped since the
            last written one (C{0} for the first).
        """
        now = self._clock.seconds()
        last, suppressed = self._last.get(key, (None, 0))
        if last is not None and now - last < self.interval:
            self._last[key] = (last, suppressed + 1)
            return None
        self._last[key] = (now, 0)
        return suppressed


def suppressedNote(suppressed: int, what: str = "more") -> str:
    """
    The tail of a throttled line's format: C{" ({suppressed} more ... since
    the last line)"}, or nothing when none were dropped.

    @param what: the words after the count (e.g. C{"more refused"}).
    """
    return f" ({{suppressed}} {what} since the last line)" if suppressed else ""


def throttleOf(site) -> LogThrottle | None:
    """
    The site's shared L{LogThrottle} (L{relay.entry.site.RelaySite}), or
    L{None} for a site without one (a bare L{twisted.web.server.Site}).
    """
    return getattr(site, "logThrottle", None)
