# -*- test-case-name: tests.test_upstream_headers -*-
"""
The one table of the client headers relay sends upstream (behaviour.md
R112, protocol.md 7.2): what each is, where its value comes from, whether
it travels on HTTP and on the WebSocket handshake, for which account types,
and whether it is scoped per key. The HTTP dialer
(L{relay.upstream.http.upstreamHeaders}), the WebSocket dialer
(L{relay.upstream.ws.handshakeHeaders}) and the engine's scoping
(L{relay.engine.payload.upstreamClientHeaders}) all read it;
C{tests.test_upstream_headers} checks it against protocol.md 7.2.

Everything not in the table -- C{Authorization}, C{x-api-key},
C{api-key}, cookies, hop-by-hop headers, C{OpenAI-Beta} -- stays behind
(architecture.md invariant 7): the table is an allow-list.
"""

from __future__ import annotations

from attrs import frozen

CODEX_VERSION = "0.171.0"
"""The Codex release relay speaks as (protocol.md 7.2 C{version}, 5, 8): the
C{version} header it sends for a client that is not Codex on an OAuth
account, the C{client_version} of its own manifest requests, and its
Codex-shaped C{User-Agent}. Never older than the Codex CI pins
(C{.ci/run}; C{tests.test_upstream_headers} checks)."""

DEFAULT_ORIGINATOR = "codex_cli_rs"
"""The C{originator} sent for OAuth accounts when the client is not Codex
(protocol.md 7.2)."""

CODEX_USER_AGENT = f"codex_cli_rs/{CODEX_VERSION}"
"""A Codex-shaped C{User-Agent} for relay's own requests (protocol.md 7.2)."""

OAUTH, APIKEY = "oauth", "apikey"
BOTH = (OAUTH, APIKEY)


@frozen
class UpstreamHeader:
    """
    One row of L{UPSTREAM_HEADERS}.

    @ivar name: the lower-case name sent upstream.
    @ivar aliases: other spellings relay reads from a client for the same
        header; on an OAuth account the value goes upstream under C{name},
        on an API-key account under the client's own spelling.
    @ivar source: where the value comes from: C{client}; C{client, else
        relay} (relay fills it in or replaces it, see C{note}).
    @ivar http: sent on upstream HTTP requests.
    @ivar websocket: sent on the upstream WebSocket handshake.
    @ivar accounts: the account types it is sent to (C{oauth}, C{apikey}).
    @ivar scoped: an identifier of a conversation: on an OAuth account its
        value is replaced by C{xxhash64("k{key}:" + raw)} (R112, R104;
        L{relay.engine.payload.scopedId}).
    @ivar cacheFallback: when the client sent none, an OAuth account gets
        the scoped C{prompt_cache_key} of the body (protocol.md 7.2).
    @ivar listed: where the header is specified: C{7.2} (protocol.md 7.2's
        list), C{R112} (behaviour.md R112 only: the W3C trace context),
        C{relay} (a header of relay's own requests, e.g. a manifest's
        C{If-None-Match}).
    @ivar note: what the header is, in a few words.
    """

    name: str
    source: str = "client"
    aliases: tuple = ()
    http: bool = True
    websocket: bool = True
    accounts: tuple = BOTH
    scoped: bool = False
    cacheFallback: bool = False
    listed: str = "7.2"
    note: str = ""

    @property
    def spellings(self) -> tuple:
        """
        @return: C{name} and its aliases, C{name} first.
        """
        return (self.name, *self.aliases)


