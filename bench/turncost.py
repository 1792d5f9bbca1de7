"""
Deterministic cost of one relayed turn (issue 24): instructions per turn
under callgrind, and the Redis commands a turn sends.

  python bench/turncost.py                       # this tree, every scenario
  python bench/turncost.py --baseline main       # also main (git archive of
                                                 # the ref), same run
  python bench/turncost.py --only state --turns 100
  python bench/compare.py --only turncost ...    # the same, from compare.py

Wall-clock figures on a shared two-core box move by 30 % between runs;
instruction counts do not (they do not depend on the load of the box), so
the optimisations of issues 16 and 24 are chosen on these.

How a figure is taken: relay runs under C{valgrind --tool=callgrind
--instr-atstart=no} (so it runs at near native speed until measured), in
front of the bench's nginx upstream (C{compare.startUpstream}). One client
sends 30 warm-up turns on one keep-alive connection, then
C{callgrind_control -i on}, C{--turns} sequential turns, C{-i off}, and
C{callgrind_control -d}; the dump's C{totals:} divided by the turns is the
figure. Only relay's process is counted (not the upstream, the client or
redis-server).

Scenarios (each one relay process, so its caches are warm for its own
kind of turn):

  - C{kinds}: memory state, one account, unlimited slots (the shape of
    issue 16's counts): JSON C{POST /v1/responses}, the 40-event stream,
    chat completion;
  - C{state}: memory vs Redis state (a real C{redis-server}), one account,
    key and account C{concurrency: 64} so every turn takes both slots (an
    admitted turn); JSON, stream, chat; for Redis also the commands per
    turn (C{MONITOR}: round trips the relay sent, script-internal commands
    not counted);
  - C{load}: the same memory vs Redis comparison with the turns on 32
    connections at once (16 for the stream): the work per turn at load,
    where concurrent turns share reactor wake-ups and Redis batches;
  - C{pool}: 1, 100 and 2,000 identical healthy accounts, memory and Redis
    state, JSON: the sticky-session path the bench's repeated body takes,
    and a new session each turn (the load-balance layer).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compare  # noqa: E402, I001

ROOT = compare.ROOT
LIMITS = 64
STEADY = False
"""Issue 24 (C{--steady}): new-session turns are warmed up on every account
of the pool first, so the count is of the steady state (an account's first
turn creates its metrics children, a one-time cost)."""

KINDS = {
    "json": ("/v1/responses", {"model": "gpt-5.5", "input": "hi"}, {}),
    "sse": ("/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True},
            {"Accept": "text/event-stream"}),
    "chat": ("/v1/chat/completions",
             {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}]}, {}),
}
KINDS["new"] = KINDS["json"]
"""A JSON turn of a new session each time (a C{session_id} header of its
own): the load-balance layer picks its account (issue 24's pool scenario
beside the sticky one)."""
import codexbody  # noqa: E402

KINDS["codex"] = ("/v1/responses", codexbody.body(1024 * 1024), {})
"""Issue 38: a 1 MiB Codex-shaped JSON turn (C{bench/codexbody.py}; its
bytes as Codex sends them)."""
LABELS = {"json": "JSON", "sse": "stream (40 events)", "chat": "chat",
          "new": "JSON, new session each turn", "codex": "Codex-shaped JSON, 1 MiB"}


def exportTree(ref: str, tmp: str) -> tuple:
    """
    A relay source tree for C{ref}: the directory itself when C{ref} is
    one, else C{git archive ref} of this repository unpacked under C{tmp}.

    @return: C{(path, short commit or "")}.
    """
    if os.path.isdir(ref):
        commit = subprocess.run(["git", "-C", ref, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip()
        return ref, commit
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", ref],
                            capture_output=True, text=True, check=True).stdout.strip()
    path = os.path.join(tmp, "baseline-" + commit)
    os.makedirs(path, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
    return path, commit


def relayYaml(path: str, port: int, upstreamPort: int, accounts: int, limit: int,
              extra: str = "") -> None:
    """
    A relay config with C{accounts} identical API-key accounts on the
    upstream, key and account concurrency C{limit} (0: unlimited).
    """
    base = f"http://127.0.0.1:{upstreamPort}/v1"
    rows = [{"id": f"a{i}", "type": "apikey", "base_url": base, "api_key": "sk-upstream-bench",
             "concurrency": limit} for i in range(1, accounts + 1)]
    with open(path, "w") as f:
        f.write(f'listen: "tcp:{port}:interface=127.0.0.1"\n'
                f"keys: [{{name: bench, key: {compare.RELAY_KEY}, concurrency: {limit}}}]\n"
                f"accounts: {json.dumps(rows)}\n" + extra)


class Client:
    """
    Turns on C{concurrency} keep-alive connections, each sequential (one
    thread per connection).
    """

    def __init__(self, port: int, concurrency: int = 1):
        self.conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=900)
                      for _ in range(concurrency)]
        self.sessions = 0

    def turns(self, kind: str, n: int) -> None:
        """
        C{n} turns in all, spread over the connections.
        """
        path, body, headers = KINDS[kind]
        data = body if isinstance(body, bytes) else json.dumps(body)
        headers = dict(headers, **{"Authorization": f"Bearer {compare.RELAY_KEY}",
                                   "Content-Type": "application/json"})
        errors = []
        fresh = kind == "new"

        def run(conn, count):
            try:
                for _ in range(count):
                    if fresh:
                        self.sessions += 1
                        headers["session_id"] = f"bench-{id(self)}-{self.sessions}"
                    conn.request("POST", path, data, headers)
                    r = conn.getresponse()
                    payload = r.read()
                    if r.status != 200:
                        raise RuntimeError(f"turn failed: {r.status} {payload[:300]!r}")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        share = [n // len(self.conns) + (1 if i < n % len(self.conns) else 0)
                 for i in range(len(self.conns))]
        if len(self.conns) == 1:
            run(self.conns[0], n)
        else:
            threads = [threading.Thread(target=run, args=(c, k)) for c, k in zip(self.conns, share)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise SystemExit(str(errors[0]))

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


class Monitor:
    """
    C{redis-cli MONITOR} in a thread: the commands clients sent (not the
    ones scripts ran), by name, while L{counting}.
    """

    def __init__(self, port: int):
        self.proc = subprocess.Popen(["redis-cli", "-p", str(port), "MONITOR"],
                                     stdout=subprocess.PIPE, text=True)
        self.counting = False
        self.counts = collections.Counter()
        self.lines = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    _line = re.compile(r'^[\d.]+ \[\d+ ([^\]]+)\] "([^"]+)"(?: "([^"]*)")?')

    def _read(self) -> None:
        for line in self.proc.stdout:
            m = self._line.match(line)
            if not m or not self.counting or m.group(1) == "lua":
                continue
            name = m.group(2).upper()
            if name in ("EVAL", "EVALSHA"):
                name += " " + self._script(line)
            elif m.group(3):
                name += " " + m.group(3).split(":")[0]
            self.counts[name] += 1
            self.lines.append(line)

    @staticmethod
    def _script(line: str) -> str:
        """
        A short name for the script an EVAL/EVALSHA line runs: its first
        key's prefix.
        """
        parts = re.findall(r'"((?:[^"\\]|\\.)*)"', line)
        try:
            nkeys = int(parts[2])
        except (IndexError, ValueError):
            return "?"
        return ("(" + parts[3].split(":")[0] + ")") if nkeys else "(no keys)"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


SETTLE_WAIT_SECONDS = 4.0
"""How long L{measureRelay} waits after relay is ready before its first
warm-up: past C{relay.tap.SETTLE_AFTER_SECONDS} (2 s) with room for
valgrind's slowness."""


