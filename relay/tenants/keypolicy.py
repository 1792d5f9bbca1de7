# -*- test-case-name: tests.test_tenants_policy -*-
"""
The per-key policy (behaviour.md R102): what a client key may do,
checked by the turn engine before a turn takes a slot or reaches an
account, the same way on every entrypoint (HTTP SSE, JSON, chat) and every
WebSocket mode (each C{response.create} of an open socket is a turn).

Order of the checks (the first refusal wins; L{KeyPolicy.refusal} then the
engine's budget check, then L{KeyPolicy.admitRate}):

 1. C{disabled} -> 401, WebSocket close 1008;
 2. C{expires_at} passed -> 401 "... expired at ...", close 1008;
 3. C{models} / C{deny_models}: a model the key may not use -> 403
    C{model_not_found} (what OpenAI answers for a model a project may not
    use), answered in-band on a WebSocket (R113);
 4. a money budget (C{daily_usd}/C{monthly_usd}) and a model no account
    the key may reach serves under a priced name -> 403
    C{model_not_priced} (relay could not count its cost; unpriced is never
    free); R109: checked again for the account chosen, with the request's
    C{service_tier} and hosted tools (L{KeyPolicy.priceRefusal}); in-band
    on a WebSocket (R113);
 5. token and money budgets -> 429 C{insufficient_quota}, in-band on a
    WebSocket with the budget's reset time (R113): R108, a reservation of
    the turn's estimate (L{KeyPolicy.estimate},
    L{relay.usage.ledger.UsageLedger.reserve});
 6. C{rpm} / C{tpm} (L{relay.tenants.ratelimit}, sliding 60 s) -> 429
    C{rate_limit_exceeded} with C{Retry-After} (whole seconds),
    C{retry-after-ms}, and OpenAI's C{x-ratelimit-limit-requests},
    C{-remaining-requests}, C{-reset-requests} and the C{-tokens}
    variants, so an OpenAI SDK backs off by itself; in-band on a WebSocket
    with the window's reset time (R113). The front door waits for the
    window first when the wait fits (L{relay.frontdoor.keychecks}).

Account groups (C{accounts:} or C{group:} on the key, C{groups:} at the top)
are not a refusal: L{KeyPolicy.allowedAccounts} is put on the turn
(C{Turn.allowedAccounts}) and the scheduler narrows its candidates to it
at the entry of selection, so scheduling, failover and waits only ever
consider the group's accounts.

Checks 1-3 need only the key (and the model); they can run as early as the
key is known. Nothing here reads a clock but the injected one.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterable, Optional

from attrs import define, field, frozen
from twisted.logger import Logger
from zope.interface import implementer

from relay.interfaces import IKeyPolicy
from relay.base.records import ClientError, ClientKey
from relay.base.modelname import listed

__all__ = ["KEYS_LOADING", "KeyPolicy", "formatReset", "notPriced", "rateLimitHeaders"]

EXPIRED_CLOSE = "api key expired"
DISABLED_CLOSE = "api key is disabled"
MODEL_CLOSE = "model not allowed for this api key"


KEYS_LOADING = ClientError(
    503, "api_error",
    "relay is starting and has not read its keys yet; retry in a second",
    code="keys_loading", headers=(("Retry-After", "1"),),
    wsClose=(1013, "relay is starting; retry"),
)
"""The answer while the control store's keys and disables are still not read
after the start-up wait (a request waits for them at its headers first,
L{relay.entry.intake.KEYS_WAIT_SECONDS}; R105): a key disabled through the
admin API must not slip through, and none is refused as unknown."""


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def formatReset(seconds: float) -> str:
    """
    A duration the way OpenAI writes C{x-ratelimit-reset-*}: C{20ms},
    C{1.5s}, C{6m0s}.

    @param seconds: non-negative seconds.
    """
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{int(round(seconds * 1000))}ms"
    if seconds < 60:
        text = f"{seconds:.3f}".rstrip("0").rstrip(".")
        return f"{text}s"
    minutes, rest = divmod(int(math.ceil(seconds)), 60)
    return f"{minutes}m{rest}s"


def rateLimitHeaders(decision) -> tuple:
    """
    The OpenAI rate-limit headers of a decision.

    @param decision: a L{relay.tenants.ratelimit.RateDecision}.
    @return: C{(name, value)} pairs: C{x-ratelimit-*} for the limits the
        key has, and, when refused, C{Retry-After} (whole seconds, at least
        1) and C{retry-after-ms}.
    """
    headers = []
    if decision.rpm:
        headers += [
            ("x-ratelimit-limit-requests", str(decision.rpm)),
            ("x-ratelimit-remaining-requests", str(max(0, decision.rpm - decision.requests))),
            ("x-ratelimit-reset-requests", formatReset(decision.resetRequests)),
        ]
    if decision.tpm:
        headers += [
            ("x-ratelimit-limit-tokens", str(decision.tpm)),
            ("x-ratelimit-remaining-tokens", str(max(0, decision.tpm - decision.tokens))),
            ("x-ratelimit-reset-tokens", formatReset(decision.resetTokens)),
        ]
    if not decision.allowed:
        headers += [
            ("Retry-After", str(max(1, int(math.ceil(decision.retryAfter))))),
            ("retry-after-ms", str(max(1, int(math.ceil(decision.retryAfter * 1000))))),
        ]
    return tuple(headers)


def isPrewarm(turn) -> bool:
    """
    Whether C{turn} is a WebSocket prewarm: a C{response.create} with
    C{generate: false}, which the upstream answers without a generation
    (protocol.md 8). On HTTP the field is dropped and the request generates
    (L{relay.engine.payload.WS_ONLY_FIELDS}), so an HTTP body carrying it
    is an ordinary request (behaviour.md R113: only prewarms go uncounted).

    @param turn: the L{relay.base.records.Turn}.
    """
    return turn.entrypoint == "ws" and turn.body.get("generate") is False


def _rateError(key: ClientKey, decision, model: Optional[str],
               now: Optional[float] = None) -> ClientError:
    """
    The 429 of a key's C{rpm}/C{tpm} window (R102), answered in-band on a
    WebSocket (R113).

    @param decision: the refusing L{relay.tenants.ratelimit.RateDecision}.
    @param now: Unix seconds, to set C{resetsAt} (when the window lets a
        turn start); L{None} leaves it unset.
    """
    if decision.refusedBy == "rpm":
        what, limit, used = "requests per min (RPM)", decision.rpm, decision.requests
    else:
        what, limit, used = "tokens per min (TPM)", decision.tpm, decision.tokens
    wait = decision.retryAfter
    message = (
        f"Rate limit reached for key {key.name!r} on {what}: Limit {limit}, Used {used}."
        f" Please try again in {formatReset(wait)}."
    )
    reason = f"rate limit {decision.refusedBy} {limit} reached; retry in {formatReset(wait)}"
    return ClientError(
        429, "rate_limit_error", message, code="rate_limit_exceeded",
        headers=rateLimitHeaders(decision), wsClose=(1013, reason), wsInband=True,
        resetsAt=None if now is None else now + wait,
    )


def notPriced(key: ClientKey, param: str, what: str) -> ClientError:
    """
    R109: the 403 a key with a money budget gets for a turn whose served
    model, tier or hosted tool has no price.

    @param param: C{model}, C{service_tier} or C{tools}.
    @param what: what lacks a price (C{model `ft:x`}, C{tool `image_generation`}).
    """
    return ClientError(
        403, "invalid_request_error",
        f"The key {key.name!r} has a money budget and {what} has no price, so its cost"
        " cannot be counted; the operator can add it under prices: (or set prices.default).",
        code="model_not_priced", param=param, wsClose=(1008, MODEL_CLOSE), wsInband=True,
    )


_VIEWS = 256
"""The most L{KeyPolicy._view} answers kept for one accounts snapshot (a
client may name any model; past this they are all dropped)."""


@frozen
class _View:
    """
    The live accounts a key may reach, and those of them serving a model
    (L{KeyPolicy._view}).

    @ivar reach: the accounts the key may reach, in order.
    @ivar serving: those of C{reach} that serve the model (all of them for
        L{None}).
    @ivar names: the upstream names C{serving} serve the model as, each
        once, in order.
    @ivar oauth: whether one of C{serving} is an OAuth account.
    """

    reach: tuple
    serving: tuple
    names: tuple
    oauth: bool

    @classmethod
    def of(cls, accounts: tuple, allowed: Optional[frozenset], model: Optional[str]) -> _View:
        reach = accounts if allowed is None else tuple(a for a in accounts if a.id in allowed)
        serving = tuple(a for a in reach if a.servesModel(model))
        names = tuple(dict.fromkeys(a.upstreamModel(model) for a in serving)) if model else ()
        return cls(reach, serving, names, any(a.type == "oauth" for a in serving))


@implementer(IKeyPolicy)
@define(eq=False)
class KeyPolicy:
    """
    See the module docstring.

    @ivar clock: the injected L{IReactorTime} (Unix seconds).
    @ivar live: the L{relay.process.live.LiveConfiguration}: its
        C{config.groups} and C{accounts} are read per check, so a reload
        applies to the next turn.
    @ivar limiter: the L{relay.interfaces.IRateLimiter}, or L{None} (no
        rates enforced).
    @ivar prices: the L{relay.tenants.prices.PriceTable}, or L{None}.
    """

    clock: Any
    live: Any
    limiter: Any = None
    prices: Any = None
    adminGroups: dict = field(factory=dict)
    """Group name -> account ids of the groups added through the admin API
    (L{relay.control.groups}; the file's C{groups:} win on a name)."""
    _views: dict = field(factory=dict, init=False)
    """C{(allowed ids, model)} -> L{_View}, for the accounts snapshot
    C{_viewsOf} (L{_view})."""
    _viewsOf: Any = field(default=None, init=False)
    _log = Logger()

    # -- what the key may reach ------------------------------------------------

    def allowedAccounts(self, key: ClientKey) -> Optional[frozenset]:
        """
        The account ids C{key} may reach: its C{accounts}, or its
        C{group}'s, or L{None} for every account.

        @rtype: L{frozenset} of L{str} or L{None}
        """
        if key.accounts is not None:
            return frozenset(key.accounts)
        if key.group is not None:
            groups = getattr(self.live.config, "groups", None) or {}
            members = groups.get(key.group)
            if members is None:
                members = self.adminGroups.get(key.group, ())
            return frozenset(members)
        return None

    def reachable(self, key: ClientKey, accounts: Iterable) -> list:
        """
        @param accounts: accounts (e.g. the live registry).
        @return: those of C{accounts} that C{key} may reach, in order.
        """
        allowed = self.allowedAccounts(key)
        if accounts is self.live.accounts:
            view = self._view(allowed, None)
            if view is not None:
                return list(view.reach)
        return [a for a in accounts if allowed is None or a.id in allowed]

    def _view(self, allowed: Optional[frozenset], model: Optional[str]) -> Optional[_View]:
        """
        What the live accounts a key with C{allowed} may reach do with
        C{model}, worked out once per accounts snapshot: a turn of a key
        with a money budget reads it up to four times (R108, R109), and a
        pool of 2,000 accounts made each read a walk of them all. Exact:
        L{relay.process.live.AccountRegistry.snapshot} is a new tuple
        whenever the set changes, the accounts are frozen, and a change of
        the key's accounts or group changes C{allowed}.

        @param allowed: L{allowedAccounts}' answer.
        @param model: the client model name, or L{None} (C{reach} only).
        @return: the L{_View}, or L{None} when the live accounts have no
            snapshot (then the caller walks them).
        """
        snapshot = getattr(self.live.accounts, "snapshot", None)
        if snapshot is None:
            return None
        accounts = snapshot()
        if accounts is not self._viewsOf:
            self._views, self._viewsOf = {}, accounts
        views = self._views
        found = views.get((allowed, model))
        if found is None:
            if len(views) >= _VIEWS:
                views.clear()
            found = views[allowed, model] = _View.of(accounts, allowed, model)
        return found

    def _servingAccounts(self, key: ClientKey, model: Optional[str]) -> tuple:
        """
        The live accounts C{key} may reach that serve C{model}, in order.
        """
        view = self._view(self.allowedAccounts(key), model)
        if view is None:
            return tuple(a for a in self.reachable(key, self.live.accounts)
                         if a.servesModel(model))
        return view.serving

    def modelAllowed(self, key: ClientKey, model: Optional[str],
                     accounts: Optional[Iterable] = None) -> bool:
        """
        Whether C{key}'s C{models} and C{deny_models} let it use C{model}
        (a client model name), matched as R110 says
        (L{relay.base.modelname.listed}): any case, trimmed, a dated snapshot as
        its family. The deny-list also matches the name each of
        C{accounts} that serves C{model} maps it to (an operator's alias of
        a denied model is denied).

        @param accounts: the accounts the key may reach, or L{None} (the
            client's name only).
        """
        if model is None:
            return True
        if key.models is not None and not listed(model, key.models):
            return False
        if not key.deny_models:
            return True
        if listed(model, key.deny_models):
            return False
        return not any(
            a.model_mapping and a.servesModel(model)
            and listed(a.upstreamModel(model), key.deny_models)
            for a in accounts or ()
        )

    def models(self, key: ClientKey, names: Iterable[str]) -> list:
        """
        @return: the names of C{names} that C{key} may use (C{/v1/models}).
        """
        return [name for name in names if self.modelAllowed(key, name)]

    # -- refusals ----------------------------------------------------------------

    def keyRefusal(self, key: ClientKey, now: float) -> Optional[ClientError]:
        """
        Checks 1-2: a disabled or expired key, refused as soon as it is
        known (the WebSocket upgrade uses this too).

        @return: the 401 (or the 503 of L{KEYS_LOADING}), or L{None}.
        """
        if getattr(self.live.keys, "pending", False):
            return KEYS_LOADING
        if key.disabled:
            return ClientError(
                401, "invalid_request_error",
                f"The API key {key.name!r} is disabled. Ask the relay's operator to enable it.",
                code="api_key_disabled", wsClose=(1008, DISABLED_CLOSE),
            )
        if key.expires_at is not None and now >= key.expires_at:
            return ClientError(
                401, "invalid_request_error",
                f"The API key {key.name!r} expired at {_iso(key.expires_at)} (expires_at)."
                " Ask the relay's operator for a new key.",
                code="api_key_expired", wsClose=(1008, EXPIRED_CLOSE),
            )
        return None

    def refusal(self, key: ClientKey, model: Optional[str],
                now: float) -> Optional[ClientError]:
        """
        Checks 1-4 (synchronous): disabled, expired, model allow/deny,
        money budget on an unpriced model (a model is priced when its own
        name, or the name every account the key may reach maps it to, has
        a price).

        @param key: the turn's L{ClientKey}.
        @param model: the client model name.
        @param now: Unix seconds.
        @return: the L{ClientError} to refuse with, or L{None}.
        """
        error = self.keyRefusal(key, now)
        if error is not None:
            return error
        if key.deny_models or key.models is not None:
            reachable = self.reachable(key, self.live.accounts) if key.deny_models else ()
            allowedModel = self.modelAllowed(key, model, reachable)
        else:
            allowedModel = True
        if not allowedModel:
            allowed = ", ".join(key.models) if key.models is not None else None
            detail = (f"its models allow-list is {allowed}" if allowed is not None
                      and not listed(model, key.models) else "it is in its deny_models list"
                      if listed(model, key.deny_models)
                      else "an account maps it to a model in its deny_models list")
            return ClientError(
                403, "invalid_request_error",
                f"The key {key.name!r} does not have access to model `{model}` ({detail}).",
                code="model_not_found", param="model", wsClose=(1008, MODEL_CLOSE),
                wsInband=True,
            )
        if (key.daily_usd is not None or key.monthly_usd is not None) and not self._priced(
            model, self._servingAccounts(key, model)
        ):
            names = sorted({n for n in self._serving(key, model) if n is not None})
            return notPriced(key, "model", ", ".join(f"model `{n}`" for n in names))
        return None

    def _serving(self, key: ClientKey, model: Optional[str]) -> list:
        """
        The upstream names the accounts C{key} may reach serve C{model} as
        (R109: what a turn is priced by), or C{[model]} when none serves it.
        """
        view = self._view(self.allowedAccounts(key), model) if model else None
        if view is not None:
            return list(view.names) or [model]
        serving = [a.upstreamModel(model) for a in self._servingAccounts(key, model)]
        return serving or [model]

    def outputLimitHonoured(self, key: ClientKey, model: Optional[str]) -> bool:
        """
        R108: whether a request's own output limit (C{max_output_tokens};
        chat C{max_completion_tokens}, C{max_tokens}) bounds the turn on
        every account C{key} may reach that serves C{model}. The ChatGPT
        backend takes none, so relay leaves it out of every OAuth request
        (L{relay.engine.payload.OAUTH_SAMPLING_DROPPED}) and a turn there
        may run to the key's C{max_turn_output_tokens}, which is then the
        output its reservation holds.
        """
        view = self._view(self.allowedAccounts(key), model)
        if view is not None:
            return not view.oauth
        return not any(a.type == "oauth" for a in self._servingAccounts(key, model))

    def _priced(self, model: Optional[str], serving: tuple) -> bool:
        """
        R109: some account C{key} may reach serves C{model} under a name
        with a price (or the table has a default); which one serves a turn
        is checked again when it is chosen (L{priceRefusal}).

        @param serving: the accounts the key may reach that serve C{model}
            (L{_servingAccounts}).
        """
        if self.prices is None or model is None:
            return True
        if not serving:
            return self.prices.served(model) is not None
        return any(self.prices.served(a.upstreamModel(model)) is not None for a in serving)

    def priceRefusal(self, key: ClientKey, served: Optional[str],
                     body: dict) -> Optional[ClientError]:
        """
        R109: for a key with a money budget, the refusal of a turn whose
        chosen account serves it as C{served} when that model, the
        request's C{service_tier} or a hosted tool in its C{tools} has no
        price (and the table no default); checked before dialling.

        @param served: the upstream model name (after C{model_mapping}).
        @param body: the request body.
        @return: the 403 C{model_not_priced} naming what lacks a price, or
            L{None}.
        """
        if self.prices is None or (key.daily_usd is None and key.monthly_usd is None):
            return None
        from relay.tenants.prices import requestTier, requestTools

        missing = self.prices.missing(served, requestTier(body), requestTools(body))
        if not missing:
            return None
        param = missing[0][0]
        return notPriced(key, param, ", ".join(text for _, text in missing))

    def estimate(self, key: ClientKey, model: Optional[str], body: dict,
                 inputTokens: int, outputTokens: int) -> int:
        """
        R108: the most a turn may cost, nano-dollars, on whichever account
        C{key} may reach serves it (L{relay.tenants.prices.PriceTable.estimate}
        with the request's tier and hosted tools); 0 when nothing is priced.
        """
        if self.prices is None:
            return 0
        from relay.tenants.prices import requestTier, requestTools

        tier, tools = requestTier(body), requestTools(body)
        found = [self.prices.estimate(name, inputTokens, outputTokens, tier, tools)
                 for name in set(self._serving(key, model))]
        return max((n for n in found if n is not None), default=0)

    def imagesEstimate(self, key: ClientKey, model: Optional[str], body: dict) -> int:
        """
        R108, R115: what the images an images request asks for (its C{n})
        may cost, nano-dollars, at the dearest per-image price of the
        names the accounts C{key} may reach serve C{model} as
        (L{relay.tenants.prices.PriceTable.perImage}); 0 when unpriced.
        """
        if self.prices is None:
            return 0
        from relay.usage.tokens import imagesTool, requestedImages

        tool, count = imagesTool(body), requestedImages(body)
        found = [self.prices.perImage(name, tool) for name in set(self._serving(key, model))]
        dearest = max((p for p in found if p is not None), default=0.0)
        return int(round(dearest * count * 1_000_000_000))

    async def admitRate(self, turn) -> Optional[ClientError]:
        """
        Check 6: count the turn in its key's windows, or refuse it. A
        prewarm (L{isPrewarm}) is neither counted nor refused by C{rpm}
        (behaviour.md R113); C{tpm} still applies to it.

        @param turn: the L{relay.base.records.Turn}.
        @return: the 429 (or 503 when the shared windows are down and
            C{fail_closed}), or L{None}.
        """
        key = turn.client
        if self.limiter is None or not (key.rpm or key.tpm):
            return None
        from relay.tenants.ratelimit import RateLimitUnavailable

        prewarm = isPrewarm(turn)
        if prewarm and not key.tpm:
            return None
        try:
            if prewarm:
                decision = await self.limiter.peek(key.name, None, key.tpm)
            else:
                decision = await self.limiter.admit(key.name, key.rpm, key.tpm)
        except RateLimitUnavailable:
            return ClientError(
                503, "api_error", "Service temporarily unavailable, please retry later",
                wsClose=(1011, "failed to acquire user concurrency slot"),
            )
        if decision.allowed:
            return None
        error = _rateError(key, decision, turn.model, self.clock.seconds())
        self._log.info(
            "key {key_name} over its {limit}: {message}",
            event="relay.key_rate_limited", key_name=key.name, limit=decision.refusedBy,
            message=error.message, request_id=turn.requestId,
        )
        return error

    def countTokens(self, key: ClientKey, tokens: int) -> None:
        """
        A turn of C{key} finished with C{tokens} (input + output): count
        them in its token window (when it has a C{tpm}).
        """
        if self.limiter is not None and key.tpm and tokens:
            self.limiter.addTokens(key.name, tokens)

    def peekRate(self, key: ClientKey):
        """
        @return: a L{Deferred} firing with the key's current
            L{relay.tenants.ratelimit.RateDecision} (nothing counted), or
            with L{None} when it has no rates.
        """
        from twisted.internet.defer import succeed

        if self.limiter is None or not (key.rpm or key.tpm):
            return succeed(None)
        return self.limiter.peek(key.name, key.rpm, key.tpm)
