"""
What the chaos soak checks afterwards (issue 14), from the clients' records
(L{tests.integration.soakclients.TurnRecord}), the emulator's turn ledger
(L{relay.emulator.chaos}), Redis, and the relays' JSON logs; and the figures table.

Definitions (the soak's contract):

  - I{generation}: the emulator delivered a whole answer for a client turn id to a
    connection that was still open (see L{relay.emulator.chaos}). A failover after a
    failed, cut, hung or cleanly-ended-without-terminal attempt is not a second generation:
    those attempts generated nothing whole. A turn I{generated twice because of relay} is
    a client turn id with two or more generations. Clients never reuse a turn id (a client
    that wants to try again starts a new turn), so every second generation is relay's.
  - I{departure}: when the client stopped waiting for a turn -- its answer or error
    arrived, it cancelled, or its deadline passed. An I{upstream call after the client
    left} is a request the emulator recorded for the turn's id more than
    L{LATE_CALL_SLACK} seconds after that.
  - The R86 log rules (behaviour.md R86, R2), per relay log file (one process):
      1. no C{openai.ops_event} of a turn more than L{LATE_CALL_SLACK} seconds after its
         client left, nor after relay's own C{relay.turn_finished} for it (a departed
         client's attempts write nothing, R2);
      2. every breaker line (C{openai.account_transport_circuit_open},
         C{openai.account_temp_unscheduled_transport}) follows an ops event of the same turn
         and account whose end is an upstream transport failure (R86.3);
      3. every R11 streak step (C{openai_model_transient_state}) follows an ops event of the
         same turn and account that is a 5xx-like failure before output and not a capacity
         shed (R86.2);
      4. every C{relay.account_cooldown_set} follows an ops event of the same turn and account,
         never a capacity shed, a clean end without terminal event (R86.4), relay's own
         timeout or a departure.
  - I{Chains kept} (R39, R41, R42): a chained HTTP Responses turn (turn 2, with the
    C{previous_response_id} of turn 1, which completed) is scheduled with its owner known --
    the relay either routed it to the owner or logged why the owner was skipped (cooling,
    excluded, ...) -- unless Redis was restarted between the two turns (the record is gone
    and only the relay that served turn 1 still knows it locally) or the turn never reached
    scheduling.
  - I{Unanswered} turns (a connection dropped before any response, see
    L{tests.integration.soakclients}) are excused only when relay never saw them (no log line
    carries their id) and they happened within L{STOP_WINDOW} seconds of a relay's C{SIGTERM},
    in under 2 s: the kernel resets connections it queued for a listening socket the process
    closes. Any other is unclear.
  - No unexpected failure: no relay log line at level C{critical}, with a traceback, or an
    unhandled error in a Deferred (a bug relay did not expect, whatever the client saw).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from datetime import datetime

LATE_CALL_SLACK = 1.0
"""Seconds after a client's departure within which an upstream call is not counted late."""

RSS_BOUND_KIB = 200 * 1024
"""The bound on each relay process's peak RSS (VmHWM), in KiB."""

STOP_WINDOW = 3.0
"""Seconds around a relay's C{SIGTERM} within which an unanswered connection is excused."""

TRANSPORT_ENDS = frozenset({"TransportFailure", "StreamCut"})
STATUS_ENDS = frozenset({"StatusRefused", "InBandFailure"})
NEVER_MARKS = frozenset({"StreamEnded", "RelayTimeout", "Departed", "Refused", "PoolBusy"})


def isoSeconds(value: str) -> float:
    """
    Unix seconds of a log line's C{time} (ISO-8601 UTC with milliseconds).
    """
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def readLog(path: str) -> list:
    """
    The JSON lines of one relay log (other lines, e.g. Twisted's start-up text, skipped),
    each with C{_t} (Unix seconds) and C{_n} (line number).
    """
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f):
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            event["_t"] = isoSeconds(event["time"]) if "time" in event else 0.0
            event["_n"] = number
            out.append(event)
    return out