def _valgrindRelay(procs, name: str, tree: str, config: str, port: int):
    out = os.path.join(procs.tmp, name + ".cg")
    p = procs.start(name, ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                           f"--callgrind-out-file={out}", sys.executable, "-m", "twisted",
                           "relay", "--config", config],
                    env=dict(os.environ, PYTHONPATH=tree))
    compare.waitReady(port, timeout=300)
    return p, out


def _control(pid: int, *args) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], capture_output=True, check=True,
                   timeout=600)


KEEP = None
"""A directory the callgrind dumps are copied to before they are counted
(C{--keep}), for C{callgrind_annotate}."""


def _totals(out: str) -> int:
    total = 0
    for path in [p for p in os.listdir(os.path.dirname(out))
                 if p.startswith(os.path.basename(out))]:
        with open(os.path.join(os.path.dirname(out), path)) as f:
            for line in f:
                if line.startswith("totals:"):
                    total += int(line.split()[1])
        if KEEP:
            shutil.copy(os.path.join(os.path.dirname(out), path), KEEP)
        os.remove(os.path.join(os.path.dirname(out), path))
    return total


def measureFloor(procs, upstreamPort: int, turns: int, kinds=("json", "sse", "chat")) -> dict:
    """
    The Twisted floor (C{bench/twistedfloor.py}: the Go row's work on the
    reactor and httptools, nothing of relay's) under callgrind, the same
    turns as L{measureRelay}: what CPython and the reactor cost per
    request before anything relay does.

    @return: kind -> C{{"instr": per request}}.
    """
    port = compare.free()
    out = os.path.join(procs.tmp, "floor.cg")
    p = procs.start("cg-floor", ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                 f"--callgrind-out-file={out}", sys.executable,
                                 compare.FLOOR_SOURCE, str(port), str(upstreamPort),
                                 compare.RELAY_KEY, compare.GO_UPSTREAM_KEY])
    compare.waitPort(port, timeout=300)
    client = Client(port)
    results = {}
    try:
        for kind in kinds:
            client.turns(kind, 30)
            _control(p.pid, "--zero")
            _control(p.pid, "-i", "on")
            client.turns(kind, turns)
            _control(p.pid, "-i", "off")
            _control(p.pid, "-d")
            time.sleep(0.5)
            results[kind] = {"instr": _totals(out) / turns}
    finally:
        client.close()
        procs.stop(p)
    return results


