"""
Codex-shaped turns (issue 38), the C{codex} part of C{bench/compare.py}:

  python bench/compare.py --only codex [--baseline REF] [--seconds 5]

Bodies from C{bench/codexbody.py} (instructions, tools, a history of user
and assistant messages, reasoning with C{encrypted_content},
C{function_call}s and their outputs) of 64 KiB, 256 KiB and 1 MiB, sent
with wrk to the same nginx upstream as the speed rows, against direct (the
upstream), the Go row, the Twisted floor, relay and (C{--baseline}) the
baseline relay, all pinned as in the speed rows (the process under test on
CPU 0, wrk and the upstream on CPU 1):

  - JSON and SSE at C{c=1} (added p50 over direct) and C{c=32} (RPS, CPU
    per turn, the highest RSS seen);
  - the 1 KiB rows (JSON c=1 and c=32, the 40-event stream at c=16) of the
    same processes, so a regression of the small turn shows in the same
    run;
  - a 50-turn Codex WebSocket session in each mode (ctx_pool, passthrough,
    http_bridge) against the bundled emulator (on CPU 1), the history
    growing ~20 KiB a turn: relay's CPU per turn (C{schedstat},
    nanoseconds) by turn number; for http_bridge beside the CPU of one
    HTTP turn carrying the same history;
  - (C{turncost}) callgrind instructions per 1 MiB turn, relay and the
    Twisted floor (C{bench/turncost.py}, the C{codex} scenario).

Every target of issue 38 is printed with met / not met, as ratios to the
Go row of the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import codexbody  # noqa: E402
import compare  # noqa: E402

SIZES = [("64 KiB", 64 * 1024), ("256 KiB", 256 * 1024), ("1 MiB", 1024 * 1024)]
WS_MODES = ("ctx_pool", "passthrough", "http_bridge")
WS_TURNS = 50
WS_SESSIONS = 3
FRESH_FROM = 256 * 1024
"""The sizes measured also with a new conversation every turn (no body
read as the extension of another: L{FRESH_LUA})."""


def luaScript(tmp: str, name: str, body: bytes, accept, fresh: bool = False) -> str:
    """
    A wrk script POSTing C{body} (read from a file) with relay's key. With
    C{fresh}, every request is a new conversation: a first message of its
    own ahead of the history, so no turn extends one relay read before
    (relay.frontdoor.reuse) and each body is parsed whole.
    """
    data = os.path.join(tmp, name + ".json")
    with open(data, "wb") as f:
        f.write(body)
    path = os.path.join(tmp, name + ".lua")
    with open(path, "w") as f:
        f.write(f'local f = io.open("{data}", "rb")\nwrk.body = f:read("*a")\nf:close()\n'
                'wrk.method = "POST"\n'
                'wrk.headers["Content-Type"] = "application/json"\n'
                f'wrk.headers["Authorization"] = "Bearer {compare.RELAY_KEY}"\n'
                + (f'wrk.headers["Accept"] = "{accept}"\n' if accept else "")
                + (FRESH_LUA if fresh else ""))
    return path


FRESH_LUA = """
local at = wrk.body:find('"input":[', 1, true) + 8
local head, tail = wrk.body:sub(1, at), wrk.body:sub(at + 1)
math.randomseed(os.time())
local run, n = math.random(1, 1000000000), 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, nil, head .. '{"type":"message","role":"user","content":"new '
    .. run .. ' ' .. n .. '"},' .. tail)
end
"""
"""wrk's C{request}: the body with a first input item of its own per request."""


def schedNs(pid: int) -> int:
    """
    CPU nanoseconds all of C{pid}'s threads ran (C{/proc/PID/task/*/schedstat}).
    """
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def _perTurn(r: dict) -> float:
    """
    CPU ms per turn of a wrk result.
    """
    return r["cpu"] / r["requests"] * 1e3 if r["requests"] else float("nan")


# -- HTTP ---------------------------------------------------------------------------


