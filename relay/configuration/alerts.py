# -*- test-case-name: tests.test_alerts_config -*-
"""
Parse and check the C{alerts:} section (config.md) into an
L{AlertSettings}: every problem is a one-line L{ConfigError} naming the
key path; a webhook URL is a secret and never part of a message.

    alerts:
      webhooks:
        - url: https://hooks.example/relay   # or url_env: VARIABLE
          slack: false                        # true: Slack's {"text": ...}
          events: [login_needed, ...]         # default: every event
      spend_rate_usd_per_hour: null           # null: spend_rate never fires
      spend_window_seconds: 900
      evaluate_interval_seconds: 15
      cooloff_seconds: 600
      capacity_forecast_minutes: 60
      forecast_window_seconds: 900
      key_budget_percents: [80, 100]
      delivery_attempts: 6
      delivery_timeout_seconds: 10
"""

from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import urlsplit

from relay.base.alertsettings import EVENTS, AlertSettings, WebhookTarget
from relay.base.records import ConfigError

_NUMBERS = {
    # key: (minimum, maximum, integer)
    "spend_window_seconds": (1, 86400, False),
    "evaluate_interval_seconds": (0.05, 3600, False),
    "cooloff_seconds": (0, 7 * 86400, False),
    "capacity_forecast_minutes": (1, 7 * 1440, False),
    "forecast_window_seconds": (1, 86400, False),
    "delivery_attempts": (1, 20, True),
    "delivery_timeout_seconds": (0.1, 300, False),
}
_WEBHOOK_KEYS = ("url", "url_env", "slack", "events")


def _fail(path: str, problem: str) -> ConfigError:
    """
    @return: a one-line L{ConfigError} C{"<path>: <problem>"}.
    """
    return ConfigError(" ".join(f"{path}: {problem}".split()))


def _kind(value: Any) -> str:
    """
    @return: what kind of value C{value} is, for a message (never the value: it may be a secret).
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "an integer", float: "a number", list: "a list",
            dict: "a mapping"}.get(type(value), "a " + type(value).__name__)


def _number(value: Any, path: str, low: float, high: float, integer: bool) -> float:
    """
    @return: C{value} checked to lie within C{low}..C{high} (an C{int} when C{integer}).
    @raise ConfigError: otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)):
        raise _fail(path, f"expected {'an integer' if integer else 'a number'},"
                          f" got {_kind(value)}")
    if not low <= value <= high:
        raise _fail(path, f"must be between {low:g} and {high:g}, got {value!r}")
    return int(value) if integer else float(value)


def _url(value: Any, path: str) -> str:
    """
    An absolute C{http://} or C{https://} URL with a host; the message
    never repeats it (it may carry a token).
    """
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, f"expected a non-empty URL string, got {_kind(value)}")
    value = value.strip()
    if any(c.isspace() or ord(c) < 32 for c in value):
        raise _fail(path, "invalid URL: it contains a space or control character")
    try:
        parts = urlsplit(value)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise _fail(path, "invalid URL: bad host or port") from None
    if parts.scheme not in ("http", "https") or not host:
        raise _fail(path, "expected an http:// or https:// URL with a host")
    if port == 0:
        raise _fail(path, "invalid URL: bad port 0 (expected 1-65535)")
    return value


def _webhook(raw: Any, index: int, environ: Mapping[str, str]) -> WebhookTarget:
    """
    @return: the L{WebhookTarget} of C{alerts.webhooks[index]}.
    @raise ConfigError: one line naming the key, never the URL.
    """
    path = f"alerts.webhooks[{index}]"
    if not isinstance(raw, dict):
        raise _fail(path, f"expected a mapping with url and events, got {_kind(raw)}")
    for key in raw:
        if key not in _WEBHOOK_KEYS:
            raise ConfigError(f"unknown key {path}.{key}")
    if "url" in raw and "url_env" in raw:
        raise _fail(path, "give url or url_env, not both")
    if "url_env" in raw:
        variable = raw["url_env"]
        if not isinstance(variable, str) or not variable:
            raise _fail(path + ".url_env", f"expected a variable name, got {_kind(variable)}")
        value = environ.get(variable)
        if value is None or not value.strip():
            raise _fail(path + ".url_env", f"environment variable {variable} is not set"
                        if value is None else f"environment variable {variable} is empty")
        url = _url(value, path + ".url_env")
    elif "url" in raw:
        url = _url(raw["url"], path + ".url")
    else:
        raise _fail(path, "url or url_env is required")
    slack = raw.get("slack", False)
    if not isinstance(slack, bool):
        raise _fail(path + ".slack", f"expected true or false, got {_kind(slack)}")
    events = raw.get("events", list(EVENTS))
    if not isinstance(events, list) or not events:
        raise _fail(path + ".events", "expected a non-empty list of events"
                    f" ({', '.join(EVENTS)})")
    for i, event in enumerate(events):
        if event not in EVENTS:
            shown = repr(event) if isinstance(event, str) else _kind(event)
            raise _fail(f"{path}.events[{i}]", f"unknown event {shown[:40]}"
                        f" (expected one of {', '.join(EVENTS)})")
    host = urlsplit(url).hostname
    return WebhookTarget(url=url, slack=slack, events=tuple(dict.fromkeys(events)),
                         label=f"webhooks[{index}] ({host})")


def parseAlerts(raw: Any, environ: Mapping[str, str]) -> AlertSettings:
    """
    The C{alerts:} section.

    @param raw: the parsed YAML value (L{None}: alerting off).
    @param environ: where C{url_env} variables are read.
    @return: an L{AlertSettings}.
    @raise ConfigError: one line naming the key path, never a URL.
    """
    if raw is None:
        return AlertSettings()
    if not isinstance(raw, dict):
        raise _fail("alerts", f"expected a mapping, got {_kind(raw)}")
    values: dict = {}
    for key, value in raw.items():
        path = f"alerts.{key}"
        if key == "webhooks":
            if value is None:
                value = []
            if not isinstance(value, list):
                raise _fail(path, f"expected a list, got {_kind(value)}")
            values["webhooks"] = tuple(_webhook(item, i, environ) for i, item in enumerate(value))
        elif key == "spend_rate_usd_per_hour":
            if value is not None:
                value = _number(value, path, 0, 1e9, False)
                if value <= 0:
                    raise _fail(path, "must be more than 0 (null turns spend_rate off)")
            values[key] = value
        elif key == "key_budget_percents":
            if not isinstance(value, list) or not value:
                raise _fail(path, f"expected a non-empty list of percents, got {_kind(value)}")
            values[key] = tuple(sorted({_number(v, f"{path}[{i}]", 1, 100, False)
                                        for i, v in enumerate(value)}))
        elif key in _NUMBERS:
            values[key] = _number(value, path, *_NUMBERS[key])
        else:
            raise ConfigError(f"unknown key {path}")
    return AlertSettings(**values)