def measureRelay(procs, name: str, tree: str, upstreamPort: int, accounts: int, limit: int,
                 kinds, turns: int, redisPort=None, concurrency: int = 1) -> dict:
    """
    One relay process under callgrind; instructions per turn of each kind,
    and (with C{redisPort}) the Redis commands per turn. With
    C{concurrency} > 1 the turns come on that many connections at once
    (relay under callgrind is the bottleneck, so its queues stay full: the
    per-turn work at load, e.g. Redis batches shared by several turns).

    @return: kind -> C{{"instr": per turn, "redis": {command: per turn}}}.
    """
    port = compare.free()
    extra = ""
    if redisPort:
        subprocess.run(["redis-cli", "-p", str(redisPort), "FLUSHALL"], capture_output=True,
                       check=True)
        extra = f"state: {{backend: redis, redis_url: 'redis://127.0.0.1:{redisPort}/0'}}\n"
    config = os.path.join(procs.tmp, name + ".yaml")
    relayYaml(config, port, upstreamPort, accounts, limit, extra)
    p, out = _valgrindRelay(procs, name, tree, config, port)
    pid = p.pid
    client = Client(port, concurrency)
    results = {}
    try:
        # relay.tap.SettleMemory runs once, SETTLE_AFTER_SECONDS (2 s) after
        # start: a full collection of the start-up heap (~29 M instructions,
        # ~150 K per turn over 200 turns) that must not land inside a
        # measured window, and (settleProcess) the collector's steady-state
        # settings the turns should be measured with.
        time.sleep(SETTLE_WAIT_SECONDS)
        for kind in kinds:
            client.turns(kind, accounts + 30 if STEADY and kind == "new" else 30)
            monitor = Monitor(redisPort) if redisPort else None
            if monitor:
                time.sleep(0.3)
                monitor.counting = True
            _control(pid, "--zero")
            _control(pid, "-i", "on")
            client.turns(kind, turns)
            _control(pid, "-i", "off")
            if monitor:
                time.sleep(0.3)
                monitor.counting = False
                monitor.stop()
            _control(pid, "-d")
            time.sleep(0.5)
            results[kind] = {"instr": _totals(out) / turns}
            if monitor:
                results[kind]["redis"] = {k: v / turns for k, v in monitor.counts.items()}
    finally:
        client.close()
        procs.stop(p)
    return results


