# -*- test-case-name: tests.test_config -*-
"""
Load the YAML configuration file (config.md) into a L{RelayConfig}.

Every section is validated against a whitelist, the way tahoe-lafs
C{read_config} does: an unknown key, a value of the wrong type, a value out
of range or a missing credential raises L{ConfigError} with a one-line
message that names the key path, for example::

    unknown key accounts[1].foo
    gateway.max_account_switches: expected an integer, got 'ten'
    accounts[0] (a1): api_key or api_key_env is required
    keys[0].key_env: environment variable RELAY_KEY_ALICE is not set

Messages never contain a secret value (keys, credentials, proxy passwords).

The tables below (C{_GATEWAY}, C{_BREAKER}, ...) map each key to a
validator; the defaults live in L{relay.base.records}, so adding a key is one
line here plus one field there.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Callable, Dict, Mapping, Optional, Tuple
from urllib.parse import unquote, urlsplit

import yaml

from relay.base.records import (
    Account,
    BreakerSettings,
    ClientKey,
    ComponentSettings,
    ConfigError,
    GatewaySettings,
    LimitSettings,
    OAuthSettings,
    ProxySpec,
    RelayConfig,
    RequestLogSettings,
    SchedulingSettings,
    StateSettings,
    TracingSettings,
    UpstreamSettings,
    UsageSettings,
    WebSocketSettings,
)
from relay.configuration.alerts import parseAlerts
from relay.configuration.operators import ROLES as OPERATOR_ROLES
from relay.configuration.operators import checkOperatorsNeedAdmin, oidcFrom, operatorsFrom

__all__ = [
    "loadConfig",
    "settingsFromString",
    "secretsOf",
    "checkDatabase",
    "parseProxyURL",
    "parseAccount",
    "OAUTH_BASE_URL",
    "APIKEY_BASE_URL",
    "WS_MODES",
]

OAUTH_BASE_URL = "https://chatgpt.com/backend-api/codex"
APIKEY_BASE_URL = "https://api.openai.com/v1"

ACCOUNT_TYPES = ("apikey", "oauth")
WS_MODES = ("ctx_pool", "passthrough", "http_bridge", "off")
TRANSPORT_RETRY_POLICIES = ("rotate", "sticky")
STATE_BACKENDS = ("memory", "redis")
REDIS_ERROR_POLICIES = ("fail_open", "fail_closed")
LOG_FORMATS = ("text", "json")
PROXY_SCHEMES = ("socks5", "socks5h", "http")

Validator = Callable[[Any, str], Any]


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def _fail(path: str, problem: str) -> ConfigError:
    """
    Build a one-line L{ConfigError} C{"<path>: <problem>"}.

    @param path: the key path, e.g. C{gateway.breaker.failures}.
    @param problem: what is wrong with it.
    @rtype: L{ConfigError}
    """
    return ConfigError(_oneLine(f"{path}: {problem}"))


def _oneLine(text: str) -> str:
    """
    Collapse all whitespace (including newlines) into single spaces.

    @param text: any text.
    @rtype: L{str}
    """
    return " ".join(str(text).split())


def _describe(value: Any, secret: bool = False) -> str:
    """
    Describe a value for an error message without leaking secrets.

    @param value: the offending value.
    @param secret: when true, only the value's kind is shown.
    @return: e.g. C{'ten'}, C{3.5}, C{a list}, C{null}.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean" if secret else ("true" if value else "false")
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if secret:
        kind = {str: "a string", int: "an integer", float: "a number"}.get(type(value))
        return kind or "a " + type(value).__name__
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return text


def _join(path: str, key: Any) -> str:
    """
    Append a mapping key to a key path.

    @param path: the parent path, or C{""} at the top level.
    @param key: the child key.
    @rtype: L{str}
    """
    return f"{path}.{key}" if path else str(key)


# ---------------------------------------------------------------------------
# Validators: (value, path) -> converted value, or raise ConfigError
# ---------------------------------------------------------------------------


def _integer(minimum: Optional[int] = None, maximum: Optional[int] = None) -> Validator:
    """
    An integer, optionally within C{[minimum, maximum]}.

    @rtype: validator
    """

    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, f"expected an integer, got {_describe(value)}")
        _checkRange(value, path, minimum, maximum)
        return value

    return check


def _number(
    minimum: Optional[float] = None,
    maximum: Optional[float] = None,
    positive: bool = False,
) -> Validator:
    """
    An integer or a float, optionally within C{[minimum, maximum]}.

    @param positive: require a value strictly above zero.
    @rtype: validator
    """

    def check(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, f"expected a number, got {_describe(value)}")
        if value != value or value in (float("inf"), float("-inf")):
            raise _fail(path, f"expected a finite number, got {_describe(value)}")
        if positive and value <= 0:
            raise _fail(path, f"must be greater than 0, got {_describe(value)}")
        _checkRange(value, path, minimum, maximum)
        return value

    return check


def _checkRange(
    value: float, path: str, minimum: Optional[float], maximum: Optional[float]
) -> None:
    """
    Raise unless C{minimum <= value <= maximum} (either bound may be absent).
    """
    if minimum is not None and maximum is not None:
        if not minimum <= value <= maximum:
            raise _fail(path, f"must be between {minimum} and {maximum}, got {_describe(value)}")
    elif minimum is not None and value < minimum:
        raise _fail(path, f"must be at least {minimum}, got {_describe(value)}")
    elif maximum is not None and value > maximum:
        raise _fail(path, f"must be at most {maximum}, got {_describe(value)}")


def _firstOutputTimeout(value: Any, path: str) -> float:
    """
    C{0} (off) or a number of seconds in C{30..600} (R20).
    """
    value = _number()(value, path)
    if value != 0 and not 30 <= value <= 600:
        raise _fail(path, f"must be 0 (off) or between 30 and 600, got {_describe(value)}")
    return value


def _boolean(value: Any, path: str) -> bool:
    """
    A YAML boolean (C{true}/C{false}).
    """
    if not isinstance(value, bool):
        raise _fail(path, f"expected true or false, got {_describe(value)}")
    return value


def _string(value: Any, path: str) -> str:
    """
    A non-empty string.
    """
    if not isinstance(value, str):
        raise _fail(path, f"expected a string, got {_describe(value)}")
    if not value.strip():
        raise _fail(path, "must not be empty")
    return value


def _secretString(value: Any, path: str) -> str:
    """
    A non-empty string whose value is never echoed in an error.
    """
    if not isinstance(value, str):
        raise _fail(path, f"expected a string, got {_describe(value, secret=True)}")
    if not value.strip():
        raise _fail(path, "must not be empty")
    return value


