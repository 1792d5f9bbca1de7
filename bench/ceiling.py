"""
How far relay's records are from the 256 KiB target of issue 38, in one run:
the Go row, the Twisted floor, relay, and relay with its records switched off
(C{bench/stripped/}), c=32 JSON with Codex-shaped bodies, each target pinned
to CPU 0 and wrk and the upstream to CPU 1 as in C{bench/compare.py}.

  python bench/ceiling.py                        # 1 KiB and 256 KiB, 5 s, 3 rounds
  python bench/ceiling.py --sizes 262144 1048576 --seconds 5 --rounds 3
  python bench/ceiling.py --out bench/results/ceiling.md

The rounds interleave the targets (Go, floor, relay, stripped relay, ...), and
the report gives each figure's median. CPU per turn is the process's (all its
threads), split into user and system time. Not a test and not run by CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import codexbench  # noqa: E402
import codexbody  # noqa: E402
import compare  # noqa: E402

STRIPPED = os.path.join(HERE, "stripped")
"""Put after relay's tree on C{PYTHONPATH}: relay with its records off."""

TARGET = 0.35
"""Issue 38: 256 KiB c=32 RPS at least this times the Go row's."""


def _times(pid: int) -> tuple:
    """
    User and system CPU seconds of process C{pid}, all its threads.
    """
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _start(procs, name: str, uport: int) -> tuple:
    """
    One target on CPU 0. @return: C{(pid, port)}.
    """
    if name == "go":
        p, port = compare.startGo(procs, compare.buildGo(procs.tmp), uport, cpu=0)
    elif name == "floor":
        p, port = compare.startFloor(procs, uport, cpu=0)
    else:
        stage = {"relay": None, "relay, records off": "1",
                 "relay, records and owners off": "2"}[name]
        tree = compare.ROOT if stage is None else compare.ROOT + os.pathsep + STRIPPED
        old = os.environ.pop("RELAY_STRIPPED", None)
        if stage is not None:
            os.environ["RELAY_STRIPPED"] = stage
        label = name.replace(",", "").replace(" ", "-")
        try:
            p, port = compare.startRelay(procs, label, uport, cpu=0, tree=tree)
        finally:
            os.environ.pop("RELAY_STRIPPED", None)
            if old is not None:
                os.environ["RELAY_STRIPPED"] = old
        if stage is not None:
            # every record switched off, or no row at all (a renamed method
            # would leave a row measured with its records and the import hook)
            with open(os.path.join(procs.tmp, label + ".log")) as log:
                if f"records off (stage {stage})" not in log.read():
                    raise SystemExit(f"bench/stripped did not switch {name}'s records off: "
                                     f"see {os.path.join(procs.tmp, label + '.log')}")
    return p.pid, port


NAMES = ["go", "floor", "relay", "relay, records off", "relay, records and owners off"]


def measure(sizes: list, seconds: float, rounds: int) -> dict:
    """
    @return: C{{(name, size): [(rps, user ms, system ms), ...]}}, a tuple a round.
    """
    tmp = tempfile.mkdtemp(prefix="relay-ceiling-")
    procs = compare.Procs(tmp)
    results: dict = {}
    try:
        bodies = compare.fetchBodies(procs)
        _, uport = compare.startUpstream(procs, bodies, cpu=1)
        targets = [(name,) + _start(procs, name, uport) for name in NAMES]
        time.sleep(2)
        for size in sizes:
            script = codexbench.luaScript(tmp, f"ceiling-{size}", codexbody.body(size), None)
            for name, pid, port in targets:
                compare.wrk(tmp, "json", port, 4, 1, cpu=1, script=script)  # warm-up
            for _ in range(rounds):
                for name, pid, port in targets:
                    before = _times(pid)
                    r = compare.wrk(tmp, "json", port, 32, seconds, cpu=1, script=script)
                    after = _times(pid)
                    turns = max(r["requests"], 1)
                    results.setdefault((name, size), []).append(
                        (r["rps"], (after[0] - before[0]) * 1000 / turns,
                         (after[1] - before[1]) * 1000 / turns))
    finally:
        procs.stopAll()
    return results


def _size(n: int) -> str:
    return f"{n // 1024} KiB" if n < 2**20 else f"{n // 2**20} MiB"


def report(results: dict, sizes: list, seconds: float, rounds: int) -> list:
    out = [f"c=32 JSON, Codex-shaped bodies (`bench/codexbody.py`), {seconds:g} s a run, "
           f"{rounds} rounds interleaved; medians. CPU per turn is the process's "
           "(all threads): the median of user + system, then each one's median.\n",
           "| body | target | RPS | x Go | CPU per turn ms (user + system) |",
           "|---|---|---:|---:|---:|"]
    for size in sizes:
        go = statistics.median(r[0] for r in results["go", size])
        for name in NAMES:
            rows = results[name, size]
            rps = statistics.median(r[0] for r in rows)
            cpu = statistics.median(r[1] + r[2] for r in rows)
            user = statistics.median(r[1] for r in rows)
            system = statistics.median(r[2] for r in rows)
            out.append(f"| {_size(size)} | {name} | {rps:,.0f} | {rps / go:.3f}x | "
                       f"{cpu:.3f} ({user:.3f} + {system:.3f}) |")
    if 256 * 1024 in sizes:
        size = 256 * 1024
        go = statistics.median(r[0] for r in results["go", size])
        budget = 1000 / (TARGET * go)
        out.append("")
        out.append(f"At 256 KiB, {TARGET}x Go is {TARGET * go:,.0f} RPS: one core's "
                   f"{budget:.3f} ms per turn, everything included.")
        for name in NAMES[1:]:
            rows = results[name, size]
            cpu = statistics.median(r[1] + r[2] for r in rows)
            out.append(f"- {name}: {cpu:.3f} ms per turn, {cpu / budget:.2f}x that budget.")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 256 * 1024])
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    compare._raiseFiles()
    commit = subprocess.run(["git", "-C", compare.ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    head = [f"# relay's records and the 256 KiB target: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"Command: `python bench/ceiling.py {' '.join(sys.argv[1:])}`; relay {commit}; "
            f"Python {sys.version.split()[0]}; load average before: {os.getloadavg()[0]:.2f}.",
            ""]
    results = measure(args.sizes, args.seconds, args.rounds)
    text = "\n".join(head + report(results, args.sizes, args.seconds, args.rounds)) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