def run(procs, trees: list, only, turns: int, bodies=None) -> dict:
    """
    Every scenario for every C{(label, path)} tree.

    @return: C{(scenario, tree label, state, accounts, kind)} -> result.
    """
    bodies = bodies or compare.fetchBodies(procs)
    upstream, uport = compare.startUpstream(procs, bodies, cpu=None)
    redisPort = compare.free()
    redis = procs.start("redis-cg", ["redis-server", "--port", str(redisPort), "--bind",
                                     "127.0.0.1", "--save", "", "--appendonly", "no"])
    compare.waitPort(redisPort)
    results = {}
    try:
        if "floor" in only:
            for kind, r in measureFloor(procs, uport, turns).items():
                results["floor", "Twisted floor", "memory", 1, kind] = r
        if "floor-codex" in only:
            for kind, r in measureFloor(procs, uport, turns, ["codex"]).items():
                results["floor", "Twisted floor", "memory", 1, kind] = r
        for label, tree in trees:
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)  # a file name (a tree given by path)
            if "kinds" in only:
                for kind, r in measureRelay(procs, f"cg-{name}-kinds", tree, uport, 1, 0,
                                            list(KINDS), turns).items():
                    results["kinds", label, "memory", 1, kind] = r
            if "codex" in only:
                for kind, r in measureRelay(procs, f"cg-{name}-codex", tree, uport, 1, 0,
                                            ["codex"], turns).items():
                    results["codex", label, "memory", 1, kind] = r
            if "state" in only:
                for state, rport in (("memory", None), ("redis", redisPort)):
                    for kind, r in measureRelay(procs, f"cg-{name}-{state}", tree, uport, 1,
                                                LIMITS, list(KINDS), turns, rport).items():
                        results["state", label, state, 1, kind] = r
            if "load" in only:
                for state, rport in (("memory", None), ("redis", redisPort)):
                    for kind, conns in (("json", 32), ("sse", 16)):
                        for attempt in (1, 2):
                            # Under callgrind a loaded relay is ~50x slower; a turn
                            # that hits one of its own timeouts fails the run, which
                            # is then measured once more (and says so).
                            try:
                                r = measureRelay(procs, f"cg-{name}-{state}-c{conns}", tree,
                                                 uport, 1, LIMITS, [kind], max(turns, 10 * conns),
                                                 rport, concurrency=conns)
                                break
                            except SystemExit as e:
                                if attempt == 2:
                                    raise
                                print(f"(load {label} {state} {kind}: {e}; measuring again)",
                                      file=sys.stderr)
                        results["load", label, state, conns, kind] = r[kind]
            if "pool" in only:
                for state, rport in (("memory", None), ("redis", redisPort)):
                    for n in (1, 100, 2000):
                        count = turns if n < 2000 else max(20, turns // 5)
                        r = measureRelay(procs, f"cg-{name}-{state}-{n}", tree, uport, n,
                                         LIMITS, ["json", "new"], count, rport)
                        for kind in ("json", "new"):
                            results["pool", label, state, n, kind] = r[kind]
    finally:
        procs.stop(redis)
        procs.stop(upstream)
    return results


def _m(x: float) -> str:
    return f"{x / 1e6:.3f} M"


def _redisSummary(counts: dict) -> str:
    total = sum(counts.values())
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])
                      if v >= 0.05)
    return f"**{total:.2f}** ({parts})"


def codexReport(results: dict, trees: list, turns: int, out: list) -> None:
    """
    Issue 38: instructions per 1 MiB Codex turn, relay (each tree) beside
    the Twisted floor.
    """
    out.append("### Instructions per 1 MiB Codex turn (callgrind)\n")
    out.append(f"{turns} sequential JSON turns of the 1 MiB `bench/codexbody.py` body, after 30 "
               "warm-up turns; relay's process only (memory state, one account).\n")
    out.append("| process | instructions per turn | vs the Twisted floor |")
    out.append("|---|---:|---:|")
    floor = results.get(("floor", "Twisted floor", "memory", 1, "codex"))
    if floor:
        out.append(f"| Twisted floor | {_m(floor['instr'])} | 1.0x |")
    for label, _ in trees:
        r = results.get(("codex", label, "memory", 1, "codex"))
        if r:
            ratio = f"{r['instr'] / floor['instr']:.1f}x" if floor else ""
            out.append(f"| relay, {label} | {_m(r['instr'])} | {ratio} |")
    out.append("")


