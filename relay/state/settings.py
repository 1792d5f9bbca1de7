# -*- test-case-name: tests.test_settings -*-
"""
The runtime settings object read on every attempt (behaviour.md R74).

The settings an operator may change while relay runs are the failover and
admission knobs of C{gateway:} listed in L{RUNTIME_KEYS}. They are named as
under C{gateway:} in config.md, either nested (C{{"breaker": {"failures":
5}}}) or flat and dotted (C{{"breaker.failures": 5}}).

Every value passes through L{normalise} on write (the admin API) and on read
(values loaded from the settings store at start-up and on refresh).
Normalisation clamps out-of-range values instead of refusing them (R74:
C{-1 -> 0}, C{40000 -> 30000}, an unknown policy -> C{rotate}); it refuses
only unknown keys and values of the wrong type, with a L{SettingsError}
naming them.

L{RuntimeSettings.current} is a frozen L{GatewaySettings}; a change builds a
new value with L{attrs.evolve} and swaps it in, so a reader always sees one
consistent set, and the next attempt sees the change (R74 "changes apply at
once").
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import attrs
from attrs import define
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import IRuntimeSettings
from relay.base.records import GatewaySettings
from relay.wire.redisclient import logFailure

__all__ = [
    "RUNTIME_KEYS",
    "RuntimeSettings",
    "SettingsError",
    "flatten",
    "nest",
    "normalise",
    "normaliseLenient",
    "snapshotOf",
]


class SettingsError(ValueError):
    """
    A runtime settings change was refused. Nothing was applied.

    @ivar unknownKeys: the dotted names that are not runtime settings, sorted.
    @ivar invalid: dotted name -> why its value was refused.
    """

    def __init__(self, unknownKeys: list | tuple = (), invalid: Optional[dict] = None):
        self.unknownKeys = sorted(unknownKeys)
        self.invalid = dict(invalid or {})
        parts = []
        if self.unknownKeys:
            parts.append("unknown setting(s): " + ", ".join(self.unknownKeys))
        if self.invalid:
            parts.append(
                "invalid value(s): "
                + "; ".join(f"{k}: {why}" for k, why in sorted(self.invalid.items()))
            )
        super().__init__("; ".join(parts) or "invalid settings")

    @property
    def keys(self) -> list:
        """
        @return: every offending dotted name, unknown ones first.
        @rtype: L{list} of L{str}
        """
        return self.unknownKeys + sorted(self.invalid)


# ---------------------------------------------------------------------------
# Value coercion (wrong types raise _Invalid; ranges are clamped afterwards)
# ---------------------------------------------------------------------------


class _Invalid(Exception):
    """
    A value of the wrong type; the message says what was expected.
    """


def _number(value: Any) -> float:
    """
    Coerce a JSON number or a numeric string.

    @raise _Invalid: for booleans, non-numeric strings, NaN and infinities.
    """
    if isinstance(value, bool) or value is None:
        raise _Invalid("expected a number")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _Invalid("expected a number") from None
    else:
        raise _Invalid("expected a number")
    if not math.isfinite(number):
        raise _Invalid("expected a finite number")
    return number


def _int(value: Any) -> int:
    """
    Coerce to an integer, rounding a fractional number to the nearest one.
    """
    return int(round(_number(value)))


def _bool(value: Any) -> bool:
    """
    Coerce a JSON boolean, C{0}/C{1}, or C{"true"}/C{"false"}/C{"on"}/C{"off"}.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
    raise _Invalid("expected true or false")


def _clamp(low: Optional[float] = None, high: Optional[float] = None) -> Callable:
    """
    @return: a function clamping a number into C{[low, high]}.
    """

    def clamp(number):
        if low is not None and number < low:
            number = type(number)(low)
        if high is not None and number > high:
            number = type(number)(high)
        return number

    return clamp


def _described(normaliser: Callable, **schema) -> Callable:
    """
    @return: C{normaliser}, carrying its JSON C{schema} (L{describe}).
    """
    normaliser.schema = schema
    return normaliser


def _floatSetting(low=None, high=None) -> Callable:
    clamp = _clamp(low, high)
    return _described(lambda value: clamp(_number(value)), type="number", minimum=low,
                      maximum=high)


def _intSetting(low=None, high=None) -> Callable:
    clamp = _clamp(low, high)
    return _described(lambda value: clamp(_int(value)), type="integer", minimum=low,
                      maximum=high)


def _policy(value: Any) -> str:
    """
    R72/R74: C{rotate} or C{sticky}; any other text becomes C{rotate}.
    """
    if not isinstance(value, str):
        raise _Invalid('expected "rotate" or "sticky"')
    text = value.strip().lower()
    return text if text in ("rotate", "sticky") else "rotate"


