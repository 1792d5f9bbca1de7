"""
The parity matrix (issue 11; behaviour.md R86): the same upstream fault on
the preferred account C{bad}, with a healthy C{good} behind it, must end the
same way on every entrypoint: HTTP SSE, HTTP JSON, chat completions
(stream), the Anthropic Messages API (stream and JSON, R115), and the
Responses WebSocket in C{ctx_pool}, C{passthrough} and C{http_bridge}.

For each cell (fault x entrypoint) the test records:

  - the client's outcome class and status / close code (L{parity.Outcome});
  - the state of C{bad} afterwards as C{GET /admin/accounts} reports it,
    normalised to C{(schedulable, reason class, breaker failures, streak)}
    (L{parity.accountState});
  - the decision counters: failovers, same-account retries and cooldowns
    from relay's registry (upstream statuses and waits are recorded and
    printed, not compared: they count wire events, not decisions).

Each row states the outcome and state the spec prescribes (R-numbers in the
row), and every cell must match it, except the few differences behaviour.md
prescribes, listed as data in L{ALLOWED} with their R-numbers. The decision
counters must be equal across the cells that share the row's outcome. Cells
run one stack each (a fresh emulator and relay on loopback).

The matrix is printed (C{pytest -s}) and, when C{RELAY_PARITY_MATRIX} names
a file, written there.
"""

from __future__ import annotations

import os

import pytest
import pytest_twisted
from attrs import evolve, field, frozen
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import deferLater

from tests.integration import parity as P
from tests.integration.harness import sseEvents
from tests.integration.parity import BAD, GOOD

#: seconds (R20 on the runtime settings; the config file's range is 30-600)
FIRST_OUTPUT_TIMEOUT = 1.0
#: seconds the faulty account holds back its first output in that row
FIRST_OUTPUT_DELAY = 2.5
#: seconds between the slow upstream's events for the "client leaves" rows
#: (the turn still has 0.35 s to go when the client leaves after the first
#: delta, and relay, emulator and client share one reactor, so the departure
#: is always mid-turn; the waiting client leaves while two turns of 2 x SLOW
#: per event, about 1 s, hold both slots)
SLOW = 0.05

OK = (True, "ok", 0, 0)

COLUMNS = (*P.ENTRYPOINTS, *P.MESSAGES_ENTRYPOINTS)
"""
The entrypoints: Responses (SSE, JSON), chat, the Messages API (R115) and the
three WebSocket modes. The OAuth columns are L{P.OAUTH_ENTRYPOINTS}.
"""


def _err(message, type_, code=None):
    return {"error": {"message": message, "type": type_, "code": code, "param": None}}


def _accounts(badExtra=None, goodExtra=None):
    bad = {"id": "bad", "credential": BAD, "priority": 1,
           # one same-account retry for capacity sheds (R14), so the row is fast
           "pool_mode_retry_count": 1}
    bad.update(badExtra or {})
    good = {"id": "good", "credential": GOOD, "priority": 50}
    good.update(goodExtra or {})
    return [bad, good]


@frozen
class Row:
    """
    One fault kind.

    @ivar name: the row id.
    @ivar rules: the R-numbers that decide the expected outcome and state.
    @ivar faults: C{{selector: emulator fault}}; the selector is an
        entrypoint, C{"ws"} / C{"http"} (the upstream transport) or C{"*"}.
    @ivar expect: the prescribed C{(outcome kind, code)}.
    @ivar state: the prescribed normalised state of C{bad}.
    @ivar driver: how the cell runs: C{turn}, C{refused}, C{leave3},
        C{leaveWaiting} or C{laterTurn}.
    @ivar columns: the entrypoints the fault exists on.
    """

    name: str
    rules: str
    faults: dict
    expect: tuple
    state: tuple
    driver: str = "turn"
    columns: tuple = COLUMNS
    firstOutputTimeout: float = 0.0
    accounts: list = field(factory=_accounts)

    def faultFor(self, entrypoint: str):
        for key in (entrypoint, P.upstreamTransport(entrypoint), "*"):
            if key in self.faults:
                return self.faults[key]
        return None


SERVED = ("served_by_other", None)

