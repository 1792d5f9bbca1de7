# -*- test-case-name: tests.test_report -*-
"""
Seed-style outcome tables from relay's JSON logs.

Usage::

    python -m relay.console.report LOGFILE [--json]
    relay-report LOGFILE [--json]

C{LOGFILE} is relay's JSON log (C{--log-format json}: one flat JSON object
per line, L{relay.base.logs.formatJSONLine}), or C{-} for standard input. A
file with lines but no JSON object (a text log) prints a one-line hint to
standard error and exits 1. Logs
written by C{twisted.logger.jsonFileLogObserver} (a C{\\x1e} record
separator before each object) read the same way. Events are selected by
their C{event} field (style.md section 6):

  - waits (seed 000's "who had to wait" table):
    C{openai.websocket_account_wait_finished} and
    C{openai.account_wait_finished}, by entrypoint and phase;
  - failover switches: C{openai.upstream_failover_switching} and
    C{openai.websocket_upstream_failover_switching}, by reason and by
    account C{from -> to};
  - schedule decisions: C{openai.account_schedule_decision}, by layer, with
    the sticky-hit share (seed 003);
  - WebSocket closes: C{relay.ws_closed}, by code and reason;
  - turns: C{relay.turn_finished}, by entrypoint and outcome.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from typing import IO, Iterable, Optional

__all__ = ["buildReport", "formatReport", "main", "percentile", "readEvents"]

WS_WAIT_FINISHED = "openai.websocket_account_wait_finished"
HTTP_WAIT_FINISHED = "openai.account_wait_finished"
HTTP_FAILOVER = "openai.upstream_failover_switching"
WS_FAILOVER = "openai.websocket_upstream_failover_switching"
SCHEDULE_DECISION = "openai.account_schedule_decision"
WS_CLOSED = "relay.ws_closed"
TURN_FINISHED = "relay.turn_finished"

_WAIT_OUTCOMES = ("acquired", "queue_full", "timeout", "client_gone")
_LAYERS = ("previous_response_id", "session_hash", "load_balance")


def readEvents(inFile: IO, counts: Optional[Counter] = None) -> Iterable[dict]:
    """
    Read log events, in order, from a JSON log file: one object per line
    (a leading C{\\x1e} record separator is ignored).

    @param inFile: a file opened for reading (text or binary).
    @param counts: if given, counts C{records} (non-blank records read)
        and C{objects} (those that were a JSON object), so a caller can
        tell a log that is not JSON from an empty one.
    @return: an iterable of event dicts (lines that are not a JSON object
        are skipped).
    """
    counts = counts if counts is not None else Counter()
    for line in inFile:
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        for record in line.split("\x1e"):
            record = record.strip()
            if not record:
                continue
            counts["records"] += 1
            try:
                event = json.loads(record)
            except ValueError:
                continue
            if isinstance(event, dict):
                counts["objects"] += 1
                yield event


def percentile(values: list, p: float) -> Optional[float]:
    """
    The nearest-rank percentile.

    @param values: numbers, in any order.
    @param p: 0..100.
    @return: the value, or L{None} for no values.
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _num(value) -> Optional[float]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _truthy(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def buildReport(events: Iterable[dict]) -> dict:
    """
    Aggregate events into the report's tables.

    @param events: log events (dicts with an C{event} field; others are
        ignored).
    @return: a JSON-able dict with the keys C{waits}, C{failovers},
        C{decisions}, C{ws_closes}, C{turns} and C{events} (how many
        events of each known name were read).
    @rtype: L{dict}
    """
    seen: Counter = Counter()
    waits: dict = defaultdict(lambda: {"outcomes": Counter(), "acquired_ms": []})
    failovers: list = []
    pendingNext: dict = defaultdict(list)
    decisions: Counter = Counter()
    stickySession = stickyPrevious = stickyAny = 0
    decisionsByEntry: dict = defaultdict(Counter)
    closes: Counter = Counter()
    turns: dict = defaultdict(lambda: {"count": 0, "statuses": Counter(), "attempts": [],
                                       "durations": []})

    for event in events:
        name = event.get("event")
        if not isinstance(name, str):
            continue
        if name in (WS_WAIT_FINISHED, HTTP_WAIT_FINISHED):
            seen[name] += 1
            entry = event.get("entrypoint") or ("ws" if name == WS_WAIT_FINISHED else "http")
            phase = event.get("phase") or "request"
            row = waits[(str(entry), str(phase))]
            outcome = str(event.get("outcome") or "unknown")
            row["outcomes"][outcome] += 1
            waitMs = _num(event.get("wait_ms"))
            if outcome == "acquired" and waitMs is not None:
                row["acquired_ms"].append(waitMs)
        elif name in (HTTP_FAILOVER, WS_FAILOVER):
            seen[name] += 1
            status = event.get("upstream_status")
            reason = event.get("reason") or (
                f"status_{status}" if status is not None else "unknown"
            )
            record = {
                "entrypoint": "ws" if name == WS_FAILOVER else "http",
                "reason": str(reason),
                "from": event.get("account_id"),
                "to": event.get("next_account_id"),
                "upstream_status": status,
            }
            failovers.append(record)
            requestId = event.get("request_id")
            if record["to"] is None and requestId is not None:
                pendingNext[requestId].append(record)
        elif name == SCHEDULE_DECISION:
            seen[name] += 1
            layer = str(event.get("layer") or "unknown")
            decisions[layer] += 1
            entry = event.get("entrypoint")
            if entry:
                decisionsByEntry[str(entry)][layer] += 1
            session = _truthy(event.get("sticky_session_hit"))
            previous = _truthy(event.get("sticky_previous_hit"))
            stickySession += session
            stickyPrevious += previous
            stickyAny += session or previous
            requestId = event.get("request_id")
            waiting = pendingNext.get(requestId)
            if waiting:
                selected = event.get("selected_account_id") or event.get("account_id")
                for record in waiting:
                    record["to"] = selected
                del pendingNext[requestId]
        elif name == WS_CLOSED:
            seen[name] += 1
            closes[(event.get("code"), str(event.get("reason") or ""))] += 1
        elif name == TURN_FINISHED:
            seen[name] += 1
            key = (str(event.get("entrypoint") or "?"), str(event.get("outcome") or "unknown"))
            row = turns[key]
            row["count"] += 1
            if event.get("status") is not None:
                row["statuses"][str(event.get("status"))] += 1
            attempts = _num(event.get("attempts"))
            if attempts is not None:
                row["attempts"].append(attempts)
            duration = _num(event.get("duration_ms"))
            if duration is not None:
                row["durations"].append(duration)

    waitRows = []
    for (entry, phase), row in sorted(waits.items()):
        outcomes = row["outcomes"]
        waitRows.append(
            {
                "entrypoint": entry,
                "phase": phase,
                "total": sum(outcomes.values()),
                **{o: outcomes.get(o, 0) for o in _WAIT_OUTCOMES},
                "other": sum(n for o, n in outcomes.items() if o not in _WAIT_OUTCOMES),
                "p50_ms": percentile(row["acquired_ms"], 50),
                "p95_ms": percentile(row["acquired_ms"], 95),
            }
        )

    byReason = Counter((f["entrypoint"], f["reason"]) for f in failovers)
    byPair = Counter(
        (f["from"] or "?", f["to"] or "?") for f in failovers
    )
    totalDecisions = sum(decisions.values())

    def share(n: int) -> Optional[float]:
        return round(100.0 * n / totalDecisions, 1) if totalDecisions else None

    turnRows = []
    for (entry, outcome), row in sorted(turns.items()):
        attempts = row["attempts"]
        turnRows.append(
            {
                "entrypoint": entry,
                "outcome": outcome,
                "count": row["count"],
                "statuses": dict(sorted(row["statuses"].items())),
                "mean_attempts": round(sum(attempts) / len(attempts), 2) if attempts else None,
                "p50_ms": percentile(row["durations"], 50),
                "p95_ms": percentile(row["durations"], 95),
            }
        )

    return {
        "events": dict(sorted(seen.items())),
        "waits": waitRows,
        "failovers": {
            "total": len(failovers),
            "by_reason": [
                {"entrypoint": e, "reason": r, "count": n}
                for (e, r), n in sorted(byReason.items(), key=lambda kv: (-kv[1], kv[0]))
            ],
            "by_account": [
                {"from": a, "to": b, "count": n}
                for (a, b), n in sorted(byPair.items(), key=lambda kv: (-kv[1], kv[0]))
            ],
        },
        "decisions": {
            "total": totalDecisions,
            "by_layer": [
                {"layer": layer, "count": n, "share_percent": share(n)}
                for layer, n in sorted(
                    decisions.items(),
                    key=lambda kv: (_LAYERS.index(kv[0]) if kv[0] in _LAYERS else 99, kv[0]),
                )
            ],
            "by_entrypoint": {
                entry: dict(sorted(counts.items()))
                for entry, counts in sorted(decisionsByEntry.items())
            },
            "sticky_session_hits": stickySession,
            "sticky_previous_hits": stickyPrevious,
            "sticky_hits": stickyAny,
            "sticky_hit_percent": share(stickyAny),
        },
        "ws_closes": [
            {"code": code, "reason": reason, "count": n}
            for (code, reason), n in sorted(
                closes.items(), key=lambda kv: (-kv[1], str(kv[0][0]), kv[0][1])
            )
        ],
        "turns": turnRows,
    }


def _fmtMs(ms: Optional[float]) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _table(headers: list, rows: list) -> str:
    """
    A plain, tab-free text table with right-aligned numbers.
    """
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        out = []
        for i, c in enumerate(r):
            numeric = c.replace(".", "", 1).replace("%", "").lstrip("-").isdigit()
            out.append(c.rjust(widths[i]) if numeric else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def formatReport(report: dict) -> str:
    """
    Render L{buildReport}'s result as text tables.

    @rtype: L{str}
    """
    parts = []
    parts.append("== Requests that had to wait for a slot ==")
    if report["waits"]:
        parts.append(
            _table(
                ["entrypoint", "phase", "waits", "acquired", "queue_full", "timeout",
                 "client_gone", "other", "p50 / p95 (acquired)"],
                [
                    [w["entrypoint"], w["phase"], w["total"], w["acquired"], w["queue_full"],
                     w["timeout"], w["client_gone"], w["other"],
                     f"{_fmtMs(w['p50_ms'])} / {_fmtMs(w['p95_ms'])}"]
                    for w in report["waits"]
                ],
            )
        )
    else:
        parts.append("(no wait events)")

    f = report["failovers"]
    parts.append("")
    parts.append(f"== Failover switches ({f['total']}) ==")
    if f["total"]:
        parts.append(
            _table(["entrypoint", "reason", "switches"],
                   [[r["entrypoint"], r["reason"], r["count"]] for r in f["by_reason"]])
        )
        parts.append("")
        parts.append(
            _table(["from", "to", "switches"],
                   [[r["from"], r["to"], r["count"]] for r in f["by_account"]])
        )
    else:
        parts.append("(no failover events)")

    d = report["decisions"]
    parts.append("")
    parts.append(f"== Schedule decisions ({d['total']}) ==")
    if d["total"]:
        parts.append(
            _table(["layer", "decisions", "share"],
                   [[r["layer"], r["count"], f"{r['share_percent']}%"] for r in d["by_layer"]])
        )
        parts.append(
            f"sticky hits: {d['sticky_hits']} of {d['total']} ({d['sticky_hit_percent']}%);"
            f" session_hash hits {d['sticky_session_hits']},"
            f" previous_response_id hits {d['sticky_previous_hits']}"
        )
    else:
        parts.append("(no decision events)")

    parts.append("")
    parts.append("== WebSocket closes ==")
    if report["ws_closes"]:
        parts.append(
            _table(["code", "reason", "closes"],
                   [[c["code"], c["reason"], c["count"]] for c in report["ws_closes"]])
        )
    else:
        parts.append("(no close events)")

    parts.append("")
    parts.append("== Turns ==")
    if report["turns"]:
        parts.append(
            _table(
                ["entrypoint", "outcome", "turns", "statuses", "mean attempts",
                 "p50 / p95 duration"],
                [
                    [t["entrypoint"], t["outcome"], t["count"],
                     " ".join(f"{s}:{n}" for s, n in t["statuses"].items()),
                     t["mean_attempts"], f"{_fmtMs(t['p50_ms'])} / {_fmtMs(t['p95_ms'])}"]
                    for t in report["turns"]
                ],
            )
        )
    else:
        parts.append("(no turn events)")
    return "\n".join(parts) + "\n"


def main(
    argv: Optional[list] = None,
    out: Optional[IO] = None,
    stdin: Optional[IO] = None,
    err: Optional[IO] = None,
) -> int:
    """
    The command line: C{relay-report LOGFILE [--json]}.

    @param argv: arguments without the program name (default C{sys.argv[1:]}).
    @param out: where to print (default standard output).
    @param stdin: what C{-} reads (default standard input).
    @param err: where errors go (default standard error).
    @return: the exit status: 0, 2 for a file that cannot be read, 1 for
        one that holds lines but no JSON object (a text log: the hint on
        standard error says how to get a JSON one).
    """
    parser = argparse.ArgumentParser(
        prog="relay-report", description="Seed-style outcome tables from relay's JSON logs."
    )
    parser.add_argument("logfile", help="a JSON log file written by relay, or - for stdin")
    parser.add_argument("--json", action="store_true", help="print the tables as JSON")
    args = parser.parse_args(argv)
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    counts: Counter = Counter()
    if args.logfile == "-":
        source = stdin if stdin is not None else sys.stdin.buffer
        report = buildReport(readEvents(source, counts))
    else:
        try:
            with open(args.logfile, "rb") as f:
                report = buildReport(readEvents(f, counts))
        except OSError as e:
            print(f"relay-report: {e}", file=err)
            return 2
    if counts["records"] and not counts["objects"]:
        name = "standard input" if args.logfile == "-" else args.logfile
        print(
            f"relay-report: {name} has {counts['records']} lines but no JSON records;"
            " it needs a log written with --log-format json (or log.format: json)",
            file=err,
        )
        return 1
    if args.json:
        out.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
    else:
        out.write(formatReport(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