def _optional(inner: Validator) -> Validator:
    """
    L{None} (YAML C{null}) or whatever C{inner} accepts.
    """

    def check(value: Any, path: str) -> Any:
        return None if value is None else inner(value, path)

    return check


def _choice(*choices: str, aliases: Optional[Dict[Any, str]] = None) -> Validator:
    """
    One of C{choices}.

    @param aliases: extra accepted values and what they mean, e.g.
        C{{False: "off"}} because YAML 1.1 reads a bare C{off} as false.
    """

    def check(value: Any, path: str) -> str:
        if aliases:
            for alias, meaning in aliases.items():
                if type(value) is type(alias) and value == alias:
                    return meaning
        if not isinstance(value, str) or value not in choices:
            expected = ", ".join(choices[:-1]) + " or " + choices[-1]
            raise _fail(path, f"expected {expected}, got {_describe(value)}")
        return value

    return check


def _stringTuple(value: Any, path: str) -> tuple:
    """
    A non-empty list of non-empty strings, as a tuple.
    """
    if not isinstance(value, list):
        raise _fail(path, f"expected a list of strings, got {_describe(value)}")
    if not value:
        raise _fail(path, "must not be empty (omit the key to allow everything)")
    return tuple(_string(item, f"{path}[{i}]") for i, item in enumerate(value))


def _stringMap(value: Any, path: str) -> dict:
    """
    A mapping of string to string.
    """
    if not isinstance(value, dict):
        raise _fail(path, f"expected a mapping of strings, got {_describe(value)}")
    result = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise _fail(path, f"keys must be non-empty strings, got {_describe(k)}")
        result[k] = _string(v, _join(path, k))
    return result


def _instant(value: Any, path: str) -> float:
    """
    A point in time (C{keys[].expires_at}): an ISO 8601 time
    (C{"2027-03-01T00:00:00Z"}; without a zone it is UTC; YAML's own
    timestamps too) or Unix seconds. Either form is at or after the Unix
    epoch: a time before 1970 is refused in both, so what is stored (Unix
    seconds) passes this check again when it is read back.

    @return: Unix seconds (>= 0).
    @raise ConfigError: naming C{path}.
    """
    import datetime

    if isinstance(value, bool):
        raise _fail(path, f"expected an ISO 8601 time or Unix seconds, got {_describe(value)}")
    if isinstance(value, (int, float)):
        return float(_number(0)(value, path))
    if isinstance(value, datetime.date) and not isinstance(value, datetime.datetime):
        value = datetime.datetime(value.year, value.month, value.day)
    if isinstance(value, str):
        text = value.strip()
        try:
            value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise _fail(path, f"expected an ISO 8601 time, e.g. 2027-03-01T00:00:00Z, got"
                              f" {_describe(text)}") from None
    if not isinstance(value, datetime.datetime):
        raise _fail(path, f"expected an ISO 8601 time or Unix seconds, got {_describe(value)}")
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    seconds = value.timestamp()
    if seconds < 0:
        raise _fail(path, "must be at or after 1970-01-01T00:00:00Z, got "
                          + _describe(value.isoformat()))
    return seconds


def _statusTuple(value: Any, path: str) -> tuple:
    """
    A list of HTTP status codes (may be empty), as a tuple.
    """
    if not isinstance(value, list):
        raise _fail(path, f"expected a list of status codes, got {_describe(value)}")
    check = _integer(100, 599)
    return tuple(check(item, f"{path}[{i}]") for i, item in enumerate(value))


def _dottedName(value: Any, path: str) -> str:
    """
    A dotted Python name such as C{mypackage.module.Class}.
    """
    value = _string(value, path)
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", value):
        raise _fail(
            path, f"expected a dotted name like package.module.Class, got {_describe(value)}"
        )
    return value


def _endpoint(value: Any, path: str) -> str:
    """
    A Twisted server endpoint string such as C{tcp:8080:interface=127.0.0.1}.
    """
    from twisted.internet.endpoints import serverFromString

    value = _string(value, path)
    try:
        # Parsing does not touch the reactor for the built-in endpoint types.
        serverFromString(None, value)
    except Exception as e:
        raise _fail(path, f"invalid Twisted server endpoint string {value!r}: {e}")
    return value


def urlProblem(value: str, query: bool = False) -> Optional[str]:
    """
    What makes an absolute URL unusable as a place to connect to, the
    check every URL-valued key shares (C{base_url}, C{auth_base_url},
    proxy URLs, C{state.redis_url}, C{tracing.endpoint}): a config mistake
    is refused when the file or an admin change is read, not found later as
    a failing dial on every turn.

    The scheme is the caller's to check.

    @param value: the URL, already stripped of surrounding blanks.
    @param query: whether a C{?query} is allowed (C{rediss://} options).
    @return: L{None} for a usable URL, else one line saying what is wrong;
        the line never repeats the URL nor its userinfo (it may carry a
        password, behaviour.md R100).
    """
    # The userinfo is the proxy's or Redis's own business (a password may
    # hold anything); the rest goes on a request line or into a dial.
    scheme, sep, rest = value.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    shown = scheme + sep + rest[len(authority.rpartition("@")[0]):]
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in shown):
        return "invalid URL: it contains a space or control character"
    try:
        parts = urlsplit(value)
        host = parts.hostname
    except ValueError:
        # urlsplit checks a bracketed host: C{[::1]}.
        return "invalid URL: bad IPv6 address in the host"
    try:
        port = parts.port
    except ValueError:
        return "invalid URL: bad port (expected 1-65535)"
    if port == 0:
        return "invalid URL: bad port 0 (expected 1-65535)"
    # A name or an IPv4 address (an IPv6 one, with its C{:}, urlsplit checked).
    if host and ":" not in host and (
            not all(c.isalnum() or c in "-._" for c in host) or not host.strip(".")):
        return "invalid URL: bad character in the host"
    if "#" in value:
        return "invalid URL: a #fragment is not allowed"
    if "?" in value and not query:
        return "invalid URL: a ?query is not allowed here"
    return None


def _httpURL(value: Any, path: str) -> str:
    """
    An C{http://} or C{https://} URL, returned without a trailing slash:
    a host, an optional port 1-65535 and path; no query or fragment
    (L{urlProblem}).

    @raise ConfigError: C{"<path>: ..."}, one line.
    """
    value = _string(value, path).strip()
    problem = urlProblem(value)
    if problem is not None:
        raise _fail(path, problem)
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(path, f"expected an http:// or https:// URL, got {_describe(value)}")
    return value.rstrip("/")


