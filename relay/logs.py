# -*- test-case-name: tests.test_logs -*-
"""
Log observers for relay (style.md section 6).

Run C{twistd -n --logger=relay.logs.jsonStdout relay ...} for one JSON
object per line on stdout, or C{--logger=relay.logs.textStdout} for text.
Global options go before the subcommand (style.md trap T29).

Every observer built here is wrapped in a L{SecretRedactor}, which replaces
known secrets (registered from the configuration with L{registerSecrets})
and anything that looks like an API key or a bearer token with C{***}
before the event is written. This is a second line of defence: code must
still never log a secret.
"""

from __future__ import annotations

import re
import sys
from typing import IO, Any, Iterable, Optional, Pattern, Sequence

from twisted.logger import (
    FileLogObserver,
    ILogObserver,
    formatEventAsClassicLogText,
    formatTime,
    jsonFileLogObserver,
    timeFormatRFC3339,
)
from zope.interface import implementer

__all__ = [
    "REDACTED",
    "SECRET_PATTERNS",
    "SecretRedactor",
    "SecretSet",
    "jsonStdout",
    "observerFor",
    "registerSecrets",
    "textStdout",
]

REDACTED = "***"

# Shorter registered secrets are ignored: redacting every "ab" in the log
# would destroy it and protect nothing.
_MIN_SECRET_LENGTH = 4

SECRET_PATTERNS: Sequence[tuple] = (
    # OpenAI-style and relay client keys: sk-..., sk-proj-..., sk-relay-...
    (re.compile(r"(?<![A-Za-z0-9])sk-[A-Za-z0-9][A-Za-z0-9_\-]{5,}"), REDACTED),
    # Authorization header values.
    (re.compile(r"(?i)\b(Bearer|Basic)\s+[^\s,;\"']+"), r"\1 " + REDACTED),
    # JWTs (OAuth access tokens).
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]*"), REDACTED),
    # user:password@ in URLs (proxy URLs, Redis URLs).
    (re.compile(r"(?<=://)[^/@\s:]*:[^/@\s]+@"), REDACTED + "@"),
)


_GLOBAL_FLAGS = re.compile(r"^\(\?[aiLmsux]+\)")
_INLINE_FLAGS = (("i", re.IGNORECASE), ("m", re.MULTILINE), ("s", re.DOTALL), ("x", re.VERBOSE))


def _anyOf(patterns: Iterable[Pattern]) -> Optional[Pattern]:
    """
    One regex that matches wherever any of C{patterns} matches, used as a
    prefilter: when it finds nothing in a string, no C{sub} with any of the
    patterns can change it, so the string is returned as it is without
    running each pattern over it.

    @return: the combined pattern, or L{None} when the patterns cannot be
        combined (e.g. numbered backreferences); callers then run every
        pattern, as before.
    """
    pieces = []
    for pattern in patterns:
        source = pattern.pattern
        if not isinstance(source, str):
            return None
        source = _GLOBAL_FLAGS.sub("", source)
        flags = "".join(c for c, f in _INLINE_FLAGS if pattern.flags & f)
        pieces.append(f"(?{flags}:{source})" if flags else f"(?:{source})")
    if not pieces:
        return None
    try:
        return re.compile("|".join(pieces))
    except re.error:
        return None


# Strings the redactor found nothing in (log formats, namespaces, names
# that recur in every event) are remembered, up to this many at a time and
# this long; the memory is dropped whenever the secrets change.
_CLEAN_SIZE = 4096
_CLEAN_TEXT_LENGTH = 256