ROWS = [
    Row("5xx", "R8 row 6, R11 streak, R86.1, R86.2",
        {"*": {"kind": "status", "code": 503,
               "body": _err("Service Unavailable", "server_error")}},
        SERVED, (True, "ok", 0, 1)),
    Row("5xx_exhausted", "R15 (HTTP 502), R65/R70 (WebSocket 1013), R11 streak, R86.1",
        {"*": {"kind": "status", "code": 503,
               "body": _err("Service Unavailable", "server_error")}},
        ("terminal_error", 502), (True, "ok", 0, 1), accounts=_accounts()[:1]),
    Row("5xx_ws_handshake", "R56 guard (first turn), R11 streak, R86.2",
        {"ws": {"kind": "ws_handshake_status", "code": 503,
                "body": _err("Service Unavailable", "server_error")}},
        SERVED, (True, "ok", 0, 1), columns=("ws_ctx_pool", "ws_passthrough")),
    Row("failed_server_error", "R23, R84, R86.1, R86.2 (streak on every entrypoint)",
        {"*": {"kind": "stream_error", "code": "server_error",
               "message": "The server had an error while processing your request."}},
        SERVED, (True, "ok", 0, 1)),
    Row("failed_overloaded", "R8 capacity shed (same-account retry, no cooldown), R14, R86.2",
        {"*": {"kind": "stream_error", "code": "server_is_overloaded",
               "message": "Our servers are currently overloaded. Please try again later."}},
        SERVED, OK),
    Row("529", "R8 capacity shed, R86.2 (a 529 marks nothing anywhere; wins over R11's 529 row)",
        {"*": {"kind": "status", "code": 529, "body": _err("Site overloaded", "server_error")}},
        SERVED, OK),
    Row("529_overload_code", "R8 capacity shed (same-account retry, R14), R11 check 1, R86",
        {"*": {"kind": "status", "code": 529,
               "body": _err("The server is overloaded. Please try again later.", "server_error",
                            "server_is_overloaded")}},
        SERVED, OK),
    Row("429_usage_limit", "R8 row 6, R11 429 row, R12 rule 1, R49 step 5, R86.1",
        {"*": {"kind": "status", "preset": "usage_limit"}},
        SERVED, (False, "rate_limited", 0, 0)),
    Row("429_rate_limit", "R8 row 6, R11 429 row, R82 (Retry-After), R49 step 5",
        {"*": {"kind": "status", "code": 429, "headers": {"retry-after": "30"},
               "body": _err("Rate limit reached for requests. Please try again in 30s.",
                            "requests", "rate_limit_exceeded")}},
        SERVED, (False, "rate_limited", 0, 0)),
    Row("401", "R8 row 6, R11 401 API-key row (permanent), R23, R86.1",
        {"*": {"kind": "status", "preset": "unauthorized"}},
        SERVED, (False, "disabled", 0, 0)),
    Row("403_html", "R11 403 HTML row (no marking), R56 guard on the handshake",
        {"http": {"kind": "status", "preset": "cloudflare"},
         "ws": {"kind": "ws_handshake_status", "preset": "cloudflare"}},
        SERVED, OK),
    Row("403_html_in_band", "R11 403 HTML row, R86.1 (the page wrapped in an in-band error event)",
        {"*": {"kind": "status", "preset": "cloudflare"}},
        SERVED, OK, columns=("ws_ctx_pool", "ws_passthrough")),
    Row("403_json", "R11 403 row (10 min, 1/3), R23, R86.1",
        {"*": {"kind": "status", "code": 403,
               "body": _err("Country, region, or territory not supported",
                            "request_forbidden", "unsupported_country_region_territory")}},
        SERVED, (False, "403_cooldown", 0, 0)),
    Row("403_model_refusal",
        "R106, R8 row 5 (a project's model refusal blocks the model on that account; never the"
        " 403 counter), R86.1",
        {"*": {"kind": "refuse", "template": "model_not_found", "code": 403}},
        SERVED, (False, "model_block", 0, 0)),
    Row("refused", "R3 persistent, R4 (10 min), R6, R78 (passthrough), R-B1 counts transients only",
        {}, SERVED, (False, "transport", 0, 0), driver="refused"),
    Row("reset_before_headers", "R1, R3 transient, R5, R6, R-B1, R86.3",
        {"http": {"kind": "reset_before_headers"}, "ws": {"kind": "ws_handshake_reset"}},
        SERVED, (True, "ok", 1, 0)),
    Row("first_output_timeout", "R20, R21, R51 (turn 1 fails over); no marking for a relay timeout",
        {"*": {"kind": "delay_first_output", "seconds": FIRST_OUTPUT_DELAY}},
        SERVED, OK, firstOutputTimeout=FIRST_OUTPUT_TIMEOUT),
    Row("cut_before_output", "R1, R23 (read error before output), R86.3 (breaker)",
        {"*": {"kind": "cut_after_events", "events": 2},
         "chat_stream": {"kind": "cut_after_events", "events": 1}},
        SERVED, (True, "ok", 1, 0)),
    Row("cut_after_output", "R17, R19 step 2, R23 (no failover after output), R86.3 (breaker)",
        {"*": {"kind": "cut_after_events", "events": 5},
         "chat_stream": {"kind": "cut_after_events", "events": 2}},
        ("terminal_error", "in-stream"), (True, "ok", 1, 0)),
    Row("clean_end_no_terminal", "R23, R86.4 (a stream failure, not a transport failure), R86.5",
        {"*": {"kind": "end_after_events", "events": 2},
         "chat_stream": {"kind": "end_after_events", "events": 1}},
        SERVED, OK),
    Row("clean_end_after_output", "R17, R23, R86.3 (a clean end is never a breaker failure), R86.4",
        {"*": {"kind": "end_after_events", "events": 5},
         "chat_stream": {"kind": "end_after_events", "events": 2}},
        ("terminal_error", "in-stream"), OK),
    Row("client_leaves_x3", "R2 (a departed client writes nothing), R-B1 (upstream failures only)",
        {}, ("none", "next:bad"), OK, driver="leave3"),
    Row("client_leaves_waiting", "R2, R33 (slot hygiene)",
        {}, ("none", None), OK, driver="leaveWaiting",
        accounts=_accounts({"concurrency": 1}, {"concurrency": 1})),
    Row("compaction_5xx",
        "R89 (a compaction turn is a turn: it fails over like one and its one compaction"
        " item comes from the account that served it), R8 row 6, R11 streak, R86.1",
        {"*": {"kind": "status", "code": 503,
               "body": _err("Service Unavailable", "server_error")}},
        SERVED, (True, "ok", 0, 1), driver="compaction", columns=P.COMPACTION_ENTRYPOINTS),
    Row("compaction_turn_after",
        "R89 (the turn carrying a compaction item goes to the account that produced it, here"
        " the failover's account, though the faulty one is preferred and healthy again)",
        {"*": {"kind": "status", "code": 503, "times": 1,
               "body": _err("Service Unavailable", "server_error")}},
        SERVED, (True, "ok", 0, 1), driver="compactionAfter",
        columns=P.COMPACTION_ENTRYPOINTS),
    Row("429_usage_limit_later_turn", "R11, R12, R49 step 5, R51, R52, R61, R76",
        {"*": {"kind": "status", "preset": "usage_limit"}},
        SERVED, (False, "rate_limited", 0, 0), driver="laterTurn",
        columns=("http_sse", "http_json", "ws_ctx_pool", "ws_passthrough", "ws_http_bridge")),
]