def http(procs, bodies: dict, seconds: float, baseline) -> tuple:
    """
    The HTTP rows. @return: C{(results, idle RSS by target, names)}.
    """
    upstream, uport = compare.startUpstream(procs, bodies, cpu=1)
    relay, rport = compare.startRelay(procs, "relay-codex", uport, cpu=0)
    goproxy, gport = compare.startGo(procs, compare.buildGo(procs.tmp), uport, cpu=0)
    floor, fport = compare.startFloor(procs, uport, cpu=0)
    targets = [("direct", uport, upstream.pid), ("go", gport, goproxy.pid),
               ("floor", fport, floor.pid), ("relay", rport, relay.pid)]
    if baseline:
        base, bport = compare.startRelay(procs, "relay-codex-baseline", uport, cpu=0,
                                         tree=baseline[0], python=baseline[2])
        targets.append(("baseline", bport, base.pid))
    for _, port, _ in targets:
        compare.wrk(procs.tmp, "json", port, 4, 1, cpu=1)
    time.sleep(3)  # relay's start-up collection (relay.tap.SettleMemory) is over
    idle = {name: compare.memory(pid)["VmRSS"] for name, _, pid in targets}
    results = {}
    small = [("1 KiB", "json", 1, "json"), ("1 KiB", "json", 32, "json"),
             ("1 KiB", "sse", 16, "sse")]
    for size, kind, conns, script in small:
        for name, port, pid in targets:
            results[size, kind, conns, name] = compare.wrk(procs.tmp, script, port, conns,
                                                           seconds, cpu=1, watch=[pid])
    for size, nbytes in SIZES:
        scripts = {kind: luaScript(procs.tmp, f"codex-{nbytes}-{kind}",
                                   codexbody.body(nbytes, stream=kind == "sse"),
                                   "text/event-stream" if kind == "sse" else None)
                   for kind in ("json", "sse")}
        for name, port, _ in targets:
            compare.wrk(procs.tmp, "json", port, 4, 1, cpu=1, script=scripts["json"])
        if nbytes >= FRESH_FROM:
            scripts["fresh"] = luaScript(procs.tmp, f"codex-{nbytes}-fresh",
                                         codexbody.body(nbytes), None, fresh=True)
        for kind in scripts:
            for conns in (1, 32):
                for name, port, pid in targets:
                    results[size, kind, conns, name] = compare.wrk(
                        procs.tmp, "json", port, conns, seconds, cpu=1, watch=[pid],
                        script=scripts[kind])
    for name, _, pid in targets:
        results["hwm", name] = compare.memory(pid)["VmHWM"]
    procs.stopAll()
    return results, idle, [t[0] for t in targets]


# -- WebSocket ------------------------------------------------------------------------


def _frames(turns: int) -> list:
    """
    The client frames of a C{turns}-turn Codex WebSocket session: the
    first a full C{response.create} (instructions, tools, the first turn's
    items), each later one only its new items (~20 KiB) and, filled in as
    the session runs, the C{previous_response_id}.
    """
    import random

    rnd = random.Random(38)
    out = []
    for n in range(1, turns + 1):
        frame = codexbody.envelope(codexbody.turnItems(rnd, n))
        frame.pop("stream")
        frame["type"] = "response.create"
        out.append(frame)
    return out


async def _session(port: int, frames: list, pid: int) -> list:
    """
    One session on one client WebSocket; relay's CPU ns per turn.
    """
    import websockets

    costs = []
    previous = None
    async with websockets.connect(
        f"ws://127.0.0.1:{port}/v1/responses", max_size=None, compression=None,
        additional_headers={"Authorization": f"Bearer {compare.RELAY_KEY}"},
    ) as ws:
        for frame in frames:
            if previous:
                frame = dict(frame, previous_response_id=previous)
            data = json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
            before = schedNs(pid)
            await ws.send(data)
            while True:
                event = json.loads(await ws.recv())
                kind = event.get("type")
                if kind == "response.completed":
                    previous = event["response"]["id"]
                    break
                if kind in ("error", "response.failed"):
                    raise SystemExit(f"WebSocket turn failed: {event}")
            costs.append(schedNs(pid) - before)
    return costs