def _firstOutputTimeout(value: Any) -> float:
    """
    R20: 0 (off) or 30..600 seconds. Negative -> 0, 0 < x < 30 -> 30,
    above 600 -> 600.
    """
    number = _number(value)
    if number <= 0:
        return 0.0
    return min(max(number, 30.0), 600.0)


_described(_bool, type="boolean")
_described(_policy, type="string", choices=["rotate", "sticky"])
_described(_firstOutputTimeout, type="number", minimum=0, maximum=600,
           note="0 is off; otherwise 30 to 600")


def describe(settings: GatewaySettings) -> list:
    """
    Every runtime setting with its value and what it accepts, for an
    editor (C{GET /admin/settings/schema}): values outside the range are
    clamped into it on write (R74), never refused.

    @return: C{[{"name" (flat dotted), "value", "type" (integer, number,
        boolean, string), "minimum", "maximum", "choices", "note"}]}, in
        L{RUNTIME_KEYS}' order.
    """
    values = snapshotOf(settings)
    out = []
    for name, normaliser in RUNTIME_KEYS.items():
        schema = getattr(normaliser, "schema", {})
        out.append({"name": name, "value": values[name], "type": schema.get("type"),
                    "minimum": schema.get("minimum"), "maximum": schema.get("maximum"),
                    "choices": schema.get("choices"), "note": schema.get("note")})
    return out


#: Every runtime setting: dotted name -> normaliser (coerce, then clamp).
RUNTIME_KEYS: dict = {
    "max_account_switches": _intSetting(0, 100),
    "first_output_timeout_seconds": _firstOutputTimeout,
    "retry_interval_ms": _intSetting(0, 30000),
    "transport_retry_policy": _policy,
    "transport_error_cooldown_seconds": _floatSetting(0, 86400),
    "retry_budget_percent": _floatSetting(0, 100),
    # R24/R85: 0 = off; at most 300 s.
    "stream_keepalive_interval": _floatSetting(0, 300),
    "scheduling.sticky_session_wait_timeout": _floatSetting(0, 3600),
    "scheduling.sticky_session_max_waiting": _intSetting(0, 100000),
    "scheduling.fallback_wait_timeout": _floatSetting(0, 3600),
    "scheduling.fallback_max_waiting": _intSetting(0, 100000),
    "scheduling.user_wait_timeout": _floatSetting(0, 3600),
    # R26: the user queue has at least one place.
    "scheduling.user_max_waiting": _intSetting(1, 100000),
    # R31: valid range 5..30 s.
    "scheduling.ping_interval": _floatSetting(5, 30),
    "breaker.failures": _intSetting(1, 1000),
    "breaker.window_seconds": _floatSetting(1, 86400),
    "breaker.open_seconds": _floatSetting(1, 86400),
    "breaker.max_open_seconds": _floatSetting(1, 86400),
    "breaker.enabled": _bool,
    # Quota-aware load balance and the token refresh margin.
    "scheduling.quota_aware": _bool,
    "scheduling.quota_threshold_percent": _floatSetting(0, 100),
    "oauth.refresh_margin_seconds": _floatSetting(0, 30 * 86400),
}

_GROUPS = frozenset(key.split(".", 1)[0] for key in RUNTIME_KEYS if "." in key)


# ---------------------------------------------------------------------------
# Shape helpers
# ---------------------------------------------------------------------------


def flatten(values: dict) -> dict:
    """
    Turn nested and/or dotted settings into one flat dotted dict.

    C{{"breaker": {"failures": 5}}} and C{{"breaker.failures": 5}} both give
    C{{"breaker.failures": 5}}. Only the groups of L{RUNTIME_KEYS} (and any
    other dict value) are descended into; names are not checked here.

    @param values: a JSON object.
    @rtype: L{dict}
    @raise SettingsError: when C{values} is not a dict.
    """
    if not isinstance(values, dict):
        raise SettingsError(invalid={"(body)": "expected a JSON object"})
    flat: dict = {}

    def walk(prefix: str, obj: dict) -> None:
        for key, value in obj.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and not (name in RUNTIME_KEYS and not value):
                walk(name + ".", value)
            else:
                # A setting given an object: kept, so its check names it
                # (an empty one would otherwise vanish as "no change").
                flat[name] = value

    walk("", values)
    return flat


def nest(flat: dict) -> dict:
    """
    The inverse of L{flatten}: dotted names -> nested dicts.

    @param flat: dotted name -> value.
    @rtype: L{dict}
    """
    nested: dict = {}
    for name, value in flat.items():
        node = nested
        *groups, leaf = name.split(".")
        for group in groups:
            node = node.setdefault(group, {})
        node[leaf] = value
    return nested