def isOverload(event: dict) -> bool:
    """
    Whether an ops event is a capacity shed (529, C{server_is_overloaded}, "overloaded").
    """
    text = f"{event.get('reason')} {event.get('message')}".lower()
    return event.get("upstream_status") == 529 or "overload" in text or "capacity" in text


def isFiveHundredLike(event: dict) -> bool:
    """
    Whether an ops event is R86.2's 5xx-like failure before output.
    """
    status = event.get("upstream_status") or 0
    text = f"{event.get('reason')} {event.get('message')}".lower()
    return (event.get("end") in STATUS_ENDS and not event.get("after_output")
            and not isOverload(event) and (500 <= status <= 599 or "server_error" in text))


def clientIds(logs: dict) -> dict:
    """
    R111: relay's request ids are its own; the soak clients' ids (HTTP: C{X-Request-Id}, a
    WebSocket's upgrade: the conversation's) are logged as C{client_request_id}. This reads
    the lines that carry both.

    @return: C{{"ids": relay id -> client id, "conns": WebSocket connection id -> client id}}.
    """
    ids, conns = {}, {}
    for lines in logs.values():
        for event in lines:
            rid, cid = event.get("request_id"), event.get("client_request_id")
            if not (isinstance(rid, str) and isinstance(cid, str)):
                continue
            if rid.startswith("ws_"):
                conns[rid.split(":", 1)[0]] = cid
            else:
                ids[rid] = cid
    return {"ids": ids, "conns": conns}


def clientRid(event: dict, known: dict):
    """
    An event's request id as the soak clients name the turn (L{clientIds}): an HTTP
    request's client id, C{<conversation>:<n>} for a WebSocket turn, else relay's id.
    """
    rid = event.get("request_id")
    if not isinstance(rid, str):
        return rid
    found = known["ids"].get(rid)
    if found is not None:
        return found
    conn, sep, n = rid.partition(":")
    prefix = known["conns"].get(conn)
    if prefix is not None:
        return f"{prefix}{sep}{n}"
    return rid


def logViolations(logs: dict, turns: list) -> dict:
    """
    Check the R86 log rules (module docstring) in every relay log.

    @param logs: path -> parsed lines (L{readLog}).
    @param turns: the clients' L{TurnRecord}s.
    @return: rule name -> list of offending descriptions, plus C{"causes"}: a Counter of
        C{(marking event, cause end)} seen (for the figures).
    """
    departed = {t.requestId: t.departed for t in turns
                if t.outcome in ("cancelled", "hung") and t.departed is not None}
    out = {"ops_after_departure": [], "breaker_without_transport": [],
           "streak_without_5xx": [], "cooldown_bad_cause": [], "unexpected_failures": [],
           "causes": Counter()}
    known = clientIds(logs)
    for path, lines in logs.items():
        finished = {}
        lastOps = {}
        for event in lines:
            name = event.get("event")
            rid = clientRid(event, known)
            account = event.get("account_id")
            message = str(event.get("message") or "")
            if (event.get("level") == "critical" or "traceback" in event
                    or message.startswith("Unhandled error")):
                out["unexpected_failures"].append(
                    f"{path}:{event['_n']} {name} {rid}: {message[:120]} "
                    f"{str(event.get('failure') or '')[:200]}")
            if name == "relay.turn_finished" and rid:
                finished[rid] = event
            elif name == "openai.ops_event":
                left = departed.get(rid)
                if left is not None and event["_t"] > left + LATE_CALL_SLACK:
                    out["ops_after_departure"].append(f"{path}:{event['_n']} {rid} {account} "
                                                      f"{event['_t'] - left:.1f}s after")
                elif rid in finished and finished[rid].get("outcome") == "client_gone":
                    out["ops_after_departure"].append(f"{path}:{event['_n']} {rid} after "
                                                      "turn_finished client_gone")
                lastOps[(rid, account)] = event
            elif name in ("openai.account_transport_circuit_open",
                          "openai.account_temp_unscheduled_transport",
                          "openai_model_transient_state", "relay.account_cooldown_set"):
                cause = lastOps.get((rid, account))
                out["causes"][(name, cause.get("end") if cause else None)] += 1
                where = f"{path}:{event['_n']} {name} {rid} {account}"
                if cause is None:
                    bucket = ("streak_without_5xx" if name == "openai_model_transient_state"
                              else "cooldown_bad_cause" if name == "relay.account_cooldown_set"
                              else "breaker_without_transport")
                    out[bucket].append(where + " without an ops event")
                elif name == "openai_model_transient_state":
                    if not isFiveHundredLike(cause):
                        out["streak_without_5xx"].append(where + f" after {_describe(cause)}")
                elif name == "relay.account_cooldown_set":
                    if cause.get("end") in NEVER_MARKS or isOverload(cause):
                        out["cooldown_bad_cause"].append(where + f" after {_describe(cause)}")
                elif cause.get("end") not in TRANSPORT_ENDS:
                    out["breaker_without_transport"].append(where + f" after {_describe(cause)}")
    return out