def _timedPost(conn, pid: int, body: bytes) -> int:
    """
    POST C{body} to C{/v1/responses} on C{conn}; relay's CPU ns for it.
    """
    before = schedNs(pid)
    conn.request("POST", "/v1/responses", body,
                 {"Authorization": f"Bearer {compare.RELAY_KEY}",
                  "Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    if r.status != 200:
        raise SystemExit(f"HTTP turn failed: {r.status}")
    return schedNs(pid) - before


def _httpSession(port: int, pid: int, frames: list) -> list:
    """
    One Codex conversation over HTTP: every turn sends the whole history
    so far (the items of C{frames} up to it); relay's CPU ns per turn.
    """
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    items, costs = [], []
    for frame in frames:
        items = items + frame["input"]
        body = json.dumps(codexbody.envelope(items), ensure_ascii=False,
                          separators=(",", ":")).encode()
        costs.append(_timedPost(conn, pid, body))
    conn.close()
    return costs


def _httpCost(port: int, pid: int, frames: list, upto: int, repeat: int = 10) -> float:
    """
    relay's CPU ns for one HTTP turn carrying the history of the first
    C{upto} turns of C{frames} (what http_bridge sends upstream for turn
    C{upto}), the mean of C{repeat} turns, each a new conversation (a first
    item of its own, so none is read as the extension of another: the
    cost of reading the history whole).
    """
    import http.client

    items = [i for f in frames[:upto] for i in f["input"]]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    total = 0
    for i in range(repeat + 2):
        first = {"type": "message", "role": "user", "content": f"conversation {i}"}
        body = json.dumps(codexbody.envelope([first] + items), ensure_ascii=False,
                          separators=(",", ":")).encode()
        ns = _timedPost(conn, pid, body)
        if i >= 2:
            total += ns
    conn.close()
    return total / repeat, len(body)


def _emulator(procs) -> int:
    port = compare.free()
    conf = os.path.join(procs.tmp, "codex-emulator.yaml")
    with open(conf, "w") as f:
        f.write(f'listen: "tcp:{port}:interface=127.0.0.1"\n'
                "default_script: {text: '" + "w " * 32 + "', deltas: 32}\n")
    procs.start("codex-emulator", [sys.executable, "-m", "twisted", "relay-emulator",
                                   "--config", conf],
                cpu=1, env=dict(os.environ, PYTHONPATH=compare.ROOT))
    compare.waitPort(port)
    return port


def websocket(procs, trees: list) -> dict:
    """
    L{WS_SESSIONS} sessions of L{WS_TURNS} turns in each mode, per tree.

    @return: C{(tree label, mode)} -> mean CPU ns per turn, by turn; and
        C{(tree label, "http")} -> C{(ns, body bytes)} of one HTTP turn of
        the last turn's history.
    """
    eport = _emulator(procs)
    frames = _frames(WS_TURNS)
    out = {}
    for label, tree, python in trees:
        for mode in WS_MODES:
            extra = f"gateway: {{websocket: {{mode_default: {mode}}}}}\n"
            relay, rport = compare.startRelay(procs, f"relay-ws-{mode}", eport, cpu=0,
                                              extra=extra, tree=tree, python=python)
            time.sleep(3)
            asyncio.run(_session(rport, frames[:5], relay.pid))  # warm-up
            runs = [asyncio.run(_session(rport, frames, relay.pid))
                    for _ in range(WS_SESSIONS)]
            out[label, mode] = [sum(r[i] for r in runs) / len(runs) for i in range(WS_TURNS)]
            if mode == "http_bridge":
                out[label, "http"] = _httpCost(rport, relay.pid, frames, WS_TURNS)
            procs.stop(relay)
        relay, rport = compare.startRelay(procs, "relay-http-session", eport, cpu=0,
                                          tree=tree, python=python)
        time.sleep(3)
        _httpSession(rport, relay.pid, frames[:5])  # warm-up
        runs = [_httpSession(rport, relay.pid, frames) for _ in range(WS_SESSIONS)]
        out[label, "http session"] = [sum(r[i] for r in runs) / len(runs)
                                      for i in range(WS_TURNS)]
        procs.stop(relay)
    return out


# -- the report ---------------------------------------------------------------------


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def report(results: dict, idle: dict, names: list, ws: dict, wsTrees: list, cg, out: list,
           seconds: float) -> None:
    """
    The codex tables and the targets.
    """
    rows = [n for n in names if n != "direct"]
    out.append("## Codex-shaped turns (issue 38)\n")
    out.append("Bodies from `bench/codexbody.py` (instructions, tools, messages, reasoning with "
               "`encrypted_content`, `function_call`s and outputs; compact UTF-8 JSON as Codex "
               f"sends it). Pinned as the speed rows; {seconds:g} s per scenario. CPU per turn "
               "is the process under test's (for direct: the upstream's).\n")
    out.append("| body | figure | " + " | ".join(names) + " | "
               + " | ".join(f"{n} / Go" for n in rows if n != "go") + " |")
    out.append("|---|---|" + "---:|" * (len(names) + len(rows) - 1))
    sizes = [("1 KiB", 0)] + SIZES
    for size, _ in sizes:
        combos = ([("json", 1), ("json", 32), ("sse", 16)] if size == "1 KiB"
                  else [("json", 1), ("sse", 1), ("json", 32), ("sse", 32)])
        if (size, "fresh", 1, "relay") in results:
            combos += [("fresh", 1), ("fresh", 32)]
        for kind, conns in combos:
            r = {n: results[size, kind, conns, n] for n in names}
            label = {"json": "JSON", "sse": "SSE", "fresh": "JSON new conversation"}[kind]
            label = f"{label} c={conns}"
            d, g = r["direct"], r["go"]
            if conns == 1:
                added = {n: r[n]["p50"] - d["p50"] for n in rows}
                gAdded = max(added["go"], 1e-3)
                out.append(f"| {size} | {label} added p50 ms | | "
                           + " | ".join(f"{added[n]:.2f}" for n in rows) + " | "
                           + " | ".join(f"{added[n] / gAdded:.1f}x" for n in rows if n != "go")
                           + " |")
            else:
                mult = compare.EVENTS_PER_STREAM if (kind == "sse" and size == "1 KiB") else 1
                unit = "events/s" if mult > 1 else "RPS"
                out.append(f"| {size} | {label} {unit} | "
                           + " | ".join(f"{r[n]['rps'] * mult:,.0f}" for n in names) + " | "
                           + " | ".join(f"{r[n]['rps'] / g['rps']:.3f}x" for n in rows
                                        if n != "go") + " |")
                out.append(f"| {size} | {label} CPU per turn ms | "
                           + " | ".join(f"{_perTurn(r[n]):.2f}" for n in names) + " | "
                           + " | ".join(f"{_perTurn(r[n]) / _perTurn(g):.1f}x" for n in rows
                                        if n != "go") + " |")
                if size != "1 KiB":
                    out.append(f"| {size} | {label} highest RSS MiB | "
                               + " | ".join(f"{r[n]['rss'] / 1024:.0f}" for n in names) + " | "
                               + " |" * (len(rows) - 1))
            errors = [f"{n} {r[n]['errors']}" for n in names if r[n]["errors"]]
            if errors:
                out.append(f"| {size} | {label} errors | " + ", ".join(errors)
                           + " |" * (len(names) + len(rows) - 1))
    out.append("| | idle RSS MiB (after warm-up) | "
               + " | ".join(f"{idle[n] / 1024:.0f}" for n in names) + " |"
               + " |" * (len(rows) - 1))
    out.append("")
    if ws:
        out.append("### Codex WebSocket session: relay's CPU per turn by turn number\n")
        out.append(f"{WS_TURNS} turns, history +~20 KiB a turn (the client sends each turn's "
                   "new items with `previous_response_id`; http_bridge replays the whole "
                   "history upstream; `http session` is the same conversation over HTTP, "
                   "every turn a JSON POST of the whole history so far, as Codex sends it), "
                   f"the emulator upstream on CPU 1; mean of {WS_SESSIONS} "
                   "sessions, ms (schedstat). The HTTP turn of turn 50's history is a new "
                   "conversation each time (its history read whole).\n")
        out.append("| tree | mode | turn 1 | turns 2-11 | turns 21-30 | turns 41-50 | "
                   "41-50 / 2-11 |")
        out.append("|---|---|---:|---:|---:|---:|---:|")
        for label in wsTrees:
            for mode in WS_MODES + ("http session",):
                c = ws[label, mode]
                a, m, z = (sum(c[i:j]) / (j - i) / 1e6 for i, j in ((1, 11), (20, 30), (40, 50)))
                out.append(f"| {label} | {mode} | {c[0] / 1e6:.2f} | {a:.2f} | {m:.2f} | "
                           f"{z:.2f} | {z / a:.2f}x |")
            ns, nbytes = ws[label, "http"]
            out.append(f"| {label} | HTTP turn of turn {WS_TURNS}'s history "
                       f"({nbytes / 1024:.0f} KiB) | | | | {ns / 1e6:.2f} | |")
        out.append("")
    if cg:
        out.extend(cg)
    _targets(results, idle, names, ws, wsTrees, out)


def _targets(results, idle, names, ws, wsTrees, out) -> None:
    out.append("### Issue 38 targets (same run)\n")
    who = [n for n in ("relay", "baseline") if n in names]
    out.append("| target | goal | " + " | ".join(who) + " |")
    out.append("|---|---|" + "---:|" * len(who))

    def row(name, goal, cell):
        out.append(f"| {name} | {goal} | " + " | ".join(cell(n) for n in who) + " |")

    big = "1 MiB"
    fresh = (big, "fresh", 1, "relay") in results
    kinds = (("json", ""), ("fresh", ", a new conversation every turn (relay's own stricter "
                                     "row)")) if fresh else (
        ("json", ""),)
    for kind, what in kinds:
        d1 = results[big, kind, 1, "direct"]

        def added(n, kind=kind, d1=d1):
            v = results[big, kind, 1, n]["p50"] - d1["p50"]
            return f"{v:.2f} ms {_met(v <= 2.0)}"

        row(f"1 MiB JSON c=1 added p50{what}", "<= 2 ms", added)
    for kind, what in kinds:
        gCpu = _perTurn(results[big, kind, 32, "go"])

        def cpu(n, kind=kind, gCpu=gCpu):
            v = _perTurn(results[big, kind, 32, n])
            return f"{v:.2f} ms = {v / gCpu:.1f}x Go {_met(v <= 3.0 and v / gCpu <= 4.0)}"

        row(f"1 MiB CPU per turn (JSON c=32{what})", "<= 3 ms and <= 4x Go", cpu)
    for kind, what in kinds:
        g256 = results["256 KiB", kind, 32, "go"]["rps"]

        def rps(n, kind=kind, g256=g256):
            v = results["256 KiB", kind, 32, n]["rps"] / g256
            return f"{v:.3f}x {_met(v >= 0.35)}"

        row(f"256 KiB JSON c=32 RPS{what}", ">= 0.35x Go", rps)
    inflight = 32 * 1024  # KiB: 32 bodies of 1 MiB

    def rss(n):
        peak = max(results[big, k, 32, n]["rss"] for k in ("json", "sse", "fresh")
                   if (big, k, 32, n) in results)
        bound = 1.5 * idle[n] + inflight
        return (f"{peak / 1024:.0f} MiB (idle {idle[n] / 1024:.0f} MiB; bound "
                f"{bound / 1024:.0f} MiB) {_met(peak <= bound)}")

    row("peak RSS, c=32 with 1 MiB bodies", "<= 1.5x idle + 32 MiB in flight", rss)
    if ws:
        for mode in ("ctx_pool", "passthrough"):
            def flat(n, mode=mode):
                label = _wsLabel(wsTrees, n)
                if label is None:
                    return "-"
                c = ws[label, mode]
                a, z = sum(c[1:11]) / 10, sum(c[40:50]) / 10
                return f"{z / a:.2f}x {_met(z / a <= 1.25)}"

            row(f"WS {mode}: CPU per turn, turns 41-50 / 2-11", "flat (<= 1.25x)", flat)

        def bridge(n):
            label = _wsLabel(wsTrees, n)
            if label is None:
                return "-"
            c = ws[label, "http_bridge"]
            z = sum(c[40:50]) / 10
            h = ws[label, "http"][0]
            return f"{z / h:.2f}x {_met(z / h <= 1.5)}"

        row("WS http_bridge CPU per turn (41-50) / HTTP turn of the same history",
            "<= 1.5x", bridge)

        def session(n):
            label = _wsLabel(wsTrees, n)
            if label is None or (label, "http session") not in ws:
                return "-"
            c = ws[label, "http session"]
            a, z = sum(c[1:11]) / 10, sum(c[40:50]) / 10
            return f"{z / a:.2f}x {_met(z / a <= 1.25)}"

        row("HTTP session: CPU per turn, turns 41-50 / 2-11 (relay's own stricter row: every "
            "HTTP turn resends the whole history, so its bytes grow ~20x over the session)",
            "flat (<= 1.25x)", session)
    for kind, conns, what in (("json", 1, "added"), ("json", 32, "rps"), ("sse", 16, "rps")):
        base = "baseline" if "baseline" in names else None
        if base is None:
            continue
        g, d = results["1 KiB", kind, conns, "go"], results["1 KiB", kind, conns, "direct"]

        def ratio(n, kind=kind, conns=conns, what=what, g=g, d=d):
            r = results["1 KiB", kind, conns, n]
            if what == "added":
                return (r["p50"] - d["p50"]) / max(g["p50"] - d["p50"], 1e-3)
            return r["rps"] / g["rps"]

        mine, theirs = ratio("relay"), ratio(base)
        better = mine <= theirs * 1.1 if what == "added" else mine >= theirs * 0.9
        label = {"added": "added p50", "rps": "RPS"}[what]
        out.append(f"| 1 KiB {kind.upper()} c={conns} {label} x Go, not worse than the "
                   f"baseline (10 % noise) | | {mine:.3f}x {_met(better)} | {theirs:.3f}x |")
    out.append("")


def _wsLabel(wsTrees: list, n: str):
    for label in wsTrees:
        if label.startswith("baseline") == (n == "baseline"):
            return label
    return None


def run(procs, bodies: dict, seconds: float, out: list, baseline, trees: list,
        callgrind: bool = True, turns: int = 30) -> None:
    """
    Everything above; appends to C{out}.
    """
    results, idle, names = http(procs, bodies, seconds, baseline)
    wsTrees = [(label, tree, baseline[2] if baseline and tree == baseline[0] else None)
               for label, tree in trees]
    try:
        import websockets  # noqa: F401
        ws = websocket(procs, wsTrees)
    except ImportError:
        ws = {}
        out.append("(the WebSocket session needs `pip install websockets`; skipped)\n")
    procs.stopAll()
    cg = []
    if callgrind:
        import turncost

        costs = turncost.run(procs, trees, ["codex", "floor-codex"], turns, bodies)
        turncost.codexReport(costs, trees, turns, cg)
    report(results, idle, names, ws, [t[0] for t in wsTrees], cg, out, seconds)
