"""
The chaos soak (issue 14): two relay processes on one real Redis, behind no balancer, with
~200 concurrent simulated clients (HTTP SSE and JSON, chat stream and not, the Responses
WebSocket in ctx_pool, passthrough and http_bridge) running 2-turn conversations, while the
emulator injects every fault kind at random (seeded chaos, L{relay.emulator.chaos}), clients
cancel about 10 % of their turns at random moments, Redis is restarted twice, one relay is
reloaded with C{SIGHUP} (an account added, a priority changed) and the other is stopped with
C{SIGTERM} and started again.

Afterwards it prints a figures table (and writes it to C{$RELAY_SOAK_FIGURES} when set) and
asserts (definitions in L{tests.integration.soakchecks}):

  - no slot, wait-queue, heartbeat or refresh-lock key is left in Redis once idle, and no
    upstream turn is still open at the emulator;
  - every client turn ended with a completed answer, a clear error (an HTTP status with
    OpenAI's envelope, an in-stream C{response.failed}/C{error}/chat error chunk, a
    WebSocket close code) or its own cancel -- none is unclear, none hung past its deadline;
  - no client turn was generated twice upstream;
  - chained HTTP turns find their owner (R39, R42) but across a Redis restart;
  - no upstream call for a turn more than 1 s after its client left;
  - each relay process's peak RSS stays below L{soakchecks.RSS_BOUND_KIB};
  - the R86 rules hold in the relays' JSON logs, and they show no unexpected failure
    (a critical line, a traceback, an unhandled error);
  - both stops (the mid-run restart and the final stop) exit 0;
  - OAuth tokens (40 s access tokens) are refreshed mid-run by the two relays without a
    refresh token used twice and without a login lost (issue 12, across the restarts).

Deterministic to re-run: the seed is printed first (C{RELAY_SOAK_SEED} overrides it); each
client's choices and each turn's faults derive from it. How many turns fit in the time
depends on the machine; what is asserted does not. C{RELAY_SOAK_CLIENTS} and
C{RELAY_SOAK_SECONDS} scale it for local runs (defaults 200 and 40: about 2,900 client turns on a
loaded 2-core box, every fault kind injected 9 times or more, each OAuth token refreshed two or
three times; 60 s bought nothing the checks need and cost 20 s of CI); C{RELAY_SOAK_KEEP=1}
keeps the configs and logs (they are kept anyway when the soak fails).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from tests.integration import soakchecks as checks
from tests.integration.redis_server import requireRedis
from tests.integration.soakclients import CLEAR, SoakClients
from tests.integration.soakstack import FAULTS, SoakStack

SEED = int(os.environ.get("RELAY_SOAK_SEED", "1414"))
CLIENTS = int(os.environ.get("RELAY_SOAK_CLIENTS", "200"))
SECONDS = float(os.environ.get("RELAY_SOAK_SECONDS", "40"))
FAULT_RATE = 0.2


async def _sleepUntil(when: float) -> None:
    await deferLater(reactor, max(0.0, when - reactor.seconds()), lambda: None)


async def _operations(stack: SoakStack, start: float, exits: list) -> None:
    """
    Redis restart, SIGHUP, SIGTERM restart, Redis restart, spread over the run.
    """
    await _sleepUntil(start + 0.13 * SECONDS)
    await stack.restartRedis()
    await _sleepUntil(start + 0.30 * SECONDS)
    stack.reload(0)
    await _sleepUntil(start + 0.45 * SECONDS)
    exits.append(await stack.restartRelay(1))
    await _sleepUntil(start + 0.70 * SECONDS)
    await stack.restartRedis()


async def _leftovers(stack: SoakStack, timeout: float = 15.0) -> list:
    """
    Non-empty slot sets, wait queues and heartbeats, and refresh locks, polled until none
    is left or C{timeout} passes (releases are fire-and-forget).
    """
    deadline = reactor.seconds() + timeout
    while True:
        found = []
        for pattern in ("concurrency:*", "wait:*"):
            for key in stack.redisKeys(pattern):
                if stack.redisCommand("type", key) == "zset":
                    n = int(stack.redisCommand("zcard", key) or 0)
                    if n:
                        found.append(f"{key}={n}")
        found += stack.redisKeys("relay:oauth:lock:*")
        if not found or reactor.seconds() > deadline:
            return found
        await deferLater(reactor, 0.5, lambda: None)


async def _quiet(stack: SoakStack, timeout: float = 10.0) -> dict:
    """
    Upstream turns still in flight at the emulator, polled until none is left or C{timeout}
    passes: once every client is done, relay must have closed every upstream request (a hang
    it timed out, a turn whose client left) -- pooled idle WebSockets are not turns.
    """
    deadline = reactor.seconds() + timeout
    while True:
        found = await stack.inflight()
        if not found or reactor.seconds() > deadline:
            return found
        await deferLater(reactor, 0.5, lambda: None)


@pytest_twisted.ensureDeferred
async def test_chaos_soak():
    """
    Issue 14's chaos soak: under load, random faults, cancels, Redis restarts, a reload and a
    restart, nothing leaks, nothing is generated twice, nobody hangs, no call reaches the
    upstream after its client left, RSS stays bounded, and the R86 rules hold in the logs.
    """
    requireRedis()
    print(f"\nchaos soak seed {SEED} (RELAY_SOAK_SEED overrides), {CLIENTS} clients, "
          f"{SECONDS:.0f} s, fault rate {FAULT_RATE}")
    tmp = tempfile.mkdtemp(prefix="relay-soak-")
    stack = SoakStack(tmp=tmp, seed=SEED, rate=FAULT_RATE)
    keep = bool(os.environ.get("RELAY_SOAK_KEEP"))
    try:
        began = reactor.seconds()
        await stack.start()
        clients = SoakClients(seed=SEED, urls=stack.urls)
        exits = []
        start = reactor.seconds()
        operations = Deferred.fromCoroutine(_operations(stack, start, exits))
        await clients.run(CLIENTS, SECONDS)
        await operations
        loadEnded = reactor.seconds()
        leftovers = await _leftovers(stack)
        inflight = await _quiet(stack)
        ledger = await stack.ledger()
        tokenStats = await stack.oauthStats()
        stack.recordPeaks()
        for relay in stack.relays:
            relay.process.terminate()
        for relay in stack.relays:
            exits.append(await relay.waitExit(60))
        stack.stopEmulator()
        logs = {path: checks.readLog(path) for paths in stack.relayLogs for path in paths}
        turns = clients.turns
        checks.dump(tmp, turns, ledger)
        found = checks.ledgerViolations(ledger, turns)
        logFound = checks.logViolations(logs, turns)
        outcomes = Counter(t.outcome for t in turns)
        kinds = Counter(t.kind for t in turns)
        errors = Counter(f"{t.kind} {t.detail}" for t in turns
                         if t.outcome in ("error_status", "error_stream", "ws_close"))
        cancels = Counter(t.cancelPhase for t in turns if t.outcome == "cancelled")
        stops = [t for t, what in stack.events if what.endswith("SIGTERM")]
        excused, unexcused = checks.unansweredExcused(turns, logs, stops)
        unclear = [t for t in turns if t.outcome not in CLEAR + ("unanswered",)] + unexcused
        modes = checks.wsModes(logs)
        oauthLog = checks.oauthEvents(logs)
        kills = [t for t, what in stack.events if what == "redis killed"]
        starts = [t for t, what in stack.events if what == "redis started"]
        chainsLost = checks.chainsLost(logs, turns, list(zip(kills, starts)))
        chained = sum(1 for t in turns if t.kind in ("sse", "json") and t.id.endswith("-t2"))
        faults = checks.injectedFaults(stack.emulatorLog)
        missingKinds = sorted({f["kind"] for f in FAULTS} - set(faults))
        missingModes = sorted({"ctx_pool", "passthrough", "http_bridge"} - set(modes))
        rows = [
            ("seed", SEED, ""),
            ("clients / conversations", f"{CLIENTS} / {clients.conversations}", ""),
            ("client turns", len(turns), ""),
            ("  by kind", " ".join(f"{k}={v}" for k, v in sorted(kinds.items())), ""),
            ("  completed", outcomes["completed"], ""),
            ("  clear errors: HTTP status", outcomes["error_status"], ""),
            ("  clear errors: in-stream", outcomes["error_stream"], ""),
            ("  clear errors: WS close code", outcomes["ws_close"], ""),
            ("  most frequent errors", " ".join(
                f"[{d}]={n}" for d, n in errors.most_common(6)), ""),
            ("  cancelled by the client", f"{outcomes['cancelled']} (" + " ".join(
                f"{k}={v}" for k, v in sorted(cancels.items()))
             + f"; relay saw {checks.waitsLeft(logs)} leave a slot wait; planned "
             f"{sum(1 for t in turns if t.cancelPlan)})", "plan ~10 %"),
            ("  dropped unanswered at a relay's stop", len(excused), "(never reached relay)"),
            ("  unclear or hung", len(unclear), "0"),
            ("  rerouted after a refused connection", sum(t.rerouted for t in turns), ""),
            ("WebSocket connections by mode", " ".join(
                f"{k}={v}" for k, v in sorted(modes.items(), key=str)), "all 3 modes"),
            ("faults injected", sum(faults.values()), ""),
            ("  by kind", " ".join(f"{k}={v}" for k, v in sorted(faults.items(), key=str)),
             "every kind"),
            ("upstream requests / generations", f"{found['requests']} / "
             f"{found['generations']}", ""),
            ("chained HTTP turns / scheduled without owner", f"{chained} / {len(chainsLost)}",
             "- / 0"),
            ("turns generated twice", len(found["doubles"]), "0"),
            ("upstream calls > 1 s after the client left", len(found["late_calls"]), "0"),
            ("generations > 1 s after the client left", found["late_generations"], "(info)"),
            ("OAuth refreshes at the token endpoint", " ".join(
                f"{name}:{v['refreshes']}" for name, v in sorted(tokenStats.items())),
             "each > 0"),
            ("  refresh token reuse attempts", sum(v["reuse_attempts"]
                                                   for v in tokenStats.values()), "0"),
            ("  relay token events", " ".join(
                f"{k.split('.')[-1]}={v}" for k, v in sorted(oauthLog.items())),
             "needs_login=0"),
            ("upstream turns still open when idle", sum(inflight.values()), "0"),
            ("Redis slot/wait/lease keys left when idle", len(leftovers), "0"),
            ("peak RSS per relay process (MiB)", " ".join(
                f"r{i}:{kib // 1024}" for i, _, kib in stack.peakKiB),
             f"< {checks.RSS_BOUND_KIB // 1024}"),
            ("relay exit codes (restart, final)", " ".join(map(str, exits)), "all 0"),
            ("R86: ops events after departure", len(logFound["ops_after_departure"]), "0"),
            ("R86: breaker marks w/o transport failure",
             len(logFound["breaker_without_transport"]), "0"),
            ("R86: streak steps w/o 5xx-like failure", len(logFound["streak_without_5xx"]),
             "0"),
            ("R86: cooldowns with a forbidden cause", len(logFound["cooldown_bad_cause"]), "0"),
            ("relay unexpected failures (tracebacks)", len(logFound["unexpected_failures"]),
             "0"),
            ("markings by cause", " ".join(f"{n.split('.')[-1]}<-{c}={v}" for (n, c), v in
                                           sorted(logFound["causes"].items(), key=str)), ""),
            ("operations", "; ".join(f"{t - start:.0f}s {what}" for t, what in stack.events),
             ""),
            ("load / total seconds", f"{loadEnded - start:.0f} / "
             f"{reactor.seconds() - began:.0f}", "total < 180"),
        ]
        text = checks.table(rows)
        print(text)
        target = os.environ.get("RELAY_SOAK_FIGURES")
        if target:
            with open(target, "w") as f:
                f.write(text + "\n")
        problems = {
            "unclear or hung turns": [f"{t.id} {t.kind} r{t.relay} {t.outcome}: {t.detail}"
                                      for t in unclear],
            "double generations": found["doubles"],
            "R39 chains lost": chainsLost,
            "late upstream calls": found["late_calls"],
            "Redis leftovers": leftovers,
            "upstream turns left open": [f"{k}={v}" for k, v in inflight.items()],
            "RSS over bound": [p for p in stack.peakKiB if p[2] >= checks.RSS_BOUND_KIB],
            "non-zero exits": [c for c in exits if c != 0],
            "fault kinds never injected": missingKinds,
            "OAuth accounts never refreshed": [n for n, v in tokenStats.items()
                                               if not v["refreshes"]],
            "OAuth refresh token reuse": [n for n, v in tokenStats.items()
                                          if v["reuse_attempts"]],
            "OAuth logins lost": [f"needs_login x{oauthLog['relay.oauth_needs_login']}"]
            if oauthLog["relay.oauth_needs_login"] else [],
            "WebSocket modes never used": missingModes,
            **{f"R86 {k}": v for k, v in logFound.items() if k != "causes"},
        }
        problems = {k: v for k, v in problems.items() if v}
        for name, found in problems.items():
            print(f"PROBLEM {name} ({len(found)}):")
            for each in found[:20]:
                print(f"  {each}")
        if problems or keep:
            keep = True
            print(f"soak files kept in {tmp}")
        assert not problems, "\n".join(f"{k} ({len(v)}): {v[:8]}" for k, v in problems.items())
        # Not a vacuous soak: most turns get through despite the faults and the overload.
        assert outcomes["completed"] > len(turns) * 0.3, outcomes
    finally:
        stack.stop()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
