"""
behaviour.md R112, protocol.md 7.2: the one table of the headers relay
sends upstream (L{relay.upstream.headers.UPSTREAM_HEADERS}) is what
protocol.md 7.2 lists, and the HTTP dialer, the WebSocket dialer and the
engine's per-key scoping all read it.
"""

from __future__ import annotations

import pathlib
import re

from twisted.trial.unittest import SynchronousTestCase

from relay.base.records import Account, ClientKey, Turn
from relay.engine.payload import SCOPED_HEADERS, scopedId, upstreamClientHeaders
from relay.upstream import headers as H
from relay.upstream.http import FORWARDED_HEADERS, upstreamHeaders
from relay.upstream.ws import handshakeHeaders

ROOT = pathlib.Path(__file__).resolve().parent.parent

NOT_HEADERS = frozenset({
    "opencode", "codex-tui", "minimal_client_version", "collab_spawn", "review",
    "memory_consolidation", "use_responses_lite", "prompt_cache_key", "buildopenaiwsheaders",
})
"""Backticked words of protocol.md 7.2's header list that are values, body
fields or function names, not header names."""


def protocolHeaders() -> set:
    """
    The header names protocol.md 7.2's "Headers" list names (lower-cased).
    """
    text = (ROOT / "docs" / "reference" / "protocol.md").read_text(encoding="utf-8")
    section = text[text.index("### 7.2"):text.index("### 7.3")]
    block = section[section.index("- **Headers**"):section.index("- **Body constraints")]
    names = set()
    for token in re.findall(r"`([^`]+)`", block):
        name = token.split(": ", 1)[0].strip().lower()
        if re.fullmatch(r"[a-z][a-z0-9_-]*", name) and name not in NOT_HEADERS:
            names.add(name)
    return names


def r112Headers() -> set:
    """
    The headers behaviour.md R112 lists (lower-cased; C{a}/C{b} both).
    """
    text = (ROOT / "docs" / "reference" / "behaviour.md").read_text(encoding="utf-8")
    rule = text[text.index("**R112"):]
    listed = rule[rule.index("(protocol.md 7.2):"):rule.index("Identifiers of")]
    names = set()
    for token in re.findall(r"`([^`]+)`", listed):
        names.update(part.strip().lower() for part in token.split("/"))
    return names


def tableNames(listed=("7.2",)) -> set:
    return {s for h in H.UPSTREAM_HEADERS if h.listed in listed for s in h.spellings}


OAUTH = Account(id="o", type="oauth", base_url="http://u", credential="tok",
                chatgpt_account_id="acct", model_mapping={"gpt-client": "gpt-5.5"})
APIKEY = Account(id="k", type="apikey", base_url="http://u", credential="sk-acct",
                 model_mapping={"gpt-client": "gpt-5.5"})

CREDENTIALS = {"authorization": "Bearer sk-client", "x-api-key": "sk-client",
               "api-key": "sk-client", "cookie": "c=1", "proxy-authorization": "Basic x",
               "openai-beta": "responses=experimental", "chatgpt-account-id": "theirs"}


def clientHeaders() -> dict:
    """
    Every spelling of the table with a value of its own, plus credentials.
    """
    headers = {s: f"v-{s}" for h in H.UPSTREAM_HEADERS for s in h.spellings}
    headers["originator"] = "codex_exec"
    headers.update(CREDENTIALS)
    return headers


class TableTests(SynchronousTestCase):
    """
    The table against the specification.
    """

    def test_equals_protocol_7_2(self):
        """
        The table's rows listed by protocol.md 7.2, with the headers relay
        sets from the account, are exactly protocol.md 7.2's list.
        """
        self.assertEqual(tableNames() - H.UNLISTED_ALIASES | set(H.ACCOUNT_HEADERS),
                         protocolHeaders())

    def test_r112_list(self):
        """
        Every header R112 names is in the table (7.2 rows and the trace
        context R112 adds).
        """
        self.assertEqual(r112Headers() - tableNames(("7.2", "R112")), set())
        self.assertEqual(tableNames(("R112",)), {"traceparent", "tracestate"})

    def test_forwarded_headers_is_the_table(self):
        """
        The HTTP dialer's allow-list is derived from the table, nothing
        else; no credential is in it.
        """
        self.assertEqual(set(FORWARDED_HEADERS), tableNames(("7.2", "R112", "relay")))
        self.assertEqual(set(FORWARDED_HEADERS) & set(CREDENTIALS), set())

    def test_scoping_reads_the_table(self):
        """
        The engine's scoped headers are the table's C{scoped} rows (R112).
        """
        self.assertEqual(SCOPED_HEADERS, tuple(h.spellings for h in H.UPSTREAM_HEADERS
                                               if h.scoped))
        self.assertEqual({g[0] for g in SCOPED_HEADERS},
                         {"session_id", "conversation_id", "thread-id",
                          "x-codex-parent-thread-id", "x-client-request-id"})

    def test_version_not_older_than_the_pin(self):
        """
        The C{version} relay sends is not older than the Codex CI pins.
        """
        run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
        pinned = re.search(r"@openai/codex@(\d+)\.(\d+)\.(\d+)", run).groups()
        ours = tuple(int(p) for p in H.CODEX_VERSION.split("."))
        self.assertGreaterEqual(ours, tuple(int(p) for p in pinned))