class SecretSet:
    """
    A mutable set of secret strings, shared by the redactors that use it.

    @ivar version: bumped on every change, so redactors know to rebuild
        their pattern.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        """
        @param secrets: the initial secrets.
        """
        self._secrets: set = set()
        self.version = 0
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        """
        Register more secrets. Empty and very short values are ignored.

        @param secrets: strings to redact from now on.
        """
        before = len(self._secrets)
        for secret in secrets:
            if isinstance(secret, str) and len(secret) >= _MIN_SECRET_LENGTH:
                self._secrets.add(secret)
        if len(self._secrets) != before:
            self.version += 1

    def __iter__(self):
        """
        Iterate over the registered secrets.
        """
        return iter(set(self._secrets))

    def __len__(self) -> int:
        """
        @return: how many secrets are registered.
        """
        return len(self._secrets)


_registered = SecretSet()


def registerSecrets(secrets: Iterable[str]) -> None:
    """
    Register secrets with the process-wide set used by L{jsonStdout},
    L{textStdout} and L{observerFor} (when given no explicit set).

    C{makeService} calls this with L{relay.config.secretsOf} once the
    configuration is loaded, because twistd builds the log observer before
    the configuration is read.

    @param secrets: strings to redact from now on.
    """
    _registered.add(secrets)


@implementer(ILogObserver)
class SecretRedactor:
    """
    An L{ILogObserver} that redacts secrets from events, then passes a copy
    to the wrapped observer. The original event is never modified, so other
    observers see it unchanged.

    Strings anywhere in the event (including inside lists, tuples and
    dicts, and the C{log_format} text) have every known secret and every
    match of L{SECRET_PATTERNS} replaced with C{***}.
    """

    def __init__(
        self,
        observer: ILogObserver,
        secrets: Any = (),
        patterns: Optional[Sequence[tuple]] = None,
    ) -> None:
        """
        @param observer: where redacted events go.
        @param secrets: an iterable of secret strings, or a L{SecretSet}
            that may grow later (it is shared, not copied).
        @param patterns: C{(compiled regex, replacement)} pairs; defaults
            to L{SECRET_PATTERNS}.
        """
        self._observer = observer
        self._secrets = secrets if isinstance(secrets, SecretSet) else SecretSet(secrets)
        self._patterns = SECRET_PATTERNS if patterns is None else tuple(patterns)
        self._version = -1
        self._secretPattern: Optional[Pattern] = None
        self._anyPattern: Optional[Pattern] = None
        self._clean: set = set()

    def addSecrets(self, secrets: Iterable[str]) -> None:
        """
        Register more secrets with this redactor's set.

        @param secrets: strings to redact from now on.
        """
        self._secrets.add(secrets)

    def __call__(self, event: dict) -> None:
        """
        Redact a copy of C{event} and pass it on.

        @param event: a Twisted log event.
        """
        self._observer(self.redactEvent(event))

    def redactEvent(self, event: dict) -> dict:
        """
        @param event: a Twisted log event (not modified).
        @return: a redacted shallow copy.
        """
        self._refresh()
        redacted = dict(event)
        for key, value in event.items():
            new = self._redact(value, 0)
            if new is not value:
                redacted[key] = new
        return redacted

    def redactText(self, text: str) -> str:
        """
        @param text: any text.
        @return: C{text} with secrets replaced by C{***}.
        """
        self._refresh()
        return self._redactString(text)

    def _refresh(self) -> None:
        """
        Rebuild the alternation of known secrets if the set changed.
        """
        if self._version == self._secrets.version:
            return
        self._version = self._secrets.version
        secrets = sorted(self._secrets, key=len, reverse=True)
        self._secretPattern = (
            re.compile("|".join(re.escape(s) for s in secrets)) if secrets else None
        )
        every = [p for p, _ in self._patterns]
        if self._secretPattern is not None:
            every.append(self._secretPattern)
        self._anyPattern = _anyOf(every)
        self._clean = set()

    def _redactString(self, text: str) -> str:
        """
        Replace known secrets, then pattern matches.
        """
        clean = self._clean
        if text in clean:
            return text
        anyPattern = self._anyPattern
        if anyPattern is not None and anyPattern.search(text) is None:
            if len(text) <= _CLEAN_TEXT_LENGTH:
                if len(clean) >= _CLEAN_SIZE:
                    clean.clear()
                clean.add(text)
            return text
        if self._secretPattern is not None:
            text = self._secretPattern.sub(REDACTED, text)
        for pattern, replacement in self._patterns:
            text = pattern.sub(replacement, text)
        return text

    def _redact(self, value: Any, depth: int) -> Any:
        """
        Redact one value, copying containers only when something changed.

        @return: C{value} itself when unchanged, else a redacted copy.
        """
        if isinstance(value, str):
            new = self._redactString(value)
            return value if new == value else new
        if isinstance(value, bytes):
            text = value.decode("utf-8", "replace")
            new = self._redactString(text)
            return value if new == text else new.encode("utf-8")
        if depth > 8:
            return value
        if isinstance(value, dict):
            changed = False
            copy = {}
            for k, v in value.items():
                nv = self._redact(v, depth + 1)
                changed = changed or nv is not v
                copy[k] = nv
            return copy if changed else value
        if isinstance(value, (list, tuple)):
            items = [self._redact(v, depth + 1) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return items if isinstance(value, list) else tuple(items)
        return value


_lastSecond: list = [None, ""]


def _formatTime(when: Optional[float]) -> str:
    """
    C{formatTime(when, timeFormatRFC3339)}, remembering the text for the
    last whole second: the format has no sub-second field, so every
    timestamp in the same second formats the same. A fraction within a
    microsecond of the next second (which C{datetime} may round up) is
    formatted afresh.
    """
    if when is None or when < 0:
        return formatTime(when, timeFormatRFC3339)
    second = int(when)
    if when - second >= 0.999:
        return formatTime(when, timeFormatRFC3339)
    if _lastSecond[0] != second:
        _lastSecond[1] = formatTime(second, timeFormatRFC3339)
        _lastSecond[0] = second
    return _lastSecond[1]


def observerFor(format: str, stream: IO[str], secrets: Any = None) -> ILogObserver:
    """
    Build a redacting observer writing C{format} to C{stream}.

    @param format: C{text} or C{json} (config.md C{log.format}).
    @param stream: a text stream, e.g. C{sys.stdout}.
    @param secrets: an iterable or L{SecretSet}; L{None} means the
        process-wide set filled by L{registerSecrets}.
    @raise ValueError: for an unknown format.
    @rtype: L{ILogObserver}
    """
    if format == "json":
        # One plain JSON object per line: no RFC 7464 record separator, so
        # line-oriented tools (jq, json.loads per line) read it directly;
        # twisted.logger.eventsFromJSONLogFile still reads it back.
        inner = jsonFileLogObserver(stream, recordSeparator="")
    elif format == "text":
        # textFileLogObserver(stream), with the timestamp prefix formatted
        # once per second instead of once per event.
        inner = FileLogObserver(
            stream, lambda event: formatEventAsClassicLogText(event, formatTime=_formatTime)
        )
    else:
        raise ValueError(f"unknown log format {format!r} (expected text or json)")
    return SecretRedactor(inner, _registered if secrets is None else secrets)


def jsonStdout() -> ILogObserver:
    """
    The observer for C{twistd --logger=relay.logs.jsonStdout}: one JSON
    object per line on stdout, redacted.

    @rtype: L{ILogObserver}
    """
    return observerFor("json", sys.stdout)


def textStdout() -> ILogObserver:
    """
    The observer for C{twistd --logger=relay.logs.textStdout}: text lines
    on stdout, redacted.

    @rtype: L{ILogObserver}
    """
    return observerFor("text", sys.stdout)