def _redisURL(value: Any, path: str) -> str:
    """
    A C{redis://}, C{rediss://} (TLS) or C{unix://} URL, as
    L{relay.wire.redisclient.parseRedisUrl} reads it; a C{rediss://} URL's
    certificate files must load.
    """
    from relay.wire.redisclient import parseRedisUrl

    value = _string(value, path)
    try:
        target = parseRedisUrl(value)
        if target.tls:
            target.tlsOptions()
    except ValueError as e:
        # The URL may carry a password: name the problem, not the value.
        raise _fail(path, str(e))
    if target.scheme != "unix":
        problem = urlProblem(value.strip(), query=True)
        if problem is not None:
            raise _fail(path, problem)
    return value


def _sentinelAddresses(value: Any, path: str) -> tuple:
    """
    C{state.redis_sentinels}: a non-empty list of C{host:port} strings
    (an IPv6 host in brackets, C{[::1]:26379}), as a tuple of those strings.
    """
    items = _stringTuple(value, path)
    for i, item in enumerate(items):
        try:
            from relay.wire.redisclient import parseHostPort

            parseHostPort(item)
        except ValueError as e:
            raise _fail(f"{path}[{i}]", str(e))
    return items


def _stateSection(value: Any, path: str) -> StateSettings:
    """
    C{state:} with its cross-key rules: C{redis_sentinels} and
    C{redis_master_name} come together.
    """
    fields = validateSection(value, path, _STATE)
    sentinels = fields.get("redis_sentinels", ())
    name = fields.get("redis_master_name")
    if sentinels and not name:
        raise _fail(f"{path}.redis_master_name", "is required with state.redis_sentinels")
    if name and not sentinels:
        raise _fail(f"{path}.redis_sentinels", "is required with state.redis_master_name")
    url = fields.get("redis_url")
    if sentinels and url is not None and urlsplit(url).scheme != "redis":
        raise _fail(f"{path}.redis_url", "with state.redis_sentinels only a redis:// URL"
                    " (txredisapi's Sentinel connects without TLS or unix sockets)")
    return StateSettings(**fields)


def _usageProbeInterval(value: Any, path: str) -> float:
    """
    C{0} (never) or at least 30 seconds between usage probes.
    """
    value = _number(0, 86400)(value, path)
    if value != 0 and value < 30:
        raise _fail(path, f"must be 0 (off) or at least 30, got {_describe(value)}")
    return value


# ---------------------------------------------------------------------------
# The whitelists. Key -> validator. Defaults live in relay.base.records.
# ---------------------------------------------------------------------------

_BREAKER: Dict[str, Validator] = {
    "failures": _integer(1),
    "window_seconds": _number(positive=True),
    "open_seconds": _number(positive=True),
    "max_open_seconds": _number(positive=True),
    "enabled": _boolean,
}

_SCHEDULING: Dict[str, Validator] = {
    "sticky_session_wait_timeout": _number(0),
    "sticky_session_max_waiting": _integer(0),
    "fallback_wait_timeout": _number(0),
    "fallback_max_waiting": _integer(0),
    "user_wait_timeout": _number(0),
    "user_max_waiting": _integer(0),
    "sticky_session_ttl_seconds": _number(positive=True),
    "previous_response_ttl_seconds": _number(positive=True),
    "response_owner_ttl_seconds": _number(60),
    "ping_interval": _number(5, 30),
    "quota_aware": _boolean,
    "quota_threshold_percent": _number(0, 100),
}

_OAUTH: Dict[str, Validator] = {
    "auth_base_url": _httpURL,
    "client_id": _string,
    "refresh_margin_seconds": _number(0),
    "refresh_timeout_seconds": _number(1, 300),
    "usage_probe_interval_seconds": _usageProbeInterval,
    "usage_probe_after_cooldown": _boolean,
}

_WEBSOCKET: Dict[str, Validator] = {
    "mode_default": _choice(*WS_MODES, aliases={False: "off"}),
    "pool_capacity_factor": _number(positive=True),
    "client_first_message_timeout_seconds": _number(positive=True),
    "inter_turn_idle_timeout_seconds": _number(positive=True),
    "max_frame_bytes": _integer(1024),
    "client_max_age_seconds": _number(60),
}

_UPSTREAM: Dict[str, Validator] = {
    "connect_timeout_seconds": _number(positive=True),
    "header_timeout_seconds": _number(positive=True),
    "stream_idle_timeout_seconds": _number(positive=True),
}


_LIMITS: Dict[str, Validator] = {
    "header_timeout_seconds": _number(1, 3600),
    "min_body_bytes_per_second": _integer(0),
    "body_rate_window_seconds": _number(1, 600),
    "max_connections": _integer(0),
    "max_connections_per_address": _integer(0),
    "body_bytes_in_flight_per_key": _integer(0),
    "body_bytes_in_flight": _integer(0),
    "max_decompression_ratio": _number(2),
}


def _nested(table: Dict[str, Validator], cls: type) -> Validator:
    """
    A nested mapping validated by C{table} and built into C{cls}.
    """

    def check(value: Any, path: str) -> Any:
        return cls(**validateSection(value, path, table))

    return check


_GATEWAY: Dict[str, Validator] = {
    "max_account_switches": _integer(0),
    "max_request_body_bytes": _integer(1024),
    "first_output_timeout_seconds": _firstOutputTimeout,
    "retry_interval_ms": _integer(0, 30000),
    "transport_retry_policy": _choice(*TRANSPORT_RETRY_POLICIES),
    "transport_error_cooldown_seconds": _number(0),
    "retry_budget_percent": _number(0, 100),
    "stream_keepalive_interval": _number(0, 300),
    "shutdown_grace_seconds": _number(0, 3600),
    "usage_drain_seconds": _number(0, 3600),
    "usage_drain_bytes": _integer(0, 2**31),
    "breaker": _nested(_BREAKER, BreakerSettings),
    "scheduling": _nested(_SCHEDULING, SchedulingSettings),
    "websocket": _nested(_WEBSOCKET, WebSocketSettings),
    "upstream": _nested(_UPSTREAM, UpstreamSettings),
    "oauth": _nested(_OAUTH, OAuthSettings),
    "limits": _nested(_LIMITS, LimitSettings),
}

_STATE: Dict[str, Validator] = {
    "backend": _choice(*STATE_BACKENDS),
    "redis_url": _redisURL,
    "on_redis_error": _choice(*REDIS_ERROR_POLICIES),
    "concurrency_slot_ttl_minutes": _number(positive=True),
    "redis_sentinels": _sentinelAddresses,
    "redis_master_name": _string,
}