def _describe(event: dict) -> str:
    return (f"{event.get('end')} {event.get('upstream_status')} {event.get('reason')} "
            f"after_output={event.get('after_output')}")


def ledgerViolations(ledger: dict, turns: list) -> dict:
    """
    Double generations and upstream calls after departure (module docstring).

    @return: C{{"doubles": [...], "late_calls": [...], "late_generations": n,
        "requests": n, "generations": n}}.
    """
    doubles = [f"{key}: {len(entry['generations'])} generations on "
               f"{[g[1] for g in entry['generations']]}"
               for key, entry in ledger.items() if len(entry["generations"]) > 1]
    late, lateGenerations = [], 0
    for turn in turns:
        entry = ledger.get(turn.id)
        if entry is None or turn.departed is None:
            continue
        for when, name, transport in entry["requests"]:
            if when > turn.departed + LATE_CALL_SLACK:
                late.append(f"{turn.id} ({turn.kind}, {turn.outcome}): {transport} request to "
                            f"{name} {when - turn.departed:.2f}s after the client left")
        lateGenerations += sum(1 for when, _ in entry["generations"]
                               if when > turn.departed + LATE_CALL_SLACK)
    return {
        "doubles": doubles,
        "late_calls": late,
        "late_generations": lateGenerations,
        "requests": sum(len(e["requests"]) for e in ledger.values()),
        "generations": sum(len(e["generations"]) for e in ledger.values()),
    }


def table(rows: list) -> str:
    """
    Render C{(figure, value, bound)} rows as a fixed-width table.
    """
    width = max(len(str(r[0])) for r in rows)
    boundWidth = max(len("bound"), *(len(str(r[2])) for r in rows))
    lines = [f"{'figure'.ljust(width)}  {'bound'.ljust(boundWidth)}  value",
             f"{'-' * width}  {'-' * boundWidth}  -----"]
    for name, value, bound in rows:
        lines.append(f"{str(name).ljust(width)}  {str(bound).ljust(boundWidth)}  {value}")
    return "\n".join(lines)