MEDIA_DRIVERS = ("turn", "refused", "leave3", "leaveWaiting")
"""R115: embeddings and images (JSON on API-key accounts,
L{P.MEDIA_ENTRYPOINTS}) join every row an ordinary request (or a client
that leaves it) drives on the HTTP columns: the same upstream fault gets
the same treatment there."""

ROWS = [evolve(r, columns=(*r.columns, *P.MEDIA_ENTRYPOINTS))
        if r.driver in MEDIA_DRIVERS and r.columns == COLUMNS else r for r in ROWS]

#: The differences behaviour.md prescribes: (row, entrypoints) -> the
#: outcomes allowed instead of the row's, with the rule. The account state
#: must match the row's in every case.
ALLOWED = [
    ("5xx_exhausted", P.WS_ENTRYPOINTS, {("retryable_close", 1013)},
     "R65, R70, R81: the WebSocket closes 1013 where HTTP answers 502"),
    ("cut_after_output", ("http_json", "messages_json", *P.MEDIA_ENTRYPOINTS), {SERVED},
     "R19 step 2: a JSON client never saw output, so the cut fails over"),
    ("cut_after_output", P.WS_ENTRYPOINTS, {("retryable_close", 1011)},
     "R51, R65, R81: the WebSocket may end the broken turn with close 1011"),
    ("clean_end_after_output", ("http_json", "messages_json", *P.MEDIA_ENTRYPOINTS), {SERVED},
     "R19 step 2: a JSON client never saw output, so the truncated body fails over"),
    ("clean_end_after_output", P.WS_ENTRYPOINTS, {("retryable_close", 1011)},
     "R51, R65, R81: the WebSocket may end the broken turn with close 1011 (never 1000)"),
    ("first_output_timeout", ("http_json", *P.MEDIA_ENTRYPOINTS), {("served_same", None)},
     "R20 scope: the first-output timeout is for streaming requests only"),
    ("429_usage_limit_later_turn", ("ws_passthrough",), {("retryable_close", 1013)},
     "R51: a later-turn usage_limit_reached in passthrough closes 1013"),
    ("429_usage_limit_later_turn", ("http_sse", "http_json"), {("terminal_error", 400)},
     ("R41, R76: the continuation moves with its id; the new account answers"
      " previous_response_not_found (400)")),
]