_COMPONENTS: Dict[str, Validator] = {
    "classifier": _optional(_dottedName),
    "dialer": _optional(_dottedName),
    "admission": _optional(_dottedName),
}

_USAGE: dict[str, Validator] = {
    "flush_interval_seconds": _number(1, 3600),
    "retention_days": _integer(1, 3660),
}

_TRACING: Dict[str, Validator] = {
    "exporter": _choice("none", "otlp", "console"),
    "endpoint": _optional(_httpURL),
    "service_name": _string,
    "sample_ratio": _number(0, 1),
}

_LOG: Dict[str, Validator] = {
    "format": _choice(*LOG_FORMATS),
}

# Entries of lists. Keys that are resolved by hand (secrets, env vars,
# proxies) map to a validator of the raw value; they are popped before the
# remaining keys are handed to the model class.
KEY_FIELDS: Dict[str, Validator] = {
    "name": _string,
    "key": _secretString,
    "key_env": _string,
    "concurrency": _integer(0),
    "daily_tokens": _optional(_integer(1)),
    "monthly_tokens": _optional(_integer(1)),
    # The key's policy (behaviour.md R102).
    "models": _optional(_stringTuple),
    "deny_models": _optional(_stringTuple),
    "expires_at": _optional(_instant),
    "rpm": _optional(_integer(1)),
    "tpm": _optional(_integer(1)),
    "accounts": _optional(_stringTuple),
    "group": _optional(_string),
    "daily_usd": _optional(_number(0, positive=True)),
    "monthly_usd": _optional(_number(0, positive=True)),
    # R108: the output a budget reservation assumes.
    "max_turn_output_tokens": _optional(_integer(1, 10_000_000)),
    "disabled": _boolean,
}

_PRICE: Dict[str, Validator] = {
    "input": _number(0),
    "cached_input": _optional(_number(0)),
    "output": _number(0),
    "reasoning": _optional(_number(0)),
    # R109: service tier multipliers; per_call only on prices.default.
    "priority": _optional(_number(0)),
    "flex": _optional(_number(0)),
    "per_call": _optional(_number(0)),
    # R115: an image model's price per image
    "per_image": _optional(_number(0)),
}

_TOOL_PRICE: Dict[str, Validator] = {
    "per_call": _number(0),
}

_REQUEST_LOG: Dict[str, Validator] = {
    "max_records": _integer(100, 10_000_000),
    "retention_days": _number(0, 3660, positive=True),
    "flush_interval_seconds": _number(0.05, 60),
    "sample_rate": _number(0, 1),
    "sample_max_bytes": _integer(256, 16 * 2**20),
}

_PROXY: Dict[str, Validator] = {
    "id": _string,
    "url": _secretString,
    "url_env": _string,
}

ACCOUNT_FIELDS: Dict[str, Validator] = {
    "id": _string,
    "type": _choice(*ACCOUNT_TYPES),
    "base_url": _httpURL,
    "api_key": _secretString,
    "api_key_env": _string,
    "access_token": _secretString,
    "access_token_env": _string,
    "refresh_token": _secretString,
    "refresh_token_env": _string,
    "id_token": _secretString,
    "id_token_env": _string,
    "auth_file": _string,
    "auth_base_url": _optional(_httpURL),
    "chatgpt_account_id": _string,
    "auto_redeem_resets": _boolean,
    "concurrency": _integer(0),
    "priority": _integer(),
    "models": _optional(_stringTuple),
    "model_mapping": _optional(_stringMap),
    "ws_mode": _optional(_choice(*WS_MODES, aliases={False: "off"})),
    "proxy": _optional(_secretString),
    "proxy_env": _string,
    "proxy_id": _string,
    "pool_mode": _boolean,
    "pool_mode_retry_count": _integer(0, 10),
    "pool_mode_retry_status_codes": _statusTuple,
}

_TOP: Dict[str, Validator] = {
    "listen": _endpoint,
    "workers": _integer(1, 64),
    "admin_key": _optional(_secretString),
    "admin_key_env": _string,
    "metrics_key": _optional(_secretString),
    "metrics_key_env": _string,
    "log": lambda value, path: validateSection(value, path, _LOG),
    "keys": lambda value, path: _list(value, path),
    "accounts": lambda value, path: _list(value, path),
    "proxies": lambda value, path: _list(value, path),
    "gateway": _nested(_GATEWAY, GatewaySettings),
    "components": _nested(_COMPONENTS, ComponentSettings),
    "state": _stateSection,
    "database": _string,
    "usage": _nested(_USAGE, UsageSettings),
    "alerts": lambda value, path: value,  # relay.configuration.alerts
    "groups": lambda value, path: value,
    "prices": lambda value, path: value,
    "anthropic_models": lambda value, path: _anthropicModels(value, path),
    "request_log": _nested(_REQUEST_LOG, RequestLogSettings),
    "tracing": _nested(_TRACING, TracingSettings),
    "demo": _boolean,
    "operators": lambda value, path: value,
    "oidc": lambda value, path: value,
}


def _anthropicModels(value: Any, path: str) -> dict:
    """
    C{anthropic_models}: family -> OpenAI model (behaviour.md R115).

    @raise ConfigError: naming the entry.
    """
    from relay.translate.anthropic.models import checkTable

    try:
        return checkTable({} if value is None else value, path)
    except ValueError as e:
        raise ConfigError(_oneLine(str(e))) from None