def normalise(values: dict) -> dict:
    """
    Check and normalise a (partial) runtime settings change (R74).

    Values are coerced (numeric strings are accepted) and clamped into their
    ranges; an unknown transport policy becomes C{rotate}.

    @param values: nested or flat settings; only the keys present are
        returned.
    @return: flat dotted name -> normalised value.
    @rtype: L{dict}
    @raise SettingsError: naming every unknown key and every value of the
        wrong type; nothing is returned then.
    """
    flat = flatten(values)
    unknown = [name for name in flat if name not in RUNTIME_KEYS]
    invalid = {}
    result = {}
    for name, value in flat.items():
        if name in unknown:
            continue
        try:
            result[name] = RUNTIME_KEYS[name](value)
        except _Invalid as e:
            invalid[name] = str(e)
    if unknown or invalid:
        raise SettingsError(unknown, invalid)
    return result


def normaliseLenient(values: dict) -> tuple:
    """
    Normalise stored values: like L{normalise}, but drop what cannot be used
    instead of refusing everything (a store written by another version must
    not stop relay from starting).

    @param values: flat or nested settings, e.g. from a settings store.
    @return: C{(normalised, dropped)}: the usable flat values, and the sorted
        names that were dropped.
    @rtype: L{tuple}
    """
    try:
        flat = flatten(values)
    except SettingsError:
        return {}, ["(store)"]
    result, dropped = {}, []
    for name, value in flat.items():
        normaliser = RUNTIME_KEYS.get(name)
        if normaliser is None:
            dropped.append(name)
            continue
        try:
            result[name] = normaliser(value)
        except _Invalid:
            dropped.append(name)
    return result, sorted(dropped)


def snapshotOf(settings: GatewaySettings) -> dict:
    """
    The runtime settings of a L{GatewaySettings}, flat and dotted.

    @rtype: L{dict}
    """
    result = {}
    for name in RUNTIME_KEYS:
        obj: Any = settings
        for part in name.split("."):
            obj = getattr(obj, part)
        result[name] = obj
    return result


def _apply(settings: GatewaySettings, flat: dict) -> GatewaySettings:
    """
    Build a new L{GatewaySettings} with C{flat} (normalised) applied.

    C{breaker.max_open_seconds} is kept at least C{breaker.open_seconds}.
    """
    top = {k: v for k, v in flat.items() if "." not in k}
    for group in _GROUPS:
        sub = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(group + ".")}
        if sub:
            top[group] = attrs.evolve(getattr(settings, group), **sub)
    result = attrs.evolve(settings, **top)
    breaker = result.breaker
    if breaker.max_open_seconds < breaker.open_seconds:
        result = attrs.evolve(
            result, breaker=attrs.evolve(breaker, max_open_seconds=breaker.open_seconds)
        )
    return result


# ---------------------------------------------------------------------------
# The holder
# ---------------------------------------------------------------------------