def allowedFor(row: Row, entrypoint: str) -> tuple:
    """
    @return: C{(allowed outcome keys, notes)} for a cell.
    """
    keys, notes = {row.expect}, []
    for name, columns, outcomes, rule in ALLOWED:
        if name == row.name and entrypoint in columns:
            keys |= outcomes
            notes.append(rule)
    return keys, notes


@frozen
class Cell:
    """
    One recorded cell.
    """

    entrypoint: str
    outcome: P.Outcome
    state: tuple
    store: str
    counters: dict
    attempts: str

    def decisions(self) -> tuple:
        """
        The compared counters: failovers, same-account retries (totals) and
        cooldowns by kind.
        """
        c = self.counters
        return (sum(c["failovers"].values()), sum(c["same_retries"].values()),
                tuple(sorted(c["cooldowns"].items())))


def _attempts(stack) -> str:
    def count(credential):
        recs = stack.emulator.requestsFor(credential)
        return sum(1 for r in recs if r.kind in ("request", "frame"))
    return f"{count(BAD)}/{count(GOOD)}"


async def _capture(stack, entrypoint, outcome, turns) -> Cell:
    await P.settle(stack, turns)
    view = await P.adminAccounts(stack)
    state = P.accountState(view["bad"], P.modelFor(entrypoint))
    return Cell(entrypoint, outcome, state, await P.storeState(stack, "bad"),
                P.decisionCounters(stack), _attempts(stack))


async def _turnDriver(stack, row, entrypoint, clients):
    outcome, client = await P.oneTurn(stack, entrypoint)
    if client is not None:
        clients.append(client)
    return await _capture(stack, entrypoint, outcome, 1)


async def _leave3Driver(stack, row, entrypoint, clients):
    """
    Three clients in a row leave after the first output; the state is read
    after the third; then an ordinary turn shows which account serves.
    """
    stack.emulator.setScript(BAD, {"delay": SLOW})
    for n in range(3):
        await P.leaveMidTurn(stack, entrypoint, "fin")
        await P.settle(stack, n + 1)
    assert P.departures(stack) == 3
    cell = await _capture(stack, entrypoint, P.Outcome("none"), 3)
    stack.emulator.setScript(BAD, None)
    nxt, client = await P.oneTurn(stack, entrypoint)
    if client is not None:
        clients.append(client)
    return Cell(entrypoint, P.Outcome("none", f"next:{nxt.servedBy or nxt.kind}"), cell.state,
                cell.store, cell.counters, cell.attempts)