def validateSection(value: Any, path: str, table: Mapping[str, Validator]) -> Dict[str, Any]:
    """
    Validate a mapping against a whitelist.

    @param value: the parsed YAML value; L{None} counts as an empty mapping.
    @param path: its key path, for messages.
    @param table: key -> validator.
    @return: key -> converted value, for the keys present only.
    @raise ConfigError: on a non-mapping or an unknown key.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(path or "top level", f"expected a mapping, got {_describe(value)}")
    result = {}
    for key, item in value.items():
        if key not in table:
            hint = ""
            if isinstance(key, str):
                close = difflib.get_close_matches(key, list(table), n=1)
                if close:
                    hint = f" (did you mean {close[0]}?)"
            raise ConfigError(_oneLine(f"unknown key {_join(path, key)}{hint}"))
        result[key] = table[key](item, _join(path, key))
    return result


def _list(value: Any, path: str) -> list:
    """
    A YAML list (L{None} counts as empty).
    """
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(path, f"expected a list, got {_describe(value)}")
    return value


# ---------------------------------------------------------------------------
# Secrets and environment variables
# ---------------------------------------------------------------------------


def _secret(
    values: Dict[str, Any],
    name: str,
    path: str,
    label: str,
    environ: Mapping[str, str],
    required: bool,
) -> Optional[str]:
    """
    Resolve C{name} or C{name_env} from an already validated entry.

    @param values: the entry's validated keys (C{name} and C{name_env} are
        removed from it).
    @param name: e.g. C{api_key}.
    @param path: the entry's key path, e.g. C{accounts[0]} (C{""} at the
        top level).
    @param label: the entry's name for messages, e.g. C{accounts[0] (a1)}.
    @param environ: the environment to read C{*_env} variables from.
    @param required: raise when neither is given.
    @return: the secret, or L{None}.
    @raise ConfigError: both given, neither given (when required), or the
        variable is unset or empty. The value is never part of a message.
    """
    envKey = name + "_env"
    direct = values.pop(name, None)
    variable = values.pop(envKey, None)
    if direct is not None and variable is not None:
        raise ConfigError(f"{label}: give {name} or {envKey}, not both")
    if variable is not None:
        where = _join(path, envKey)
        resolved = environ.get(variable)
        if resolved is None:
            raise ConfigError(f"{where}: environment variable {variable} is not set")
        if not resolved.strip():
            raise ConfigError(f"{where}: environment variable {variable} is empty")
        return resolved
    if direct is None and required:
        raise ConfigError(f"{label}: {name} or {envKey} is required")
    return direct


def parseProxyURL(url: str, proxyId: str, path: str) -> ProxySpec:
    """
    Parse C{socks5://user:pass@host:port}, C{socks5h://...} or
    C{http://user:pass@host:port} into a L{ProxySpec}.

    @param url: the proxy URL (a secret: never echoed in errors).
    @param proxyId: the L{ProxySpec.id} to give it.
    @param path: the key path for messages.
    @raise ConfigError: on a malformed URL.
    """
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise _fail(path, "invalid proxy URL (bad port?)")
    if parts.scheme not in PROXY_SCHEMES:
        raise _fail(path, "invalid proxy URL: scheme must be socks5, socks5h or http")
    if not parts.hostname:
        raise _fail(path, "invalid proxy URL: host is missing")
    if port is None:
        raise _fail(path, "invalid proxy URL: port is missing")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise _fail(path, "invalid proxy URL: expected scheme://[user:pass@]host:port")
    problem = urlProblem(url.strip())
    if problem is not None:
        raise _fail(path, problem.replace("invalid URL", "invalid proxy URL", 1))
    username = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return ProxySpec(
        id=proxyId,
        scheme=parts.scheme,
        host=parts.hostname,
        port=port,
        username=username or None,
        password=password or None,
    )


# ---------------------------------------------------------------------------
# Lists: proxies, keys, accounts
# ---------------------------------------------------------------------------


def _parseProxies(raw: list, environ: Mapping[str, str]) -> Tuple[ProxySpec, ...]:
    """
    Parse the top-level C{proxies:} list.

    @rtype: L{tuple} of L{ProxySpec}
    """
    proxies = []
    seen = set()
    for i, entry in enumerate(raw):
        path = f"proxies[{i}]"
        values = validateSection(entry, path, _PROXY)
        if "id" not in values:
            raise ConfigError(f"{path}: id is required")
        proxyId = values["id"]
        if proxyId in seen:
            raise ConfigError(f"{path}.id: duplicate proxy id {proxyId!r}")
        seen.add(proxyId)
        label = f"{path} ({proxyId})"
        url = _secret(values, "url", path, label, environ, required=True)
        proxies.append(parseProxyURL(url, proxyId, f"{path}.url"))
    return tuple(proxies)


def _parseKeys(raw: list, environ: Mapping[str, str]) -> Tuple[ClientKey, ...]:
    """
    Parse the C{keys:} list.

    @rtype: L{tuple} of L{ClientKey}
    """
    keys = []
    names: Dict[str, int] = {}
    secretsSeen: Dict[str, int] = {}
    for i, entry in enumerate(raw):
        path = f"keys[{i}]"
        values = validateSection(entry, path, KEY_FIELDS)
        if "name" not in values:
            raise ConfigError(f"{path}: name is required")
        name = values["name"]
        label = f"{path} ({name})"
        if name in names:
            raise ConfigError(
                f"{path}.name: duplicate key name {name!r} (also keys[{names[name]}])"
            )
        names[name] = i
        secret = _secret(values, "key", path, label, environ, required=True)
        if secret in secretsSeen:
            other = secretsSeen[secret]
            raise ConfigError(f"{label}: duplicate key value (same as keys[{other}])")
        secretsSeen[secret] = i
        keys.append(ClientKey(key=secret, **values))
    return tuple(keys)


def _parseGroups(raw: Any, accounts: Tuple[Account, ...]) -> dict:
    """
    Parse C{groups:}: group name -> a list of account ids, each
    a configured account.

    @return: name -> tuple of account ids.
    @raise ConfigError: naming the group or the unknown account.
    """
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail("groups", f"expected a mapping of group name to account ids, got"
                              f" {_describe(raw)}")
    known = {a.id for a in accounts}
    groups = {}
    for name, members in raw.items():
        path = _join("groups", name)
        if not isinstance(name, str) or not name.strip():
            raise _fail("groups", f"group names must be non-empty strings, got {_describe(name)}")
        ids = _stringTuple(members, path)
        for i, accountId in enumerate(ids):
            if accountId not in known:
                raise _fail(f"{path}[{i}]", f"unknown account id {accountId!r} (not in accounts)")
        groups[name] = ids
    return groups


_OPERATOR = {"name": _string, "role": _choice(*OPERATOR_ROLES), "password_hash_env": _string,
             "email": _string}

_OIDC = {"issuer": _httpURL, "client_id": _string, "client_secret": _secretString,
         "client_secret_env": _string, "claim": _string, "redirect_url": _httpURL,
         "scopes": _stringTuple}


def _parseOperators(raw: Any, environ: Mapping[str, str]) -> tuple:
    """
    Parse C{operators:} (L{relay.configuration.operators}).
    """
    entries = [(f"operators[{i}]", validateSection(entry, f"operators[{i}]", _OPERATOR))
               for i, entry in enumerate(_list(raw, "operators"))]
    return operatorsFrom(entries, environ)


def _parseOIDC(raw: Any, environ: Mapping[str, str]):
    """
    Parse C{oidc:} (L{relay.configuration.operators}), or L{None}.
    """
    if raw is None:
        return None
    values = validateSection(raw, "oidc", _OIDC)
    secret = _secret(values, "client_secret", "oidc", "oidc", environ, required=False)
    return oidcFrom(values, secret)


def parsePrices(raw: Any) -> dict:
    """
    Parse C{prices:}: model -> C{{input, cached_input, output,
    reasoning, priority, flex}} in US dollars per 1M tokens (C{priority}
    and C{flex}: tier multipliers, R109); C{input} and C{output} are
    required unless C{per_image} (dollars per image of an image model,
    R115; names like C{gpt-image-1:high:1024x1024} refine it) is given. A hosted tool (C{web_search}, C{file_search},
    C{code_interpreter}, C{image_generation}) -> C{{per_call}} dollars;
    C{default} -> a price for anything unpriced (with C{per_call} for
    tools), or C{null}.

    @return: model -> L{relay.tenants.prices.Price}, tool ->
        L{relay.tenants.prices.ToolPrice}, C{default} -> L{Price} (absent
        when C{null}).
    """
    from relay.tenants.prices import HOSTED_TOOLS, Price, ToolPrice

    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail("prices", f"expected a mapping of model to prices, got {_describe(raw)}")
    prices = {}
    for model, entry in raw.items():
        if not isinstance(model, str) or not model.strip():
            raise _fail("prices", f"model names must be non-empty strings, got {_describe(model)}")
        path = _join("prices", model)
        if model in HOSTED_TOOLS:
            values = validateSection(entry, path, _TOOL_PRICE)
            if "per_call" not in values:
                raise ConfigError(f"{path}: per_call is required (US dollars per call)")
            prices[model] = ToolPrice(**values)
            continue
        if model == "default" and entry is None:
            continue
        values = validateSection(entry, path, _PRICE)
        if model != "default" and values.get("per_call") is not None:
            raise ConfigError(f"{path}.per_call: only hosted tools and default have per_call")
        for required in ("input", "output"):
            if required not in values and values.get("per_image") is not None:
                values[required] = 0.0  # an image model priced per image (R115)
            if required not in values:
                raise ConfigError(f"{path}: {required} is required (US dollars per 1M tokens)")
        prices[model] = Price(**values)
    return prices


def _checkKeyAccounts(keys: Tuple[ClientKey, ...], accounts: Tuple[Account, ...],
                      groups: dict) -> None:
    """
    A key's C{accounts} name configured accounts and its
    C{group} a configured group; a key has one or the other.

    @raise ConfigError: naming the key.
    """
    known = {a.id for a in accounts}
    for i, key in enumerate(keys):
        label = f"keys[{i}] ({key.name})"
        if key.accounts is not None and key.group is not None:
            raise ConfigError(f"{label}: give accounts or group, not both")
        if key.group is not None and key.group not in groups:
            raise ConfigError(f"keys[{i}].group: unknown group {key.group!r} (not in groups)")
        for j, accountId in enumerate(key.accounts or ()):
            if accountId not in known:
                raise ConfigError(
                    f"keys[{i}].accounts[{j}]: unknown account id {accountId!r} (not in accounts)"
                )


def _parseAccounts(
    raw: list, proxies: Tuple[ProxySpec, ...], environ: Mapping[str, str]
) -> Tuple[Account, ...]:
    """
    Parse the C{accounts:} list.

    @param proxies: the top-level proxies, for C{proxy_id}.
    @rtype: L{tuple} of L{Account}
    """
    byId = {p.id: p for p in proxies}
    accounts = []
    seen: Dict[str, int] = {}
    for i, entry in enumerate(raw):
        path = f"accounts[{i}]"
        values = validateSection(entry, path, ACCOUNT_FIELDS)
        if "id" not in values:
            raise ConfigError(f"{path}: id is required")
        accountId = values["id"]
        if accountId in seen:
            raise ConfigError(
                f"{path}.id: duplicate account id {accountId!r} (also accounts[{seen[accountId]}])"
            )
        seen[accountId] = i
        accounts.append(_accountFrom(values, path, byId, environ))
    return tuple(accounts)


def parseAccount(
    entry: Any, proxies: Tuple[ProxySpec, ...], environ: Mapping[str, str], path: str
) -> Account:
    """
    Validate one account mapping exactly as an entry of C{accounts:} is
    validated (the admin API's accounts use the file's fields
    and rules).

    @param entry: the mapping (as YAML would give it).
    @param proxies: the top-level proxies, for C{proxy_id}.
    @param environ: where C{*_env} keys are looked up.
    @param path: the key path messages name, e.g. C{account}.
    @rtype: L{Account}
    @raise ConfigError: one line naming the key.
    """
    values = validateSection(entry, path, ACCOUNT_FIELDS)
    if "id" not in values:
        raise ConfigError(f"{path}: id is required")
    return _accountFrom(values, path, {p.id: p for p in proxies}, environ)


def _accountFrom(
    values: Dict[str, Any], path: str, byId: Mapping[str, ProxySpec], environ: Mapping[str, str]
) -> Account:
    """
    Build one account from its validated keys (C{id} present).
    """
    accountId = values["id"]
    label = f"{path} ({accountId})"
    if "type" not in values:
        raise ConfigError(f"{label}: type is required (apikey or oauth)")
    kind = values["type"]

    if kind == "apikey":
        for other in _OAUTH_ONLY:
            if other in values:
                raise ConfigError(f"{path}.{other}: only allowed on an oauth account")
        credential = _secret(values, "api_key", path, label, environ, required=True)
        values.setdefault("base_url", APIKEY_BASE_URL)
    else:
        for other in ("api_key", "api_key_env", "pool_mode"):
            if other in values:
                raise ConfigError(f"{path}.{other}: only allowed on an apikey account")
        credential = _oauthTokens(values, path, label, environ)
        values.setdefault("base_url", OAUTH_BASE_URL)

    values["proxy"] = _accountProxy(values, path, label, accountId, byId, environ)
    if values.get("model_mapping") is None:
        values.pop("model_mapping", None)
    return Account(credential=credential, **values)


_OAUTH_ONLY = (
    "access_token", "access_token_env", "chatgpt_account_id", "refresh_token",
    "refresh_token_env", "id_token", "id_token_env", "auth_file", "auth_base_url",
    "auto_redeem_resets",
)
"""Account keys that only an oauth account may have."""


def _oauthTokens(
    values: Dict[str, Any], path: str, label: str, environ: Mapping[str, str]
) -> str:
    """
    Resolve an oauth account's tokens: C{access_token},
    C{refresh_token} and C{id_token} (each also as C{*_env}), or
    C{auth_file} (a Codex C{auth.json}, protocol.md 7.4). At least an access
    or a refresh token is needed; C{chatgpt_account_id} defaults to the
    tokens' account claim. Sets C{refresh_token}, C{id_token},
    C{last_refresh}, C{token_source} and C{chatgpt_account_id} in
    C{values}.

    @return: the access token (empty when only a refresh token is given:
        relay refreshes before the first request).
    @raise ConfigError: no token, tokens and C{auth_file} together, an
        unreadable C{auth_file}, or no account id.
    """
    from relay.oauth.authfile import AuthFileError, readAuthFile
    from relay.oauth.tokens import accountIdOf

    given = [k for k in ("access_token", "access_token_env", "refresh_token",
                         "refresh_token_env", "id_token", "id_token_env") if k in values]
    envGiven = any(k.endswith("_env") for k in given)
    access = _secret(values, "access_token", path, label, environ, required=False)
    refresh = _secret(values, "refresh_token", path, label, environ, required=False)
    idToken = _secret(values, "id_token", path, label, environ, required=False)
    authFile = values.pop("auth_file", None)
    source = "env" if envGiven else "config"
    if authFile is not None:
        if given:
            raise ConfigError(f"{label}: give auth_file or tokens ({given[0]}), not both")
        try:
            auth = readAuthFile(authFile)
        except AuthFileError as e:
            raise _fail(f"{path}.auth_file", str(e))
        access, refresh, idToken = auth.access_token, auth.refresh_token, auth.id_token
        if auth.account_id and "chatgpt_account_id" not in values:
            values["chatgpt_account_id"] = auth.account_id
        if auth.last_refresh is not None:
            values["last_refresh"] = auth.last_refresh
        source = "auth_file:" + authFile
    if not access and not refresh:
        raise ConfigError(
            f"{label}: access_token or access_token_env is required"
            " (or refresh_token, refresh_token_env or auth_file)"
        )
    if "chatgpt_account_id" not in values:
        claim = accountIdOf(access, idToken)
        if claim is None:
            raise ConfigError(
                f"{label}: chatgpt_account_id is required for an oauth account"
                " (the tokens carry no account claim)"
            )
        values["chatgpt_account_id"] = claim
    values["refresh_token"] = refresh or None
    values["id_token"] = idToken or None
    values["token_source"] = source
    return access or ""


def _accountProxy(
    values: Dict[str, Any],
    path: str,
    label: str,
    accountId: str,
    byId: Mapping[str, ProxySpec],
    environ: Mapping[str, str],
) -> Optional[ProxySpec]:
    """
    Resolve an account's C{proxy}, C{proxy_env} or C{proxy_id}.

    @return: the L{ProxySpec}, or L{None} for a direct connection.
    """
    given = [k for k in ("proxy", "proxy_env", "proxy_id") if values.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"{label}: give only one of {', '.join(given)}")
    proxyId = values.pop("proxy_id", None)
    if proxyId is not None:
        if proxyId not in byId:
            raise ConfigError(f"{path}.proxy_id: unknown proxy id {proxyId!r} (not in proxies)")
        return byId[proxyId]
    url = _secret(values, "proxy", path, label, environ, required=False)
    if url is None:
        return None
    where = f"{path}.{given[0]}"
    return parseProxyURL(url, f"acct-{accountId}", where)


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """
    A C{SafeLoader} that rejects duplicate keys in a mapping (PyYAML keeps
    the last one silently).
    """

    def construct_mapping(self, node, deep=False):
        """
        Build the mapping, refusing a key given twice.
        """
        seen = set()
        for keyNode, _ in node.value:
            try:
                key = self.construct_object(keyNode, deep=deep)
                hash(key)
            except Exception:
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", keyNode.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parseYAML(text: str, source: str) -> Any:
    """
    Parse YAML text, turning syntax errors into one line with the position.

    @param source: the file name for messages.
    """
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = e.problem or e.context or "invalid YAML"
        raise ConfigError(_oneLine(f"{where}: YAML syntax error: {problem}"))
    except yaml.YAMLError as e:
        raise ConfigError(_oneLine(f"{source}: YAML error: {e}"))


def settingsFromString(
    text: str, environ: Mapping[str, str] = os.environ, source: str = "<string>"
) -> RelayConfig:
    """
    Parse and validate configuration text.

    @param text: the YAML document.
    @param environ: where C{*_env} keys are looked up.
    @param source: the file name used in syntax error messages.
    @return: the validated L{RelayConfig}.
    @raise ConfigError: with a one-line message naming the key path.
    """
    document = _parseYAML(text, source)
    if document is None:
        raise ConfigError(f"{source}: the configuration is empty")
    values = validateSection(document, "", _TOP)

    logSection = values.pop("log", None)
    if logSection and "format" in logSection:
        values["log_format"] = logSection["format"]

    admin = _secret(values, "admin_key", "", "admin_key", environ, required=False)
    if admin is not None:
        values["admin_key"] = admin
    metrics = _secret(values, "metrics_key", "", "metrics_key", environ, required=False)
    if metrics is not None:
        values["metrics_key"] = metrics

    proxies = _parseProxies(values.pop("proxies", []), environ)
    values["proxies"] = proxies
    values["keys"] = _parseKeys(values.pop("keys", []), environ)
    values["accounts"] = _parseAccounts(values.pop("accounts", []), proxies, environ)
    values["groups"] = _parseGroups(values.pop("groups", None), values["accounts"])
    values["prices"] = parsePrices(values.pop("prices", None))
    values["alerts"] = parseAlerts(values.pop("alerts", None), environ)
    _checkKeyAccounts(values["keys"], values["accounts"], values["groups"])
    values["operators"] = _parseOperators(values.pop("operators", None), environ)
    values["oidc"] = _parseOIDC(values.pop("oidc", None), environ)

    config = RelayConfig(**values)
    checkOperatorsNeedAdmin(config)
    checkWorkers(config)
    checkOperatorKeys(config)
    gateway = values.get("gateway")
    if gateway is not None and gateway.breaker.max_open_seconds < gateway.breaker.open_seconds:
        raise ConfigError(
            "gateway.breaker.max_open_seconds: must be at least gateway.breaker.open_seconds"
        )
    return config


MIN_OPERATOR_KEY_LENGTH = 16
"""The shortest admin or metrics key relay accepts."""

MIN_ADMIN_KEY_BITS = 64
"""The least estimated entropy of an admin key outside the demo, bits
(L{secretBits})."""

PUBLISHED_KEYS = frozenset({
    "admin-demo-change-me", "admin-change-me-0000",
    "3f9c07b4d2a86e5c0f7b19d3e4a2c8b6f1d0e9a7",
})
"""Admin keys printed in relay's own files (the demo's configurations, the
README's and docs/running.md's examples, now and before): known to everyone,
so worth nothing outside the demo."""


def secretBits(value: str) -> float:
    """
    A conservative estimate of a secret's entropy, bits: the characters
    that carry information (not a repeat of the one before, not the third
    or later of a run such as C{1234} or C{dcba}, and a value that is one
    unit repeated counts the unit once), each worth log2 of the size
    of the character classes the value uses (26 lower-case letters, 26
    upper-case, 10 digits, 33 others). A value relay itself publishes
    (L{PUBLISHED_KEYS}) is worth 0.

    @param value: the secret.
    @return: the estimate, bits.
    """
    import math

    if value in PUBLISHED_KEYS:
        return 0.0
    for period in range(1, len(value) // 2 + 1):
        if all(value[i] == value[i % period] for i in range(len(value))):
            value = value[:period]
            break
    alphabet = (26 * any(c.islower() for c in value) + 26 * any(c.isupper() for c in value)
                + 10 * any(c.isdigit() for c in value)
                + 33 * any(not (c.isascii() and c.isalnum()) for c in value))
    steps = [ord(b) - ord(a) for a, b in zip(value, value[1:])]
    counted = 1 + sum(1 for i, step in enumerate(steps)
                      if step != 0 and not (abs(step) == 1 and i and steps[i - 1] == step))
    return counted * math.log2(alphabet) if alphabet > 1 else 0.0


def checkOperatorKeys(config: RelayConfig) -> None:
    """
    R99: the admin key and the read-only C{metrics_key}
    are at least L{MIN_OPERATOR_KEY_LENGTH} characters, differ from each
    other and from every client key (a client key that equals the admin
    key would open the admin API to that client). Outside the demo
    (C{demo: true}), the admin key carries at least L{MIN_ADMIN_KEY_BITS}
    of estimated entropy (L{secretBits}): repeats, runs and relay's own
    published keys are refused.

    @raise ConfigError: naming C{admin_key} or C{metrics_key}; the value is
        never part of the message.
    """
    clients = {key.key: key.name for key in config.keys}
    for name in ("admin_key", "metrics_key"):
        value = getattr(config, name)
        if value is None:
            continue
        if len(value) < MIN_OPERATOR_KEY_LENGTH:
            raise ConfigError(
                f"{name}: must be at least {MIN_OPERATOR_KEY_LENGTH} characters long"
            )
        if value in clients:
            raise ConfigError(f"{name}: must differ from every client key (same as keys {clients[value]!r})")
    if config.admin_key is not None and config.admin_key == config.metrics_key:
        raise ConfigError("metrics_key: must differ from admin_key")
    if config.admin_key is not None and not config.demo:
        bits = secretBits(config.admin_key)
        if bits < MIN_ADMIN_KEY_BITS:
            raise ConfigError(
                f"admin_key: too easy to guess (about {bits:.0f} bits, at least"
                f" {MIN_ADMIN_KEY_BITS} needed; relay's published example keys count 0): use a"
                " random key, e.g. the output of 'openssl rand -hex 24'")


def checkWorkers(config: RelayConfig) -> None:
    """
    More than one worker process needs state they share (every
    slot, wait, binding, cooldown, token and setting lives in Redis with
    C{state.backend: redis}; memory state is per process) and a TCP
    C{listen} endpoint (the workers each listen on it with
    C{SO_REUSEPORT}).

    @param config: a parsed L{RelayConfig} (after command-line overrides).
    @raise ConfigError: naming C{workers}.
    """
    if config.workers <= 1:
        return
    if config.state.backend != "redis":
        raise ConfigError(
            f"workers: {config.workers} worker processes need state.backend: redis "
            f"(state.backend: {config.state.backend} is per process)"
        )
    if not config.listen.startswith(("tcp:", "tcp6:")):
        raise ConfigError(
            f"workers: {config.workers} worker processes need a tcp: listen endpoint, "
            f"not {config.listen.split(':', 1)[0]}:"
        )


def loadConfig(path: str, environ: Mapping[str, str] = os.environ) -> RelayConfig:
    """
    Read, parse and validate a configuration file.

    @param path: the YAML file.
    @param environ: where C{*_env} keys are looked up.
    @return: the validated L{RelayConfig}.
    @raise ConfigError: when the file cannot be read or is invalid; the
        message is one line naming the file (read and syntax errors) or the
        key path (validation errors).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(_oneLine(f"{path}: cannot read configuration file: {e.strerror or e}"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: the configuration file is not valid UTF-8")
    return settingsFromString(text, environ=environ, source=str(path))


def checkDatabase(config: RelayConfig) -> None:
    """
    With C{state.backend: memory} the runtime settings live in SQLite at
    C{database}: check that its directory exists and is writable (SQLite
    writes its journal next to the file) and that an existing file is
    writable, so a bad path is a one-line error before start-up rather than
    a CRITICAL sqlite traceback once the reactor runs.

    Relative paths are resolved against the current directory, as SQLite
    will. Called by L{relay.tap.Options}, not by L{loadConfig}: it looks at
    the file system.

    @param config: the parsed L{RelayConfig}.
    @raise ConfigError: e.g. C{database: directory /nope does not exist}.
    """
    if config.state.backend != "memory" or not config.database:
        return
    path = config.database
    if path == ":memory:":
        return
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise _fail("database", f"{directory} is not a directory")
        raise _fail("database", f"directory {directory} does not exist")
    if os.path.isdir(path):
        raise _fail("database", f"{path} is a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise _fail("database", f"directory {directory} is not writable")
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        raise _fail("database", f"{path} is not writable")


def secretsOf(config: RelayConfig) -> frozenset:
    """
    Every secret value in a configuration, for L{relay.base.logs.SecretRedactor}.

    @return: client key values, account credentials, the admin key,
        proxy passwords and webhook URLs (and their paths).
    @rtype: L{frozenset} of L{str}
    """
    secrets = set()
    if config.admin_key:
        secrets.add(config.admin_key)
    if config.metrics_key:
        secrets.add(config.metrics_key)
    for key in config.keys:
        secrets.add(key.key)
    if getattr(config, "oidc", None) is not None:
        secrets.add(config.oidc.client_secret)
    proxies = list(config.proxies)
    for account in config.accounts:
        secrets.add(account.credential)
        secrets.add(account.refresh_token)
        secrets.add(account.id_token)
        if account.proxy is not None:
            proxies.append(account.proxy)
    for proxy in proxies:
        if proxy.password:
            secrets.add(proxy.password)
    for target in config.alerts.webhooks:
        # A webhook URL often carries its token in the path.
        secrets.add(target.url)
        tail = target.url.split("://", 1)[-1].partition("/")[2]
        if len(tail) >= 8:
            secrets.add("/" + tail)
    return frozenset(s for s in secrets if s)