class DialerTests(SynchronousTestCase):
    """
    Both dialers send what the table says, per transport and account type.
    """

    def test_every_row_on_both_transports_and_account_types(self):
        client = clientHeaders()
        for account in (OAUTH, APIKEY):
            for transport, sent in (("http", upstreamHeaders(account, client)),
                                    ("websocket", handshakeHeaders(account, client))):
                for row in H.UPSTREAM_HEADERS:
                    expected = getattr(row, transport) and account.type in row.accounts
                    for spelling in row.spellings:
                        self.assertEqual(sent.get(spelling) == client[spelling], expected,
                                         (account.type, transport, spelling))
                self.assertEqual(sent["authorization"], "Bearer " + account.credential)
                for name in ("x-api-key", "api-key", "cookie", "proxy-authorization"):
                    self.assertNotIn(name, sent)
                self.assertNotIn("sk-client", " ".join(sent.values()))
                if transport == "websocket":
                    self.assertNotEqual(sent["openai-beta"], client["openai-beta"])
                else:
                    self.assertNotIn("openai-beta", sent)
        self.assertEqual(upstreamHeaders(OAUTH, client)["chatgpt-account-id"], "acct")
        self.assertNotIn("chatgpt-account-id", upstreamHeaders(APIKEY, client))

    def test_non_codex_client_on_oauth_gets_relays_version(self):
        """
        A client that is not Codex gets relay's C{originator} and current
        C{version} on an OAuth account (R112), on both transports; a Codex
        client keeps its own; an API-key account gets the client's.
        """
        other = {"originator": "opencode", "version": "1.2.3", "user-agent": "sdk"}
        for build in (upstreamHeaders, handshakeHeaders):
            sent = build(OAUTH, other)
            self.assertEqual((sent["originator"], sent["version"]),
                             (H.DEFAULT_ORIGINATOR, H.CODEX_VERSION))
            sent = build(OAUTH, {})
            self.assertEqual(sent["version"], H.CODEX_VERSION)
            sent = build(OAUTH, {"originator": "codex_cli_rs", "version": "0.172.0"})
            self.assertEqual(sent["version"], "0.172.0")
            self.assertEqual(build(APIKEY, other)["version"], "1.2.3")
            self.assertNotIn("version", build(APIKEY, {}))


def turn(headers: dict, model="gpt-5.5", **body) -> Turn:
    return Turn(entrypoint="http", endpoint="responses",
                client=ClientKey(name="alice", key="sk-alice"), model=model,
                body={"model": model, **body}, stream=True, headers=dict(headers),
                requestId="req_1")


class RoutingHintTests(SynchronousTestCase):
    """
    R112: where relay maps the model it rebuilds C{x-codex-routing-hint}
    for what it sends.
    """

    def test_rebuilt_when_mapped(self):
        hint = {"x-codex-routing-hint": "model=gpt-client;tier=priority"}
        sent = upstreamClientHeaders(turn(hint, "gpt-client", service_tier="priority"), OAUTH)
        self.assertEqual(sent["x-codex-routing-hint"], "model=gpt-5.5;tier=priority")
        sent = upstreamClientHeaders(turn(hint, "gpt-client"), OAUTH)
        self.assertEqual(sent["x-codex-routing-hint"], "model=gpt-5.5")
        self.assertEqual(upstreamHeaders(OAUTH, sent)["x-codex-routing-hint"], "model=gpt-5.5")

    def test_copied_when_not_mapped(self):
        hint = {"x-codex-routing-hint": "model=gpt-5.5;tier=flex"}
        sent = upstreamClientHeaders(turn(hint, service_tier="flex"), OAUTH)
        self.assertEqual(sent["x-codex-routing-hint"], "model=gpt-5.5;tier=flex")

    def test_not_added_and_oauth_only(self):
        self.assertNotIn("x-codex-routing-hint",
                         upstreamClientHeaders(turn({}, "gpt-client"), OAUTH))
        hint = {"x-codex-routing-hint": "model=gpt-client"}
        self.assertNotIn("x-codex-routing-hint",
                         upstreamHeaders(APIKEY, upstreamClientHeaders(turn(hint), APIKEY)))

    def test_scoped_on_oauth(self):
        sent = upstreamClientHeaders(turn({"x-codex-parent-thread-id": "p1",
                                           "thread-id": "t1"}), OAUTH)
        self.assertEqual(sent["x-codex-parent-thread-id"], scopedId("alice", "p1"))
        self.assertEqual(sent["thread-id"], scopedId("alice", "t1"))