def report(results: dict, trees: list, turns: int, out: list) -> None:
    """
    Markdown tables of L{run}'s results.
    """
    labels = [label for label, _ in trees]
    two = len(labels) == 2
    head = " | ".join(labels) + (f" | {labels[1]} / {labels[0]}" if two else "")

    def row(name, key):
        vals = [results.get(key(label)) for label in labels]
        if any(v is None for v in vals):
            return
        cells = " | ".join(_m(v["instr"]) for v in vals)
        ratio = f" | **{vals[1]['instr'] / vals[0]['instr']:.2f}x**" if two else ""
        out.append(f"| {name} | {cells}{ratio} |")

    out.append(f"## Instructions per turn (callgrind, {turns} sequential turns after 30 "
               "warm-up, relay's process only)\n")
    floor = {k[4]: v for k, v in results.items() if k[0] == "floor"}
    if floor:
        out.append("The Twisted floor (`bench/twistedfloor.py`: check the key, swap the "
                   "credential, pass the upstream's bytes through, on the reactor and httptools; "
                   "nothing of relay's), per request, beside relay's memory turn of the same "
                   "kind (unlimited slots):\n")
        out.append("| turn | Twisted floor | " + " | ".join(labels) + " | "
                   + " | ".join(f"{label} / floor" for label in labels) + " |")
        out.append("|---|---:|" + "---:|" * (2 * len(labels)))
        for kind in ("json", "sse", "chat"):
            if kind not in floor:
                continue
            vals = [results.get(("kinds", label, "memory", 1, kind)) for label in labels]
            cells = " | ".join(_m(v["instr"]) if v else "-" for v in vals)
            ratios = " | ".join(f"{v['instr'] / floor[kind]['instr']:.1f}x" if v else "-"
                                for v in vals)
            out.append(f"| {LABELS[kind]} | {_m(floor[kind]['instr'])} | {cells} | {ratios} |")
        out.append("")
    if any(k[0] == "kinds" for k in results):
        out.append("Memory state, one account, unlimited slots (issue 16's shape).\n")
        out.append(f"| turn | {head} |")
        out.append("|---|" + "---:|" * (len(labels) + two))
        for kind in KINDS:
            row(LABELS[kind], lambda label, kind=kind: ("kinds", label, "memory", 1, kind))
        out.append("")
    if any(k[0] == "state" for k in results):
        out.append(f"Memory vs Redis state, one account, key and account concurrency {LIMITS} "
                   "(both slots taken every turn).\n")
        out.append(f"| turn | {head} |")
        out.append("|---|" + "---:|" * (len(labels) + two))
        for kind in KINDS:
            for state in ("memory", "redis"):
                row(f"{LABELS[kind]}, {state}",
                    lambda label, kind=kind, state=state: ("state", label, state, 1, kind))
        for label in labels:
            for kind in KINDS:
                m = results.get(("state", label, "memory", 1, kind))
                r = results.get(("state", label, "redis", 1, kind))
                if m and r:
                    out.append(f"| {LABELS[kind]}: redis / memory ({label}) | "
                               f"**{r['instr'] / m['instr']:.2f}x** |" + " |" * (len(labels) + two - 1))
        out.append("")
        out.append("Redis commands sent per admitted turn (`MONITOR`; a script call counts once; "
                   "background work such as heartbeats and usage flushes is included when it "
                   "fell in the window):\n")
        out.append("| turn | tree | commands per turn (by command and first key) |")
        out.append("|---|---|---|")
        for kind in KINDS:
            for label in labels:
                r = results.get(("state", label, "redis", 1, kind))
                if r and "redis" in r:
                    out.append(f"| {LABELS[kind]} | {label} | {_redisSummary(r['redis'])} |")
        out.append("")
    if any(k[0] == "load" for k in results):
        out.append(f"At load: JSON on 32 connections, the stream on 16 (relay under callgrind is "
                   f"the bottleneck, so work shared by concurrent turns, such as a Redis batch, is "
                   f"counted as at load); concurrency {LIMITS}.\n")
        out.append(f"| turn | {head} |")
        out.append("|---|" + "---:|" * (len(labels) + two))
        for kind, conns in (("json", 32), ("sse", 16)):
            for state in ("memory", "redis"):
                row(f"{LABELS[kind]} c={conns}, {state}",
                    lambda label, kind=kind, state=state, conns=conns:
                    ("load", label, state, conns, kind))
        for label in labels:
            for kind, conns in (("json", 32), ("sse", 16)):
                m = results.get(("load", label, "memory", conns, kind))
                r = results.get(("load", label, "redis", conns, kind))
                if m and r:
                    out.append(f"| {LABELS[kind]} c={conns}: redis / memory ({label}) | "
                               f"**{r['instr'] / m['instr']:.2f}x** |" + " |" * (len(labels) + two - 1))
        out.append("")
        out.append("| turn | tree | Redis commands per turn at load |")
        out.append("|---|---|---|")
        for kind, conns in (("json", 32), ("sse", 16)):
            for label in labels:
                r = results.get(("load", label, "redis", conns, kind))
                if r and "redis" in r:
                    out.append(f"| {LABELS[kind]} c={conns} | {label} | {_redisSummary(r['redis'])} |")
        out.append("")
    if any(k[0] == "pool" for k in results):
        out.append(f"Pool size: identical healthy accounts, concurrency {LIMITS}; JSON turns of "
                   "one session (the sticky path) and of a new session each (the load-balance "
                   "layer).\n")
        out.append(f"| accounts, state, turn | {head} | vs 1 account |")
        out.append("|---|" + "---:|" * (len(labels) + two) + "---:|")
        for kind in ("json", "new"):
            for state in ("memory", "redis"):
                for n in (1, 100, 2000):
                    vals = [results.get(("pool", label, state, n, kind)) for label in labels]
                    if any(v is None for v in vals):
                        continue
                    ones = [results.get(("pool", label, state, 1, kind)) for label in labels]
                    cells = " | ".join(_m(v["instr"]) for v in vals)
                    ratio = f" | **{vals[1]['instr'] / vals[0]['instr']:.2f}x**" if two else ""
                    vs1 = " / ".join(f"{v['instr'] / o['instr']:.2f}x"
                                     for v, o in zip(vals, ones))
                    name = "sticky" if kind == "json" else "new session"
                    out.append(f"| {n:,}, {state}, {name} | {cells}{ratio} | {vs1} |")
        out.append("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git ref or a source tree measured beside this one")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--only", action="append",
                        choices=["floor", "floor-codex", "kinds", "codex", "state", "load", "pool"])
    parser.add_argument("--keep", help="copy the callgrind dumps to this directory")
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--steady", action="store_true",
                        help="warm new-session turns up on every account first (slow at 2,000)")
    args = parser.parse_args()
    if args.keep:
        global KEEP
        KEEP = args.keep
        os.makedirs(KEEP, exist_ok=True)
    if args.steady:
        global STEADY
        STEADY = True
    for tool in ("valgrind", "callgrind_control", "nginx", "redis-server", "redis-cli"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install valgrind nginx "
                             "redis-server)")
    compare._raiseFiles()
    tmp = tempfile.mkdtemp(prefix="relay-turncost-")
    procs = compare.Procs(tmp)
    try:
        trees = []
        if args.baseline:
            path, commit = exportTree(args.baseline, tmp)
            trees.append((f"baseline {commit or args.baseline}", path))
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "relay"],
                               capture_output=True, text=True, check=False).stdout.strip()
        trees.append((f"this tree {head}{'+' if dirty else ''}", ROOT))
        only = args.only or ["floor", "kinds", "state", "load", "pool"]
        results = run(procs, trees, only, args.turns)
    finally:
        procs.stopAll()
        shutil.rmtree(tmp, ignore_errors=True)
    out = [f"Command: `python bench/turncost.py {' '.join(sys.argv[1:])}`; "
           f"Python {sys.version.split()[0]}; load average {os.getloadavg()[0]:.2f} "
           "(instruction counts do not depend on it).\n"]
    report(results, trees, args.turns, out)
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