@implementer(IRuntimeSettings)
@define(eq=False)
class RuntimeSettings:
    """
    Holds the current L{GatewaySettings}. The turn engine reads L{current}
    on every attempt, so a change applies without a restart.

    Construction does not normalise C{current}: the file's values are used
    as the config loader produced them. Values from the store (L{start},
    L{refresh}) and from the admin API (L{update}) are normalised.

    @ivar current: the settings in force (frozen; replaced on each change).
    @ivar store: an optional L{relay.state.settingsdb.ISettingsStore}; when set,
        L{start} loads persisted values and L{update} persists changes.
    """

    current: GatewaySettings = GatewaySettings()
    store: Any = None
    _overrides: dict = attrs.field(factory=dict, init=False)
    """The normalised values set through the admin API or loaded from the
    store (flat dotted names): they win over the file's (L{rebase})."""
    _log = Logger()

    def snapshot(self) -> dict:
        """
        The runtime settings in force, nested as under C{gateway:}.

        @rtype: L{dict}
        """
        return nest(snapshotOf(self.current))

    def flatSnapshot(self) -> dict:
        """
        The runtime settings in force, flat and dotted.

        @rtype: L{dict}
        """
        return snapshotOf(self.current)

    def apply(self, partial: dict, source: str = "admin") -> dict:
        """
        Apply a partial change in memory only, at once.

        @param partial: nested or flat settings (see L{normalise}).
        @param source: who changed it, for the log (C{admin}, C{store}).
        @return: flat dotted name -> new value, for the keys whose value
            actually changed.
        @rtype: L{dict}
        @raise SettingsError: for unknown keys or wrong types; nothing is
            applied then.
        """
        return self._applyNormalised(normalise(partial), source)

    def _applyNormalised(self, values: dict, source: str) -> dict:
        """
        Swap in C{current} with already-normalised flat C{values}; log the
        change.
        """
        before = snapshotOf(self.current)
        self.current = _apply(self.current, values)
        after = snapshotOf(self.current)
        changed = {k: after[k] for k in after if after[k] != before[k]}
        if changed:
            self._log.info(
                "runtime settings changed ({source}): {changed_keys}",
                event="relay.settings_updated",
                source=source,
                changed_keys=sorted(changed),
                values=changed,
            )
        return changed

    def update(self, partial: dict) -> Deferred:
        """
        Apply a partial change (R74): in memory first, so L{current} shows
        it when this returns, then persist it to L{store}.

        @param partial: nested or flat settings (see L{normalise}).
        @return: a L{Deferred} firing with the changed keys (flat dotted
            name -> new value) once persisted (at once without a store);
            it fails when persisting fails, while the in-memory change
            stays in force.
        @rtype: L{Deferred}
        @raise SettingsError: synchronously, for unknown keys or wrong
            types; nothing is applied then.
        """
        values = normalise(partial)
        changed = self._applyNormalised(values, "admin")
        self._overrides.update(values)
        if self.store is None or not values:
            return succeed(changed)
        d = self.store.save(values)
        d.addCallback(lambda _: changed)
        return d

    def start(self) -> Deferred:
        """
        Load the persisted values over the file's values, normalised (R74
        "at startup"). Stored keys that are unknown or unusable are dropped
        with a warning.

        @return: a L{Deferred} firing with the changed keys once loaded (at
            once without a store); a store error fails it.
        @rtype: L{Deferred}
        """
        if self.store is None:
            return succeed({})
        return Deferred.fromCoroutine(self._load("store"))

    def refresh(self) -> Deferred:
        """
        Read the store again and apply what changed (for several processes
        sharing a Redis store). Safe for a periodic job: errors are logged,
        never raised.

        @return: a L{Deferred} firing with the changed keys, C{{}} on error.
        @rtype: L{Deferred}
        """
        if self.store is None:
            return succeed({})
        d = Deferred.fromCoroutine(self._load("refresh"))

        def _ebRefresh(f):
            logFailure(
                self._log, f, "could not refresh runtime settings",
                event="relay.settings_refresh_failed",
            )
            return {}

        return d.addErrback(_ebRefresh)

    async def _load(self, source: str) -> dict:
        """
        Load the store and apply its values.
        """
        stored = await self.store.load()
        values, dropped = normaliseLenient(stored or {})
        if dropped:
            self._log.warn(
                "ignoring stored settings {dropped_keys}",
                event="relay.settings_ignored",
                dropped_keys=dropped,
            )
        self._overrides = dict(values)
        return self._applyNormalised(values, source)

    def rebase(self, base: GatewaySettings) -> dict:
        """
        A live reload changed the file's C{gateway:} section:
        C{base} becomes the file's values, and every value an operator set
        through C{PUT /admin/settings} (persisted, R74) still wins over
        it, as it does at start-up. Keys that are not runtime settings
        (C{websocket.*}, C{upstream.*}, C{shutdown_grace_seconds}, ...)
        come from C{base} alone.

        @param base: the reloaded file's L{GatewaySettings}.
        @return: flat dotted name -> new value for every gateway value that
            changed in force (runtime or not), for the reload's log.
        @rtype: L{dict}
        """
        before = _flatFields(self.current)
        self.current = _apply(base, self._overrides)
        after = _flatFields(self.current)
        changed = {k: after[k] for k in after if after[k] != before.get(k)}
        if changed:
            self._log.info(
                "runtime settings changed (reload): {changed_keys}",
                event="relay.settings_updated",
                source="reload",
                changed_keys=sorted(changed),
                values=changed,
            )
        return changed

    @property
    def overrides(self) -> dict:
        """
        @return: the values set live (admin API or store) that win over
            the file's, flat and dotted.
        @rtype: L{dict}
        """
        return dict(self._overrides)


def _flatFields(settings: GatewaySettings) -> dict:
    """
    Every field of a L{GatewaySettings}, nested groups flattened to dotted
    names (e.g. C{websocket.max_frame_bytes}).

    @rtype: L{dict}
    """
    out = {}
    for name, value in attrs.asdict(settings, recurse=False).items():
        if attrs.has(type(value)):
            for sub, inner in attrs.asdict(value, recurse=False).items():
                out[f"{name}.{sub}"] = inner
        else:
            out[name] = value
    return out