async def _leaveWaitingDriver(stack, row, entrypoint, clients):
    """
    Both accounts (one slot each) are busy with slow HTTP turns; a third
    client starts a turn, waits for a slot, and leaves while waiting.
    """
    stack.emulator.setScript(BAD, {"delay": SLOW * 2})
    stack.emulator.setScript(GOOD, {"delay": SLOW * 2})
    busy = []
    for _ in range(2):
        sid, text = P.newSession()
        body = {"model": P.MODEL, "input": text, "stream": True}
        busy.append(ensureDeferred(stack.postJSON("/v1/responses", body,
                                                  headers={"session-id": [sid]})))
    ids = ["bad", "good"]

    async def loads():
        return await stack.app.admission.load("account", ids)

    async def until(predicate, what):
        for _ in range(int(P.WAIT / 0.01)):
            if predicate(await loads()):
                return
            await deferLater(reactor, 0.01, lambda: None)
        raise AssertionError(f"timed out waiting for {what}: {await loads()}")

    await until(lambda now: now == {"bad": (1, 0), "good": (1, 0)}, "both slots busy")
    leaver = await P.startLeaver(stack, entrypoint)
    await until(lambda now: sum(w for _, w in now.values()) == 1, "the third client to wait")
    P.leaveNow(entrypoint, leaver, "fin")
    for d in busy:
        response, data = await d
        assert response.code == 200, data
        assert sseEvents(data)[-1][0] == "response.completed"
    cell = await _capture(stack, entrypoint, P.Outcome("none"), 3)
    assert P.departures(stack) == 1
    return cell


async def _laterTurnDriver(stack, row, entrypoint, clients):
    """
    Turn 1 completes on C{bad}; then the fault; turn 2 continues turn 1
    (C{previous_response_id}) on the same WebSocket, or as an HTTP
    continuation.
    """
    fault = row.faultFor(entrypoint)
    stack.emulator.setFault(BAD, None)
    first, client = await P.oneTurn(stack, entrypoint)
    if client is not None:
        clients.append(client)
    assert first.kind == "served_same", first
    stack.emulator.setFault(BAD, dict(fault, transport=P.upstreamTransport(entrypoint)))
    outcome, _ = await P.oneTurn(stack, entrypoint, client=client, previous=first.responseId)
    return await _capture(stack, entrypoint, outcome, 2)


async def _compactionDriver(stack, row, entrypoint, clients):
    """
    One compaction turn (its input ends with C{compaction_trigger}, R89).
    """
    outcome, client, _ = await P.compactionTurn(stack, entrypoint)
    if client is not None:
        clients.append(client)
    return await _capture(stack, entrypoint, outcome, 1)


async def _compactionAfterDriver(stack, row, entrypoint, clients):
    """
    A compaction turn that fails over (the fault applies once), then the
    turn that carries its compaction item: HTTP in full input from a new
    session, WebSocket chained on the same connection.
    """
    first, client, item = await P.compactionTurn(stack, entrypoint)
    if client is not None:
        clients.append(client)
    assert first.kind == "served_by_other" and item is not None, first
    outcome, _, _ = await P.compactionTurn(stack, entrypoint, client=client, item=item,
                                           previous=first.responseId)
    return await _capture(stack, entrypoint, outcome, 2)


DRIVERS = {
    "compaction": _compactionDriver,
    "compactionAfter": _compactionAfterDriver,
    "turn": _turnDriver,
    "refused": _turnDriver,
    "leave3": _leave3Driver,
    "leaveWaiting": _leaveWaitingDriver,
    "laterTurn": _laterTurnDriver,
}


async def runCell(row: Row, entrypoint: str) -> Cell:
    """
    Run one cell on its own stack.
    """
    accounts = [dict(a) for a in row.accounts]
    if row.driver == "refused":
        accounts[0]["base_url"] = f"http://127.0.0.1:{P.closedPort()}/v1"
    stack = await P.startParityStack(entrypoint, accounts, row.firstOutputTimeout)
    clients = []
    try:
        fault = row.faultFor(entrypoint)
        if fault is not None and row.driver != "laterTurn":
            # Pin the fault to the transport this entrypoint uses upstream.
            stack.emulator.setFault(BAD, dict(fault, transport=P.upstreamTransport(entrypoint)))
        return await DRIVERS[row.driver](stack, row, entrypoint, clients)
    finally:
        await P.drain(stack, clients)