UPSTREAM_HEADERS = (
    UpstreamHeader("version", "client (Codex), else relay (OAuth)",
                   note="Codex's release; the backend refuses a model whose "
                        "minimal_client_version is above it (CODEX_VERSION for others)"),
    UpstreamHeader("originator", "client (Codex), else relay (OAuth)",
                   note="the client's when it is Codex (codex*), else DEFAULT_ORIGINATOR"),
    UpstreamHeader("user-agent", note="Codex-shaped User-Agent"),
    UpstreamHeader("accept-language"),
    UpstreamHeader("x-codex-beta-features"),
    UpstreamHeader("x-codex-window-id", note="may embed raw ids; passes unchanged"),
    UpstreamHeader("x-codex-installation-id"),
    UpstreamHeader("x-codex-turn-metadata", note="may embed raw ids; passes unchanged"),
    UpstreamHeader("x-codex-turn-state", note="the backend's sticky-routing token"),
    UpstreamHeader("x-codex-parent-thread-id", scoped=True,
                   note="a sub-agent's parent thread"),
    UpstreamHeader("x-openai-subagent", note="a sub-agent's kind (collab_spawn, review, ...)"),
    UpstreamHeader("x-openai-memgen-request", note="memory generation"),
    UpstreamHeader("x-openai-internal-codex-responses-lite", note="Responses Lite models"),
    UpstreamHeader("x-responsesapi-include-timing-metrics"),
    UpstreamHeader("x-oai-attestation"),
    UpstreamHeader("x-codex-routing-hint", "client, rebuilt by relay", accounts=(OAUTH,),
                   note="model=<model>[;tier=<tier>]: rebuilt when relay maps the model"),
    UpstreamHeader("x-client-request-id", "client (X-Request-Id), else relay's id", scoped=True,
                   note="R111"),
    UpstreamHeader("session_id", aliases=("session-id",), scoped=True, cacheFallback=True),
    UpstreamHeader("thread-id", scoped=True),
    UpstreamHeader("conversation_id", aliases=("conversation-id",), scoped=True,
                   cacheFallback=True),
    UpstreamHeader("traceparent", "client, else relay (tracing)", listed="R112",
                   note="W3C trace context; replaced by the attempt's own when relay traces"),
    UpstreamHeader("tracestate", "client, else relay (tracing)", listed="R112"),
    UpstreamHeader("if-none-match", "relay", websocket=False, listed="relay",
                   note="the ETag of a manifest relay fetches (R92)"),
)
"""Every client header relay sends upstream (R112, protocol.md 7.2)."""

UNLISTED_ALIASES = frozenset({"conversation-id"})
"""Spellings relay reads from clients that protocol.md 7.2 does not name."""

ACCOUNT_HEADERS = ("authorization", "chatgpt-account-id", "x-openai-fedramp", "openai-beta")
"""Headers relay sets from the account (and C{OpenAI-Beta} on the WebSocket
handshake), never from the client (protocol.md 7.1, 7.2)."""


def forwarded(transport: str, accountType: str) -> dict:
    """
    The client spellings that go upstream on C{transport} to an account of
    C{accountType}, in the table's order.

    @param transport: C{http} or C{websocket}.
    @param accountType: C{oauth} or C{apikey}.
    @return: lower-case spelling -> its place (for sorting).
    """
    names = [s for h in UPSTREAM_HEADERS
             if getattr(h, transport) and accountType in h.accounts for s in h.spellings]
    return {name: i for i, name in enumerate(names)}


_FORWARDED = {(t, a): forwarded(t, a) for t in ("http", "websocket") for a in BOTH}


def forwardedFor(transport: str, accountType: str) -> dict:
    """
    L{forwarded}, computed once per transport and account type.
    """
    return _FORWARDED[(transport, APIKEY if accountType != OAUTH else OAUTH)]


SCOPED = tuple(h for h in UPSTREAM_HEADERS if h.scoped)
"""The rows scoped per key on OAuth accounts (R112)."""


def isCodex(originator) -> bool:
    """
    Whether a client's C{originator} is an official Codex client's
    (C{codex_cli_rs}, C{codex_exec}, C{codex_vscode}, ...; protocol.md 7.2).
    """
    return isinstance(originator, str) and originator.startswith("codex")


def routingHint(model: str, tier=None) -> str:
    """
    C{x-codex-routing-hint} as Codex builds it (C{build_routing_hint_header}
    in codex-rs/core/src/client.rs): C{model=<model>}, plus
    C{;tier=<service_tier>} when the request names a tier (R112).
    """
    if isinstance(tier, str) and tier:
        return f"model={model};tier={tier}"
    return f"model={model}"
