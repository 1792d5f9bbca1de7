# -*- test-case-name: tests.test_logs -*-
"""
Log observers for relay (style.md section 6).

Run C{twistd -n --logger=relay.base.logs.jsonStdout relay ...} for one JSON
object per line on stdout, or C{--logger=relay.base.logs.textStdout} for text.
Global options go before the subcommand (style.md trap T29). C{relay
--log-format json|text} picks the same observers.

Both formats show, on every line, the event's name (its C{event} field, or
the logger's namespace for lines without one) and the request id: the
event's C{request_id}, or else the id of the turn whose code is running
(L{relay.base.requestid.currentRequestId}), so lines written by code that does
not know the turn (health, the scheduler, admission) still carry it.

Text (L{formatTextLine})::

    2026-05-02T10:11:12.345Z [relay.turn_finished#info req=req_ab12] turn ...

JSON (L{formatJSONLine}): one flat object per line, C{time} (ISO-8601
UTC), C{level}, C{event}, C{message} (the rendered text), C{request_id}
(C{null} outside a turn), then the event's own fields; nothing of
Twisted's internals (C{log_*} keys, C{__class_uuid__}, legacy keys). An
own field named C{time}, C{level} or C{message} is written as
C{event_time}, C{event_level} or C{event_message}; a failure adds
C{failure} and C{traceback}; values JSON cannot hold are written as text.

Times inside messages are ISO-8601 UTC: a placeholder named C{until},
C{at}, C{*_until} or C{*_at} whose value is a Unix time (a number after
2001) is rendered as e.g. C{2026-05-02T10:11:12.345Z}; the JSON field
keeps the number.

Under a C{workers: N} supervisor (L{relay.process.workers}) every line of a worker
also names the worker's index: a C{worker} key right after C{request_id}
in JSON (an own field called C{worker} is then written as
C{event_worker}), C{worker=N} at the end of the text line's brackets. A
process that no supervisor started (the supervisor itself included) writes
neither.

Every observer built here is wrapped in a L{SecretRedactor}
(L{relay.base.redact}), which replaces
known secrets (registered from the configuration with L{registerSecrets})
and anything that looks like an API key or a bearer token with C{***}
before the event is written. This is a second line of defence: code must
still never log a secret.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from operator import itemgetter
from string import Formatter
from typing import IO, Any

import orjson

from twisted.logger import FileLogObserver, ILogObserver, LogLevel, Logger, formatEvent
from twisted.logger import _logger as _twistedLogger
from twisted.python.compat import ioType
from zope.interface import implementer

from relay.base.redact import (  # noqa: F401 - names this module has always offered
    _SCALARS,
    _UNREDACTED_KEYS,
    REDACTED,
    SECRET_PATTERNS,
    SecretRedactor,
    SecretSet,
    redactQuery,
)
from relay.base.requestid import currentRequestId

__all__ = [
    "JSON_FIXED_KEYS",
    "REDACTED",
    "SECRET_PATTERNS",
    "BatchedFileLogObserver",
    "ClassLogger",
    "LevelFilter",
    "SecretRedactor",
    "SecretSet",
    "cutRedacted",
    "formatJSONLine",
    "formatTextLine",
    "isoTime",
    "jsonStdout",
    "observerFor",
    "registerSecrets",
    "textStdout",
]

_registered = SecretSet()


def registerSecrets(secrets: Iterable[str]) -> None:
    """
    Register secrets with the process-wide set used by L{jsonStdout},
    L{textStdout} and L{observerFor} (when given no explicit set).

    C{makeService} calls this with L{relay.configuration.parse.secretsOf} once the
    configuration is loaded, because twistd builds the log observer before
    the configuration is read.

    @param secrets: strings to redact from now on.
    """
    _registered.add(secrets)


_cutter: list = [None]
"""The redactor of L{cutRedacted} (over L{_registered}, built on first use)."""


def cutRedacted(text: str, limit: int, always: bool = False) -> str:
    """
    C{text} cut to its first C{limit} characters for a log field or a
    record, redacted first (the process-wide secrets of L{registerSecrets}
    and L{SECRET_PATTERNS}) when it is longer: a secret across the cut
    would leave its prefix, which no later redaction recognises (style.md
    section 6). Text within C{limit} is returned as it is unless C{always}
    (a log field: the observers redact it whole).

    @param text: client or upstream text (a request target, a User-Agent).
    @param limit: the most characters kept.
    @param always: redact it whatever its length: text kept where no
        observer redacts it (the request log's User-Agent).
    @rtype: L{str}
    """
    if len(text) <= limit and not always:
        return text
    redactor = _cutter[0]
    if redactor is None or redactor._secrets is not _registered:
        redactor = _cutter[0] = SecretRedactor(_dropEvent, _registered)
    return redactor.redactText(text)[:limit]


def _dropEvent(event: dict) -> None:
    """
    The observer of L{cutRedacted}'s redactor (it only redacts text).
    """


_lastSecond: list = [None, ""]

_MILLIS = tuple(f".{millis:03d}Z" for millis in range(1000))
"""Each millisecond's tail of an ISO time (C{.000Z} ... C{.999Z})."""

_floor = math.floor


def isoTime(when: float | None) -> str:
    """
    A Unix time as ISO-8601 UTC with milliseconds, e.g.
    C{2026-05-02T10:11:12.345Z}. The part up to the second is remembered
    for the last whole second, so lines within one second format it once;
    the millisecond's tail is one of 1,000 strings built at import.

    @param when: Unix seconds, or L{None} (C{-}).
    """
    if when is None:
        return "-"
    second = _floor(when)
    millis = int((when - second) * 1000)
    if millis > 999:
        millis = 999
    if _lastSecond[0] != second:
        try:
            _lastSecond[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        except (OverflowError, OSError, ValueError):
            return str(when)
        _lastSecond[0] = second
    return _lastSecond[1] + _MILLIS[millis]


_EPOCH_2001 = 978307200
"""Numbers below this are durations or counts, never times worth rendering."""

_timeFieldCache: dict = {}
_TIME_FIELD_CACHE_SIZE = 4096


def _formatInfo(fmt: str) -> tuple:
    """
    What L{_message} needs to know about a format string, cached per
    string: C{(time fields, field names)}. Time fields are the
    placeholders naming a time (C{until}, C{at}, C{*_until}, C{*_at})
    without a format spec or conversion; field names are the names of
    every placeholder (up to any C{.} or C{[}).
    """
    found = _timeFieldCache.get(fmt)
    if found is not None:
        return found
    times, names = [], []
    try:
        for _, name, spec, conversion in Formatter().parse(fmt):
            if not name:
                continue
            names.append(re.split(r"[.\[]", name, maxsplit=1)[0])
            if spec or conversion:
                continue
            if name in ("until", "at") or name.endswith(("_until", "_at")):
                times.append(name)
    except ValueError:
        pass
    found = (tuple(times), tuple(dict.fromkeys(names)))
    if len(_timeFieldCache) >= _TIME_FIELD_CACHE_SIZE:
        _timeFieldCache.clear()
    _timeFieldCache[fmt] = found
    return found


_PLAIN = frozenset({str, int, float, bool, type(None)})
"""Field types whose text the field redaction has already seen."""


def _message(event: dict, redact: Callable[[str], str]) -> str:
    """
    The event's text with Unix times rendered ISO-8601 (see the module
    docstring).

    C{str.format_map} renders it (C-speed; the same PEP 3101 syntax); an
    event it cannot render -- a missing field, or Twisted's C{{method()}}
    call syntax -- goes through L{formatEvent}, which handles both. The
    fields and the format were redacted already (L{SecretRedactor}); the
    text is redacted again only when it rendered an object (whose C{str}
    the field redaction could not see).

    @param redact: the text redaction.
    """
    fmt = event.get("log_format")
    if not isinstance(fmt, str):
        return redact(formatEvent(event))
    plan = _plainFormats.get(fmt)
    if plan is None:
        plan = _plainFormatOf(fmt)
    if plan is not False:
        # A plain format (L{_plainFormatOf}) of plain values: their text.
        getter, template = plan
        try:
            values = getter(event)
        except KeyError:
            values = None
        if values is not None:
            for value in values:
                if type(value) not in _PLAIN:
                    break
            else:
                return template % values
    fields, names = _formatInfo(fmt)
    if fields:
        event = dict(event)
        for name in fields:
            value = event.get(name)
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value >= _EPOCH_2001
            ):
                event[name] = isoTime(value)
    try:
        text = fmt.format_map(event)
    except Exception:  # noqa: BLE001 - formatEvent reports what went wrong
        return redact(formatEvent(event))
    for name in names:
        if type(event.get(name)) not in _PLAIN:
            return redact(text)
    return text


def _failureText(event: dict) -> str | None:
    """
    @return: the traceback of the event's C{log_failure}, if any.
    """
    failure = event.get("log_failure")
    if failure is None:
        return None
    try:
        return failure.getTraceback().rstrip("\n")
    except Exception:  # noqa: BLE001 - never lose the line over a bad failure
        return repr(failure)


def _levelName(event: dict) -> str:
    """
    @return: the event's level name (C{info} when it has none).
    """
    level = event.get("log_level")
    return getattr(level, "name", None) or "info"


_LEVEL_NAMES = {level: level.name for level in LogLevel.iterconstants()}
"""Each L{LogLevel} to its name (what L{_levelName} returns for it)."""


def _eventName(event: dict) -> str:
    """
    @return: the event's C{event} name, else its logger's namespace.
    """
    name = event.get("event")
    if name is None:
        return str(event.get("log_namespace") or "-")
    return name if isinstance(name, str) else str(name)


def _requestId(event: dict) -> str | None:
    """
    @return: the event's C{request_id}, else the running turn's id
        (L{currentRequestId}), else L{None}.
    """
    requestId = event.get("request_id")
    if requestId is None:
        return currentRequestId.get()
    return requestId if isinstance(requestId, str) else str(requestId)


def _identity(text: str) -> str:
    """
    @return: C{text} unchanged (no redaction).
    """
    return text


def _escapeControls(text: str) -> str:
    """
    C{text} with every character that is not printable (C{str.isprintable}:
    the C0 and C1 controls, the Unicode line and paragraph separators, the
    bidirectional, invisible and other format characters, unassigned code
    points) written as its escape, as C{repr} writes it (C{\\r},
    C{\\x1b}, C{\\u2028}), but the newline and the tab: a client's text
    (a model name, an upstream message quoting it) must not return the
    carriage, move the cursor, reorder what a reader sees or start what a
    reader splitting on any line break takes for a line of its own
    (style.md section 6). Called only for text that is not
    C{isprintable} (a plain line costs that one check).

    @rtype: L{str}
    """
    return "".join(c if c.isprintable() or c == "\n" or c == "\t" else repr(c)[1:-1]
                   for c in text)


def formatTextLine(
    event: dict, redact: Callable[[str], str] = _identity, worker: int | None = None
) -> str:
    """
    One text line (with a traceback after it, indented by a tab, for a
    failure): C{<ISO time> [<event>#<level> req=<id> worker=<n>] <message>}.

    @param event: a Twisted log event.
    @param redact: applied to the rendered message (objects rendered by
        their C{str} may hold what the field redaction could not see).
    @param worker: the worker index (L{relay.base.logs.workerIndex}), or
        L{None} (not supervised: no C{worker=}).
    @rtype: L{str}
    """
    # The helpers' common cases inlined (three lines a turn).
    requestId = event.get("request_id")
    if requestId is None:
        requestId = currentRequestId.get()
    elif type(requestId) is not str:
        requestId = str(requestId)
    text = _message(event, redact)
    if "log_failure" in event:
        traceback = _failureText(event)
        if traceback:
            # A traceback quotes values (a failing request's
            # headers, a token); redacted as the JSON format does.
            text = text + "\n" + redact(traceback)
    if not text.isprintable():
        text = _escapeControls(text)  # a newline stays: continued below
        if "\n" in text:
            text = text.replace("\n", "\n\t")
    name = event.get("event")
    if type(name) is not str:
        name = _eventName(event)
    level = _LEVEL_NAMES.get(event.get("log_level"))
    tag = name + "#" + (level if level is not None else _levelName(event))
    if requestId is not None:
        tag = tag + " req=" + requestId
    if worker is not None:
        tag = f"{tag} worker={worker}"
    return f"{isoTime(event.get('log_time'))} [{tag}] {text}\n"


JSON_FIXED_KEYS = ("time", "level", "event", "message", "request_id")
"""The keys every JSON line starts with, in this order."""

_RENAMED = {"time": "event_time", "level": "event_level", "message": "event_message"}

_LEGACY_KEYS = frozenset(
    {"message", "format", "system", "isError", "time", "why", "failure", "printed", "logLevel"}
)
"""What a L{twisted.python.log} event carries besides its C{log_*} keys."""

_DROPPED = frozenset({"__class_uuid__", "event", "request_id"})

_MAX_OBJECT_TEXT = 2000
_REDACTED_OBJECT_TEXT = _MAX_OBJECT_TEXT + 4096
"""How much of an object's text is redacted before it is cut to
L{_MAX_OBJECT_TEXT}: any secret that reaches into the kept part is whole
in it (style.md section 6)."""

_UNSEEN = object()
_outputKeys: dict = {}
_OUTPUT_KEYS_SIZE = 4096


def _outputKey(key: str) -> str | None:
    """
    The JSON name of an event key, or L{None} for keys not written
    (C{log_*}, C{__class_uuid__}, and C{event}/C{request_id}, which are
    fixed keys); remembered per key.
    """
    if key.startswith("log_") or key in _DROPPED:
        name = None
    else:
        name = _RENAMED.get(key, key)
    if len(_outputKeys) >= _OUTPUT_KEYS_SIZE:
        _outputKeys.clear()
    _outputKeys[key] = name
    return name


_plans: dict = {}


def _planOf(shape: tuple) -> tuple:
    """
    For an event's keys in order: the JSON names of the keys it writes
    and an C{itemgetter} of their values (always a tuple), or C{((), None)};
    remembered per shape.
    """
    keys, names = [], []
    for key in shape:
        name = _outputKeys.get(key, _UNSEEN)
        if name is _UNSEEN:
            name = _outputKey(key)
        if name is not None:
            keys.append(key)
            names.append(name)
    if not keys:
        plan = ((), None)
    elif len(keys) == 1:
        only = keys[0]
        plan = (tuple(names), lambda event: (event[only],))
    else:
        plan = (tuple(names), itemgetter(*keys))
    if len(_plans) >= _OUTPUT_KEYS_SIZE:
        _plans.clear()
    _plans[shape] = plan
    return plan


def _jsonDefault(value: Any, redact: Callable[[str], str]) -> Any:
    """
    Text for what JSON cannot hold: bytes decoded, sets as sorted lists,
    anything else by its C{str}, redacted, then capped.
    """
    if isinstance(value, (bytes, bytearray)):
        return redact(bytes(value).decode("utf-8", "replace"))
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    # Redacted before the cut (a secret across it would leave its prefix);
    # what is redacted is bounded too, far past the cut.
    return redact(str(value)[:_REDACTED_OBJECT_TEXT])[:_MAX_OBJECT_TEXT]


def _encoder(redact: Callable[[str], str]) -> json.JSONEncoder:
    """
    A compact JSON encoder whose fallback for other values is
    L{_jsonDefault} with C{redact} (built once per observer: a
    C{json.dumps} with options builds one per call).
    """
    return json.JSONEncoder(
        separators=(",", ":"), default=lambda value: _jsonDefault(value, redact)
    )


_plainEncoder = _encoder(_identity)

_INT64 = 2 ** 63
_QUICK_TYPES = frozenset({str, bool, type(None)})
_orjsonDumps = orjson.dumps
_QUICK_SAMPLES = ({"s": "a\"\\/\n\t\r\b\f\x01\x1f", "i": -_INT64, "j": _INT64 - 1, "b": True,
                   "n": None},
                  [0.0, -0.0, 1e-4, -1e-4, 0.1 + 0.2, 1 / 3, 1.3, 0.0123, 123456789012345.6,
                   9999999999999998.0, 1e15, 2.5e-4])
_QUICK_JSON = all(
    _orjsonDumps(sample) == _plainEncoder.encode(sample).encode() for sample in _QUICK_SAMPLES
)
"""Whether this orjson writes what the standard library's compact,
ASCII-only encoder writes for the values L{_quickJSON} gives it (checked
once, at import)."""


def _quickJSON(record: dict) -> str | None:
    """
    The compact JSON line of C{record} by orjson, when it is the standard
    library encoder's line: a flat record of strings, booleans, L{None},
    integers of 64 bits and floats written without an exponent (zero, or
    C{1e-4 <= |x| < 1e16}), whose text is ASCII without DEL (the standard
    library writes other characters as C{\\uXXXX}; orjson writes UTF-8).

    @return: the line and its newline, or L{None} (then the standard
        library's encoder writes it).
    """
    if not _QUICK_JSON:
        return None
    for value in record.values():
        kind = type(value)
        if kind in _QUICK_TYPES:
            continue
        if kind is int:
            if -_INT64 <= value < _INT64:
                continue
            return None
        if kind is float and (1e-4 <= value < 1e16 or -1e16 < value <= -1e-4 or value == 0.0):
            continue
        return None
    try:
        data = _orjsonDumps(record)
    except (TypeError, ValueError):
        return None
    if not data.isascii() or b"\x7f" in data:
        return None
    return data.decode("ascii") + "\n"


def formatJSONLine(
    event: dict,
    redact: Callable[[str], str] = _identity,
    encoder: json.JSONEncoder | None = None,
    worker: int | None = None,
) -> str:
    """
    One flat JSON object and a newline (see the module docstring).

    @param event: a Twisted log event.
    @param redact: applied to the rendered message and to the text of
        values JSON cannot hold.
    @param encoder: from L{_encoder} with the same C{redact}; L{None}
        builds one.
    @param worker: the worker index (L{relay.base.logs.workerIndex}),
        written as C{worker} after the fixed keys, or L{None} (not
        supervised: no C{worker} key).
    @rtype: L{str}
    """
    # The helpers' common cases inlined (three lines a turn).
    level = _LEVEL_NAMES.get(event.get("log_level"))
    name = event.get("event")
    if type(name) is not str:
        name = _eventName(event)
    requestId = event.get("request_id")
    if requestId is None:
        requestId = currentRequestId.get()
    elif type(requestId) is not str:
        requestId = str(requestId)
    record = {
        "time": isoTime(event.get("log_time")),
        "level": level if level is not None else _levelName(event),
        "event": name,
        "message": _message(event, redact),
        "request_id": requestId,
    }
    if worker is not None:
        record["worker"] = worker
    if "isError" in event and "system" in event:
        for key, value in event.items():
            if key not in _LEGACY_KEYS and _outputKey(key) is not None:
                record[_outputKey(key)] = value
    else:
        # The keys an event of this shape writes, and their JSON
        # names, are worked out once per shape (a call site's keys come in
        # the same order every time); the values are then read in C.
        shape = tuple(event)
        plan = _plans.get(shape)
        if plan is None:
            plan = _planOf(shape)
        names, getter = plan
        if getter is not None:
            record.update(zip(names, getter(event)))
    if worker is not None and "worker" in event:
        record["event_worker"] = record["worker"]
        record["worker"] = worker
    traceback = _failureText(event) if "log_failure" in event else None
    if traceback is not None:
        failure = event["log_failure"]
        kind = getattr(getattr(failure, "type", None), "__name__", "?")
        record["failure"] = redact(f"{kind}: {getattr(failure, 'value', '')}")
        record["traceback"] = redact(traceback)
    line = _quickJSON(record)
    if line is not None:
        return line
    if encoder is None:
        encoder = _plainEncoder if redact is _identity else _encoder(redact)
    try:
        return encoder.encode(record) + "\n"
    except (TypeError, ValueError):
        # Circular or otherwise unencodable fields: keep the line.
        fixed = {k: record[k] for k in JSON_FIXED_KEYS}
        fixed["unencodable_fields"] = sorted(k for k in record if k not in JSON_FIXED_KEYS)
        return json.dumps(fixed, separators=(",", ":")) + "\n"


_FROM_ENVIRONMENT = object()


def observerFor(
    format: str, stream: IO[str], secrets: Any = None, worker: Any = _FROM_ENVIRONMENT,
    schedule: Callable[[Callable[[], None]], Any] | None = None,
) -> ILogObserver:
    """
    Build a redacting observer writing C{format} to C{stream}.

    @param format: C{text} or C{json} (config.md C{log.format}).
    @param stream: a text stream, e.g. C{sys.stdout}.
    @param secrets: an iterable or L{SecretSet}; L{None} means the
        process-wide set filled by L{registerSecrets}.
    @param worker: the worker index every line names, or L{None} for
        none; by default this process's (L{relay.base.logs.workerIndex},
        read once, here).
    @param schedule: with a callable that runs a function soon (the
        service's C{reactor.callLater(0, f)}), the lines of one reactor
        iteration are written together (L{BatchedFileLogObserver}); the
        returned observer's C{flushLines} writes what is held. L{None}:
        every line is written (and flushed) at once.
    @raise ValueError: for an unknown format.
    @rtype: L{ILogObserver}
    """
    if format not in ("json", "text"):
        raise ValueError(f"unknown log format {format!r} (expected text or json)")
    if worker is _FROM_ENVIRONMENT:
        worker = workerIndex()
    holder: list = []

    def redactText(text: str) -> str:
        """
        The redactor's text redaction (the redactor is built below).
        """
        return holder[0].redactText(text)

    if format == "json":
        encoder = _encoder(redactText)

        def formatLine(event: dict) -> str:
            """
            Format one (already field-redacted) event as JSON.
            """
            return formatJSONLine(event, redactText, encoder, worker)

        kind = _JSONRedactor
    else:

        def formatLine(event: dict) -> str:
            """
            Format one (already field-redacted) event as text.
            """
            return formatTextLine(event, redactText, worker)

        # A text line shows only the fields its format names.
        kind = _TextRedactor
    if schedule is None:
        writer = FileLogObserver(stream, formatLine)
    else:
        writer = BatchedFileLogObserver(stream, formatLine, schedule)
    redactor = kind(writer, _registered if secrets is None else secrets)
    redactor.flushLines = getattr(writer, "flush", stream.flush)
    hold = _writeNow(stream) if schedule is None else writer.hold
    if kind is _TextRedactor:
        redactor.fuse(worker, hold)
    else:
        redactor.fuse(formatLine, hold)
    holder.append(redactor)
    return redactor


_LEVELS = frozenset(LogLevel.iterconstants())
_INFO = LogLevel.info


class _LeanLogger(Logger):
    """
    A L{Logger} whose C{emit} checks the level against a set built once
    (L{Logger.emit} lists L{LogLevel}'s constants on every call) and whose
    C{info} emits without a second pass through C{**kwargs}. An event holds
    what L{Logger.emit} publishes: the caller's fields, then C{log_logger},
    C{log_level}, C{log_namespace}, C{log_source}, C{log_format} and
    C{log_time} (stamped by the clock L{Logger.emit} uses).
    """

    def emit(self, level: LogLevel, format: str | None = None, **kwargs: Any) -> None:
        """
        See L{Logger.emit}; an unknown level goes to it (it logs the mistake).
        """
        if level not in _LEVELS:
            Logger.emit(self, level, format, **kwargs)
            return
        self._publish(level, format, kwargs)

    def info(self, format: str | None = None, **kwargs: Any) -> None:
        """
        See L{Logger.info}.
        """
        self._publish(_INFO, format, kwargs)

    def _publish(self, level: LogLevel, format: str | None, event: dict) -> None:
        event["log_logger"] = self
        event["log_level"] = level
        event["log_namespace"] = self.namespace
        event["log_source"] = self.source
        event["log_format"] = format
        event["log_time"] = _twistedLogger.time()
        if "log_trace" in event:
            event["log_trace"].append((self, self.observer))
        self.observer(event)


class ClassLogger(Logger):
    """
    C{_log = ClassLogger()} on a class of the turn path
    logs like C{_log = Logger()} -- the same namespace (C{module.Class}),
    observer, levels and event keys -- at a lower cost per line: reading
    C{self._log} returns one logger per class, built on first use, instead
    of a new L{Logger} per read (L{Logger.__get__}), and that logger emits
    through L{_LeanLogger}. Its C{log_source} is the class rather than the
    instance (no observer of relay writes C{log_source}).
    """

    def __init__(self, namespace: str | None = None, source: object = None,
                 observer: ILogObserver | None = None) -> None:
        """
        See L{Logger.__init__}.
        """
        super().__init__(namespace, source, observer)
        self._bound: dict = {}

    def __get__(self, instance: object, owner: type | None = None) -> Logger:
        """
        The logger of C{owner}, built once per class.
        """
        bound = self._bound.get(owner)
        if bound is None:
            bound = _LeanLogger(f"{owner.__module__}.{owner.__name__}", owner,
                                observer=self.observer)
            self._bound[owner] = bound
        return bound


@implementer(ILogObserver)
class LevelFilter:
    """
    What twist's runner puts in front of its file observer -- a
    L{FilteringLogObserver} with one L{LogLevelFilterPredicate} of a default
    level and no namespace levels -- with each level's verdict remembered
    (the predicate splits and joins the event's namespace
    on every line). Events without a level or a namespace, and events
    below C{level}, are dropped; the others go to C{observer}.
    """

    def __init__(self, observer: ILogObserver, level: LogLevel = LogLevel.info) -> None:
        """
        @param observer: where the events that pass go.
        @param level: the lowest level that passes.
        """
        self._observer = observer
        self._level = level
        self._passes: dict = {}

    def __call__(self, event: dict) -> None:
        level = event.get("log_level")
        if level is None or not event.get("log_namespace"):
            return
        passes = self._passes.get(level)
        if passes is None:
            passes = self._passes[level] = not level < self._level
        if passes:
            if "log_trace" in event:
                event["log_trace"].append((self, self._observer))
            self._observer(event)


def leanLevelFilter(publisher: Any, observer: ILogObserver, level: LogLevel) -> bool:
    """
    Replace, in C{publisher}, the L{FilteringLogObserver} twist's runner
    built around C{observer} (L{twisted.application.runner._runner.Runner.startLogging}:
    one L{LogLevelFilterPredicate} of C{level}, which no one else can
    reach to give namespace levels) by a L{LevelFilter} of C{level}.
    Nothing changes when no such filter is found (another runner, another
    Twisted).

    @param publisher: a L{LogPublisher} (the global one).
    @return: whether the filter was replaced.
    """
    from twisted.logger import FilteringLogObserver, LogLevelFilterPredicate

    for candidate in list(getattr(publisher, "_observers", ())):
        if not isinstance(candidate, FilteringLogObserver):
            continue
        if getattr(candidate, "_observer", None) is not observer:
            continue
        predicates = getattr(getattr(candidate, "_shouldLogEvent", None), "args", ((),))[0]
        if not (
            len(predicates) == 1
            and type(predicates[0]) is LogLevelFilterPredicate
            and predicates[0].defaultLogLevel == level
            and predicates[0]._logLevelsByNamespace == {"": level}
        ):
            return False
        publisher.removeObserver(candidate)
        publisher.addObserver(LevelFilter(observer, level))
        return True
    return False


_HELD_LEVELS = frozenset({LogLevel.info, LogLevel.debug})
"""The levels L{BatchedFileLogObserver} holds; other lines are written at once."""


@implementer(ILogObserver)
class BatchedFileLogObserver:
    """
    A L{FileLogObserver} that writes the lines of one reactor iteration in
    one C{write}: a turn logs three info lines (the
    decision, C{relay.turn_finished}, the access line) and an unbuffered
    stdout made each a system call. Info and debug lines are held; the
    first one held schedules the write (C{schedule(self.flush)}). Any
    other line (a warning, an error, a failure, an event without a level)
    is written at once with everything held before it, so nothing that
    explains a crash waits; the service flushes at shutdown and at exit.
    """

    def __init__(self, stream: IO[str], formatEvent: Callable[[dict], str | None],
                 schedule: Callable[[Callable[[], None]], Any],
                 limit: int = 4000) -> None:
        """
        @param stream: the text stream lines go to.
        @param formatEvent: an event to its line (or L{None}: nothing).
        @param schedule: runs a function soon (after the current reactor
            iteration's callbacks).
        @param limit: characters (ASCII: bytes) one write holds at most,
            below Linux's C{PIPE_BUF} (4096), so a write to a pipe is
            atomic.
        """
        self._stream = stream
        self._format = formatEvent
        self._schedule = schedule
        self._limit = limit
        self._held: list = []
        self._size = 0

    def __call__(self, event: dict) -> None:
        text = self._format(event)
        if text:
            self.hold(text, event)

    def hold(self, text: str, event: dict) -> None:
        """
        Hold (or write) one formatted line.

        @param text: the line of C{event}, not empty.
        @param event: the event it was formatted from (its level and
            failure decide whether it waits).
        """
        plain = text.isascii()
        if self._held and (not plain or self._size + len(text) > self._limit):
            # One write stays within PIPE_BUF: the lines of workers sharing
            # a pipe never interleave inside a line. A non-ASCII line (more
            # bytes than characters) and a longer one are written alone, as
            # before.
            self.flush()
        held = self._held
        held.append(text)
        self._size += len(text)
        if (
            event.get("log_level") not in _HELD_LEVELS
            or "log_failure" in event
            or not plain
            or self._size >= self._limit
        ):
            self.flush()
        elif len(held) == 1:
            self._schedule(self.flush)

    def flush(self) -> None:
        """
        Write and flush the lines held.
        """
        held = self._held
        if not held:
            return
        self._held, self._size = [], 0
        self._stream.write(held[0] if len(held) == 1 else "".join(held))
        self._stream.flush()


def _writeNow(stream: IO[Any]) -> Callable[[str, dict], None]:
    """
    What L{FileLogObserver} does with a line: write it (UTF-8 encoded to
    a stream that takes bytes) and flush.

    @return: a C{(line, event)} callable.
    """
    binary = ioType(stream) is not str

    def write(text: str, event: dict) -> None:
        stream.write(text.encode("utf-8") if binary else text)
        stream.flush()

    return write


class _JSONRedactor(SecretRedactor):
    """
    The L{SecretRedactor} of the JSON format. Built by L{observerFor}
    (L{fuse}), it formats and writes an event none of whose fields needs
    redaction itself, without the copy L{redactEvent} makes (a JSON
    line writes every own field, so every field is checked, as
    L{redactEvent} checks them); any other event takes the general way
    (L{redactEvent}, then the wrapped observer).
    """

    _hold: Callable[[str, dict], None] | None = None
    _format: Callable[[dict], str] | None = None

    def fuse(self, formatLine: Callable[[dict], str],
             hold: Callable[[str, dict], None]) -> None:
        """
        Write the lines of clean events directly.

        @param formatLine: an event to its JSON line (L{formatJSONLine}
            with this redactor's text redaction).
        @param hold: takes C{(line, event)}: the wrapped observer's way
            of writing a line (L{BatchedFileLogObserver.hold}).
        """
        self._format = formatLine
        self._hold = hold

    def __call__(self, event: dict) -> None:
        """
        Redact, format and write C{event} (see the class docstring).

        @param event: a Twisted log event (not modified).
        """
        hold = self._hold
        if hold is None or self._version != self._secrets.version:
            self._observer(self.redactEvent(event))
            return
        clean = self._clean
        for key, value in event.items():
            kind = type(value)
            if kind in _SCALARS or (kind is str and value in clean) or key in _UNREDACTED_KEYS:
                continue
            if self._redact(value, 0) is not value:
                self._observer(self.redactEvent(event))
                return
        text = self._format(event)
        if text:
            hold(text, event)


class _TextRedactor(SecretRedactor):
    """
    The L{SecretRedactor} of the text format: a text line shows the
    format, the fields the format names, C{event} and C{request_id}, so
    only those are redacted (the others are never written).

    Built by L{observerFor} (L{fuse}), it also writes the line of the
    common event itself: a format of plain C{{name}} placeholders whose
    values, C{event} and C{request_id} are all strings found clean or
    numbers, booleans or L{None}, with no failure. That line is the one
    L{formatTextLine} writes for the event (nothing in it needed
    redaction); any other event takes the general way (L{redactEvent},
    then the wrapped observer).
    """

    _hold: Callable[[str, dict], None] | None = None
    _tail = "] "

    def fuse(self, worker: int | None, hold: Callable[[str, dict], None]) -> None:
        """
        Write the common lines directly (see the class docstring).

        @param worker: the worker index the lines name, or L{None}.
        @param hold: takes C{(line, event)}: the wrapped observer's way
            of writing a line (L{BatchedFileLogObserver.hold}).
        """
        self._hold = hold
        self._tail = "] " if worker is None else f" worker={worker}] "

    def __call__(self, event: dict) -> None:
        """
        Redact, format and write C{event} (see the class docstring).

        @param event: a Twisted log event (not modified).
        """
        hold = self._hold
        fmt = event.get("log_format")
        if (
            hold is None
            or type(fmt) is not str
            or "log_failure" in event
            or self._version != self._secrets.version
        ):
            self._observer(self.redactEvent(event))
            return
        clean = self._clean
        plan = _plainFormats.get(fmt)
        if plan is None:
            plan = _plainFormatOf(fmt)
        if plan is False or fmt not in clean:
            self._observer(self.redactEvent(event))
            return
        getter, template = plan
        try:
            values = getter(event)
        except KeyError:
            self._observer(self.redactEvent(event))
            return
        redact = self._redactString
        for value in values:
            kind = type(value)
            if kind is str:
                if value not in clean and redact(value) != value:
                    self._observer(self.redactEvent(event))
                    return
            elif kind not in _SCALARS:
                self._observer(self.redactEvent(event))
                return
        name = event.get("event")
        kind = type(name)
        if kind is str:
            if name not in clean and redact(name) != name:
                self._observer(self.redactEvent(event))
                return
        elif name is None:
            name = str(event.get("log_namespace") or "-")
        elif kind in _SCALARS:
            name = str(name)
        else:
            self._observer(self.redactEvent(event))
            return
        requestId = event.get("request_id")
        kind = type(requestId)
        if kind is str:
            if requestId not in clean and redact(requestId) != requestId:
                self._observer(self.redactEvent(event))
                return
        elif requestId is None:
            requestId = currentRequestId.get()
        elif kind in _SCALARS:
            requestId = str(requestId)
        else:
            self._observer(self.redactEvent(event))
            return
        text = template % values
        if not text.isprintable():
            text = _escapeControls(text)  # as formatTextLine
            if "\n" in text:
                text = text.replace("\n", "\n\t")
        level = _LEVEL_NAMES.get(event.get("log_level"))
        if level is None:
            level = _levelName(event)
        when = isoTime(event.get("log_time"))
        if requestId is None:
            hold(f"{when} [{name}#{level}{self._tail}{text}\n", event)
        else:
            hold(f"{when} [{name}#{level} req={requestId}{self._tail}{text}\n", event)

    def redactEvent(self, event: dict) -> dict:
        """
        @param event: a Twisted log event (not modified).
        @return: C{event} itself when nothing it shows needed redaction,
            else a shallow copy with the written fields redacted.
        """
        fmt = event.get("log_format")
        if type(fmt) is not str:
            return super().redactEvent(event)
        self._refresh()
        names = _textNames.get(fmt)
        if names is None:
            names = _textNamesOf(fmt)
        clean = self._clean
        redacted = None
        for key in names:
            value = event.get(key)
            kind = type(value)
            if kind in _SCALARS or (kind is str and value in clean):
                continue
            new = self._redact(value, 0)
            if new is not value:
                if redacted is None:
                    redacted = dict(event)
                redacted[key] = new
        return event if redacted is None else redacted


_textNames: dict = {}


def _textNamesOf(fmt: str) -> tuple:
    """
    The keys of an event with format C{fmt} that its text line shows
    (the format's fields, then L{_TEXT_KEYS}), remembered per format.
    """
    names = tuple(dict.fromkeys(_formatInfo(fmt)[1] + _TEXT_KEYS))
    if len(_textNames) >= _TIME_FIELD_CACHE_SIZE:
        _textNames.clear()
    _textNames[fmt] = names
    return names


_plainFormats: dict = {}


def _plainFormatOf(fmt: str) -> tuple | bool:
    """
    When every placeholder of C{fmt} is a plain C{{name}} (an identifier;
    no conversion, format spec, attribute or index, and no time field, see
    L{_formatInfo}): C{(getter, template)}, where C{getter(event)} is the
    tuple of the placeholders' values (in order; L{KeyError} when one is
    missing) and C{template % values} is C{fmt.format_map(event)} for
    values that are strings, numbers, booleans or L{None} (each is written
    as its C{str}, exactly as the field redaction saw it); else C{False}.
    Remembered per format.
    """
    names: list = []
    pieces: list = []
    plan: Any = False
    try:
        for literal, name, spec, conversion in Formatter().parse(fmt):
            pieces.append(literal.replace("%", "%%"))
            if name is None:
                continue
            if not name.isidentifier() or spec or conversion:
                break
            names.append(name)
            pieces.append("%s")
        else:
            if not _formatInfo(fmt)[0]:
                plan = (_getterOf(tuple(names)), "".join(pieces))
    except ValueError:
        pass
    if len(_plainFormats) >= _TIME_FIELD_CACHE_SIZE:
        _plainFormats.clear()
    _plainFormats[fmt] = plan
    return plan


def _getterOf(names: tuple) -> Callable[[dict], tuple]:
    """
    @return: a function of a mapping to the tuple of its values of
        C{names}, in order (C{itemgetter}, which returns a bare value for
        one name).
    """
    if not names:
        return lambda event: ()
    if len(names) == 1:
        only = names[0]
        return lambda event: (event[only],)
    return itemgetter(*names)


_TEXT_KEYS = ("log_format", "event", "request_id")
"""Besides the format's own fields, what a text line shows of an event."""


def jsonStdout() -> ILogObserver:
    """
    The observer for C{twistd --logger=relay.base.logs.jsonStdout}: one JSON
    object per line on stdout, redacted.

    @rtype: L{ILogObserver}
    """
    return observerFor("json", sys.stdout)


def textStdout() -> ILogObserver:
    """
    The observer for C{twistd --logger=relay.base.logs.textStdout}: text lines
    on stdout, redacted.

    @rtype: L{ILogObserver}
    """
    return observerFor("text", sys.stdout)


WORKER_ENV = "RELAY_WORKER"
"""Set (to the worker's index) in a worker's environment by the supervisor."""


def workerIndex(environ=os.environ) -> int | None:
    """
    @return: this process's worker index when a supervisor started it,
        else L{None}.
    """
    value = environ.get(WORKER_ENV)
    if value is None or not value.isdigit():
        return None
    return int(value)