# -- the table ---------------------------------------------------------------------

RESULTS: dict = {}


def _fmtOutcome(o: P.Outcome) -> str:
    code = "" if o.code is None else f" {o.code}"
    who = f" by {o.servedBy}" if o.servedBy and o.kind.startswith("served") else ""
    return f"{o.kind}{code}{who}"


def formatRow(row: Row, cells: dict, problems=()) -> str:
    code = "" if row.expect[1] is None else f" {row.expect[1]}"
    lines = [f"== {row.name}  [{row.rules}]",
             f"   prescribed: {row.expect[0]}{code}  state {row.state}"]
    for ep, cell in cells.items():
        c = cell.counters
        flag = "!" if any(p.startswith(ep + ":") for p in problems) else " "
        lines.append(
            f" {flag} {ep:<15} {_fmtOutcome(cell.outcome):<32} state {cell.state!s:<32}"
            f" store {cell.store:<22} failovers {c['failovers'] or '-'}"
            f" same {c['same_retries'] or '-'} cooldowns {c['cooldowns'] or '-'}"
            f" upstream {c['upstream_status'] or '-'} waits {c['waits'] or '-'}"
            f" bad/good {cell.attempts}"
            + ("" if cell.outcome.kind.startswith("served") or not cell.outcome.detail
               else f"  ({cell.outcome.detail})")
        )
    return "\n".join(lines)


def checkRow(row: Row, cells: dict) -> list:
    """
    @return: the problems of a row: cells whose outcome or state differs from
        what the spec prescribes (after L{ALLOWED}), and decision counters
        that differ between cells with the row's own outcome.
    """
    problems = []
    reference = None
    for ep, cell in cells.items():
        keys, _rules = allowedFor(row, ep)
        if cell.outcome.key() not in keys:
            problems.append(f"{ep}: outcome {cell.outcome.key()} not in {sorted(keys, key=str)}"
                            f" ({cell.outcome.detail})")
        if cell.state != row.state:
            problems.append(f"{ep}: state {cell.state} != {row.state} (store: {cell.store})")
        if cell.outcome.key() == row.expect:
            if reference is None:
                reference = (ep, cell.decisions())
            elif cell.decisions() != reference[1]:
                problems.append(f"{ep}: decisions {cell.decisions()} != {reference[0]}'s"
                                f" {reference[1]} (failovers, same-account retries, cooldowns)")
    return problems


@pytest.fixture(scope="module", autouse=True)
def _writeMatrix():
    """
    After the module: print the whole matrix and, when
    C{RELAY_PARITY_MATRIX} is set, write it to that file.
    """
    yield
    names = [r.name for r in ROWS] + [r.name + "@oauth" for r in ROWS]
    text = "\n\n".join(RESULTS[name] for name in names if name in RESULTS)
    skipped = "\n".join(f"  {name}: {why}" for name, why in OAUTH_SKIPPED.items())
    text += f"\n\nOAuth rows skipped:\n{skipped}"
    absent = "\n".join(f"  {name}: {why}" for name, why in MESSAGES_ABSENT.items())
    text += f"\n\nRows without the messages columns:\n{absent}"
    allowed = "\n".join(f"  {name} @ {', '.join(cols)}: {sorted(outs, key=str)}  -- {rule}"
                        for name, cols, outs, rule in ALLOWED)
    text = f"{text}\n\nAllowed differences (behaviour.md):\n{allowed}\n"
    print("\n" + text)
    path = os.environ.get("RELAY_PARITY_MATRIX")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