def injectedFaults(emulatorLog: str) -> Counter:
    """
    The faults the emulator applied, by kind (its C{emulator.fault} log lines).
    """
    found = Counter()
    with open(emulatorLog, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"emulator.fault"' not in line:
                continue
            try:
                # twist writes Twisted's JSON log records, each after a record separator.
                found[json.loads(line.strip("\x1e\r\n")).get("kind")] += 1
            except ValueError:
                continue
    return found


def wsModes(logs: dict) -> Counter:
    """
    Client WebSocket connections by the mode they ended in (C{relay.ws_closed}).
    """
    return Counter(event.get("mode") for lines in logs.values() for event in lines
                   if event.get("event") == "relay.ws_closed")



def dump(directory: str, turns: list, ledger: dict) -> None:
    """
    Write the client records (C{turns.jsonl}) and the emulator's ledger (C{ledger.json})
    next to the logs, for reading a failed soak.
    """
    with open(os.path.join(directory, "turns.jsonl"), "w") as f:
        for turn in turns:
            f.write(json.dumps({k: getattr(turn, k) for k in (
                "id", "requestId", "kind", "relay", "started", "ended", "departed", "outcome",
                "detail", "cancelPlan", "cancelPhase", "rerouted", "responseId")}) + "\n")
    with open(os.path.join(directory, "ledger.json"), "w") as f:
        json.dump(ledger, f)


OAUTH_EVENTS = ("relay.oauth_refreshed", "relay.oauth_refresh_shared", "relay.oauth_tokens_loaded",
                "relay.oauth_refresh_failed", "relay.oauth_refresh_in_doubt",
                "relay.oauth_needs_login", "relay.oauth_refresh_conflict")


def oauthEvents(logs: dict) -> Counter:
    """
    The relays' OAuth token events by name (issue 12's log lines).
    """
    return Counter(event["event"] for lines in logs.values() for event in lines
                   if event.get("event") in OAUTH_EVENTS)


def chainsLost(logs: dict, turns: list, redisDown: list) -> list:
    """
    Chained HTTP turns scheduled without their owner (module docstring, "Chains kept").

    @param redisDown: C{(killed, started)} Unix-second pairs of the Redis restarts.
    """
    byId = {t.id: t for t in turns}
    seen = {}
    known = clientIds(logs)
    for lines in logs.values():
        for event in lines:
            rid = clientRid(event, known)
            if not rid or not rid.endswith("-t2"):
                continue
            if event.get("event") == "openai.previous_response_owner_skipped":
                seen.setdefault(rid, set()).add("skipped")
            elif event.get("event") == "openai.account_schedule_decision":
                seen.setdefault(rid, set()).add(
                    "hit" if event.get("sticky_previous_hit") else "decided")
    lost = []
    for turn in turns:
        if turn.kind not in ("sse", "json") or not turn.id.endswith("-t2"):
            continue
        first = byId.get(turn.id[:-1] + "1")
        marks = seen.get(turn.requestId, set())
        if first is None or first.ended is None or marks != {"decided"}:
            continue
        if first.relay != turn.relay and any(
                killed < (turn.ended or turn.started) and started > first.ended - 1.0
                for killed, started in redisDown):
            continue  # Redis lost the record between turn 1's end and turn 2's scheduling
        lost.append(f"{turn.id}: turn 1 on relay {first.relay}, turn 2 on relay {turn.relay} "
                    f"{turn.started - first.ended:.3f}s later, owner unknown ({turn.detail})")
    return lost


def waitsLeft(logs: dict) -> int:
    """
    Slot waits that ended because the client left (C{outcome: client_gone}), as the relays
    saw them: the clients that cancelled I{while waiting}.
    """
    return sum(1 for lines in logs.values() for event in lines
               if event.get("event") in ("openai.account_wait_finished",
                                         "openai.websocket_account_wait_finished")
               and event.get("outcome") == "client_gone")


def unansweredExcused(turns: list, logs: dict, stops: list) -> tuple:
    """
    Split the unanswered turns (module docstring) into excused and not.

    @param stops: Unix seconds of the relays' C{SIGTERM}s.
    @return: C{(excused, unexcused)} lists of L{TurnRecord}.
    """
    known = clientIds(logs)
    seen = {clientRid(event, known) for lines in logs.values() for event in lines}
    excused, unexcused = [], []
    for turn in turns:
        if turn.outcome != "unanswered":
            continue
        connection = turn.requestId.rsplit(":", 1)[0] if turn.kind == "ws" else turn.requestId
        quick = turn.ended is not None and turn.ended - turn.started < 2.0
        atStop = any(abs(turn.started - when) < STOP_WINDOW for when in stops)
        if quick and atStop and turn.requestId not in seen and connection not in seen:
            excused.append(turn)
        else:
            unexcused.append(turn)
    return excused, unexcused
