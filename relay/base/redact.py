# -*- test-case-name: tests.test_logs -*-
"""
Secret redaction for relay's log lines (style.md section 6): the second
line of defence behind "code never logs a secret".

L{SecretRedactor} wraps every observer L{relay.base.logs} builds: it
replaces known secrets (a L{SecretSet}; the process's is filled from the
configuration by L{relay.base.logs.registerSecrets}) and anything that
looks like an API key, a bearer or basic credential, a JWT or a URL's
password with C{***} before an event is written. L{redactQuery} hides secret-looking query values of a
request target in the access log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from re import Pattern
from typing import Any
from urllib.parse import unquote_plus

from twisted.logger import ILogObserver
from zope.interface import implementer

__all__ = [
    "REDACTED",
    "SECRET_PATTERNS",
    "SecretRedactor",
    "SecretSet",
    "redactQuery",
]

REDACTED = "***"

_SECRET_PARAMETER = re.compile(r"key|token|secret|password|passwd|auth|signature|sig$",
                               re.IGNORECASE)


def redactQuery(uri: str) -> str:
    """
    A request target for the access log with the values of query
    parameters whose names look secret replaced by C{***}: names
    containing C{key}, C{token}, C{secret}, C{password}, C{passwd},
    C{auth} or C{signature} (or ending in C{sig}), in any case, also
    percent-encoded. The path, the other parameters and their order are
    kept as sent.

    @param uri: the request target (path and query), decoded as latin-1.
    @return: the same target, redacted.
    """
    path, mark, query = uri.partition("?")
    if not mark:
        return uri
    fragment = ""
    if "#" in query:
        query, _, fragment = query.partition("#")
        fragment = "#" + fragment
    parts = []
    for part in query.split("&"):
        name, equals, value = part.partition("=")
        decoded = unquote_plus(name)
        if equals and value and _SECRET_PARAMETER.search(decoded):
            value = REDACTED
        parts.append(name + equals + value)
    return path + "?" + "&".join(parts) + fragment


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


def _anyOf(patterns: Iterable[Pattern]) -> Pattern | None:
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


@implementer(ILogObserver)
class SecretRedactor:
    """
    An L{ILogObserver} that redacts secrets from events, then passes a copy
    to the wrapped observer. The original event is never modified, so other
    observers see it unchanged.

    Strings anywhere in the event (including inside lists, tuples, sets
    and dicts -- their keys too --, and the C{log_format} text) have every
    known secret and every match of L{SECRET_PATTERNS} replaced with
    C{***}; a container nested deeper than the walk is replaced by its
    redacted text when that holds a secret (a JSON line writes every
    level; style.md section 6).
    """

    def __init__(
        self,
        observer: ILogObserver,
        secrets: Any = (),
        patterns: Sequence[tuple] | None = None,
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
        self._secretPattern: Pattern | None = None
        self._anyPattern: Pattern | None = None
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
        clean = self._clean
        for key, value in event.items():
            kind = type(value)
            # The common values (scalars, strings found clean
            # before) are settled here, without a call per field.
            if kind in _SCALARS or (kind is str and value in clean) or key in _UNREDACTED_KEYS:
                continue
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

    def redactLine(self, text: str) -> str:
        """
        Like L{redactText}, for a whole output line: not remembered as
        clean (lines are unique, the memory is for repeated field values).

        @param text: a rendered line.
        @return: C{text} with secrets replaced by C{***}.
        """
        self._refresh()
        anyPattern = self._anyPattern
        if anyPattern is None or anyPattern.search(text) is None:
            return text
        return self._replace(text)

    def _replace(self, text: str) -> str:
        """
        @return: C{text} with the known secrets, then the patterns'
            matches, replaced.
        """
        if self._secretPattern is not None:
            text = self._secretPattern.sub(REDACTED, text)
        for pattern, replacement in self._patterns:
            text = pattern.sub(replacement, text)
        return text

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
        if anyPattern is not None and (
            self._literalClean(text) if self._patterns is SECRET_PATTERNS
            else anyPattern.search(text) is None
        ):
            if len(text) <= _CLEAN_TEXT_LENGTH:
                if len(clean) >= _CLEAN_SIZE:
                    clean.clear()
                clean.add(text)
            return text
        return self._replace(text)

    def _literalClean(self, text: str) -> bool:
        """
        Whether none of L{SECRET_PATTERNS} nor a known secret matches
        C{text}, as C{anyPattern.search(text) is None} answers it, at a
        fraction of its cost for the common ASCII text without the
        literal each pattern needs (C{sk-}, C{Bearer} or C{Basic} in any
        case, C{eyJ}, C{://}); any other text is searched as before.

        @param text: any text.
        """
        if text.isascii() and "sk-" not in text and "eyJ" not in text and "://" not in text:
            lower = text.lower()
            if "bearer" not in lower and "basic" not in lower:
                secrets = self._secretPattern
                return secrets is None or secrets.search(text) is None
        return self._anyPattern.search(text) is None

    def _redact(self, value: Any, depth: int) -> Any:
        """
        Redact one value, copying containers only when something changed.

        @return: C{value} itself when unchanged, else a redacted copy.
        """
        kind = type(value)
        if kind is str:
            new = self._redactString(value)
            return value if new == value else new
        if kind in _SCALARS:
            return value
        if isinstance(value, str):
            new = self._redactString(value)
            return value if new == value else new
        if isinstance(value, bytes):
            text = value.decode("utf-8", "replace")
            new = self._redactString(text)
            return value if new == text else new.encode("utf-8")
        if depth > 8:
            if isinstance(value, _CONTAINERS):
                # deeper than the walk: written as its text when that
                # holds a secret (a JSON line writes every level), or
                # when it is too long to vouch for
                try:
                    text = repr(value)
                except Exception:  # noqa: BLE001 - an element's __repr__: left as it was
                    return value
                if len(text) > _DEEP_TEXT:
                    return self._redactString(text[:_DEEP_TEXT])
                new = self._redactString(text)
                return value if new == text else new
            return value
        if isinstance(value, dict):
            changed = False
            copy = {}
            clean = self._clean
            for k, v in value.items():
                kind = type(v)
                if kind in _SCALARS or (kind is str and v in clean):
                    nv = v
                else:
                    nv = self._redact(v, depth + 1)
                # a key is written too (a JSON object's name)
                if type(k) is str and k in clean:
                    nk = k
                elif isinstance(k, (str, bytes)):
                    nk = self._redact(k, depth + 1)
                    if nk is not k and nk in copy:
                        nk = _distinct(nk, copy)  # two secrets: both kept
                else:
                    nk = k
                changed = changed or nv is not v or nk is not k
                copy[nk] = nv
            return copy if changed else value
        if isinstance(value, (list, tuple)):
            items = [self._redact(v, depth + 1) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, (set, frozenset)):
            items = [self._redact(v, depth + 1) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return frozenset(items) if isinstance(value, frozenset) else set(items)
        return value


_UNREDACTED_KEYS = frozenset(
    {"log_logger", "log_source", "log_level", "log_namespace", "log_time"}
)
"""Twisted's bookkeeping keys: objects and names that are never written
as they are (an object reaches the output only through a format field)."""

_DEEP_TEXT = 8192
"""The most of a container nested deeper than the walk that is redacted
as text (characters); a longer one is written as that much of its text,
redacted."""

_CONTAINERS = (dict, list, tuple, set, frozenset)
"""What L{SecretRedactor._redact} walks into."""

def _distinct(key, taken: dict):
    """
    C{key} (a redacted dict key) made unlike every key of C{taken}
    (C{"***#2"}), so that two keys that redact alike keep both values.
    """
    n = 2
    while True:
        candidate = f"{key}#{n}" if isinstance(key, str) else key + b"#%d" % n
        if candidate not in taken:
            return candidate
        n += 1


_SCALARS = frozenset({int, float, bool, type(None)})
"""Types that cannot hold a secret (checked first: most event values)."""