@pytest_twisted.ensureDeferred
async def test_parity_row(row):
    """
    R86 and the rules named in the row: the fault on the preferred account
    gives, on every entrypoint it exists on, the prescribed client outcome
    (or an allowed, cited difference), the same account state in the
    operator view, and the same failover / same-account retry / cooldown
    decisions.
    """
    cells = {}
    for entrypoint in row.columns:
        cells[entrypoint] = await runCell(row, entrypoint)
    problems = checkRow(row, cells)
    table = formatRow(row, cells, problems)
    RESULTS[row.name] = table + ("\n   PROBLEMS:\n   " + "\n   ".join(problems) if problems else "")
    print("\n" + RESULTS[row.name])
    assert not problems, RESULTS[row.name]


#: Rows whose columns leave out the Messages API, and why (R115: it is an
#: HTTP surface with neither continuations nor compaction turns).
MESSAGES_ABSENT = {
    "5xx_ws_handshake": "a WebSocket-only fault",
    "403_html_in_band": "a WebSocket-only fault",
    "compaction_5xx": "the Messages API has no compaction turn",
    "compaction_turn_after": "the Messages API has no compaction turn",
    "429_usage_limit_later_turn": "the Messages API has no previous_response_id",
}


#: Rows the OAuth columns skip, with the rule that makes them different in
#: kind rather than in parity: an OAuth 429 retries the same account for up
#: to its 2-minute window (R13) before it marks anything, which the HTTP
#: continuation rows cannot exercise on OAuth at all (R42).
OAUTH_SKIPPED = {
    "429_usage_limit": "R13: an OAuth 429 retries the same account within its 2-minute window",
    "429_rate_limit": "R13: an OAuth 429 retries the same account within its 2-minute window",
    "429_usage_limit_later_turn": "R42: HTTP continuations need an API-key account",
    "5xx_ws_handshake": "a WebSocket-only fault",
    "compaction_5xx": "chat and messages have no compaction turn (OAuth compaction turns:"
                      " test_compaction.py)",
    "compaction_turn_after": "chat and messages have no compaction turn",
}

OAUTH_ROWS = [r for r in ROWS if r.name not in OAUTH_SKIPPED]


def checkOAuthRow(row: Row, cells: dict) -> list:
    """
    @return: the problems of an OAuth row: the chat-on-OAuth cell must show
        the same client outcome class, account state and decisions as a
        Responses stream on the same OAuth accounts (issue 13: chat holds
        back, fails over and marks exactly as responses does).
    """
    reference = cells[P.SSE_OAUTH]
    problems = []
    for ep, cell in cells.items():
        if ep == P.SSE_OAUTH:
            continue
        if cell.outcome.kind != reference.outcome.kind:
            problems.append(f"{ep}: outcome {cell.outcome.key()} != {P.SSE_OAUTH}'s"
                            f" {reference.outcome.key()} ({cell.outcome.detail})")
        if cell.state != reference.state:
            problems.append(f"{ep}: state {cell.state} != {P.SSE_OAUTH}'s {reference.state}")
        if cell.decisions() != reference.decisions():
            problems.append(f"{ep}: decisions {cell.decisions()} != {P.SSE_OAUTH}'s"
                            f" {reference.decisions()}")
    return problems


@pytest.mark.parametrize("row", OAUTH_ROWS, ids=[r.name for r in OAUTH_ROWS])
@pytest_twisted.ensureDeferred
async def test_parity_row_oauth(row):
    """
    Issue 13 + R86 + R115: on OAuth accounts, a chat stream and a Messages
    stream (each translated to the
    backend's Responses route) meet each fault exactly as a Responses
    stream does: the same outcome class, the same account state in the
    operator view, the same failover / retry / cooldown decisions.
    """
    cells = {}
    for entrypoint in P.OAUTH_ENTRYPOINTS:
        cells[entrypoint] = await runCell(row, entrypoint)
    problems = checkOAuthRow(row, cells)
    table = formatRow(row, cells, problems).replace(
        f"   prescribed: {row.expect[0]}", f"   (OAuth; compared with {P.SSE_OAUTH}) api-key row:"
        f" {row.expect[0]}", 1)
    RESULTS[row.name + "@oauth"] = table + (
        "\n   PROBLEMS:\n   " + "\n   ".join(problems) if problems else "")
    print("\n" + RESULTS[row.name + "@oauth"])
    assert not problems, RESULTS[row.name + "@oauth"]
