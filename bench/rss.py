"""
Where one relay process's resident memory goes (issue 24: RSS at c=128
JSON <= 64 MiB).

  python bench/rss.py                       # this tree
  python bench/rss.py --baseline 64fc651    # also a git ref (git archive)
                                            # or another tree, same run
  python bench/rss.py --seconds 5 --no-breakdown

Not a test and not run by CI. relay starts as C{compare.startRelay} starts
it (the bench config: memory state, one API-key account, the nginx
upstream of C{compare.startUpstream}), pinned to CPU 0, wrk and the
upstream on CPU 1. Figures per tree:

  - VmRSS once C{/readyz} answers (start-up), after compare's warm-up
    (JSON c=8, stream c=4, chat c=4, 1 s each), the highest VmRSS sampled
    every 0.1 s during C{--seconds} of wrk c=128 JSON, and VmHWM at the end;
  - from inside the process at the end (a C{SIGUSR2} handler this script
    installs before it runs C{python -m twisted relay}): C{sys.modules}
    count (per top-level package), threads, glibc's malloc arenas
    (C{malloc_info}), C{gc} object counts;
  - C{/proc/PID/smaps}: RSS anonymous vs file-backed, the largest mappings
    (shared libraries such as libcrypto count in RSS);
  - a second process of the same tree under C{-X tracemalloc=1
    -X importtime}, same load (C{--no-breakdown} skips it): the Python
    heap by package at steady state and the slowest imports.
"""

from __future__ import annotations

import os
import signal
import sys

# -- inside the relay process (imports nothing that relay would not) ----------------


def _package(filename: str) -> str:
    """
    A dotted package name for a source file (two levels: C{twisted.web},
    C{relay.entry}), or the file's base name.
    """
    import re

    parts = filename.replace("\\", "/").split("/")
    for top in ("site-packages", "dist-packages"):
        if top in parts:
            rest = parts[parts.index(top) + 1:]
            break
    else:
        if "relay" in parts:
            rest = parts[len(parts) - 1 - parts[::-1].index("relay"):]
        elif re.search(r"/python3\.\d+/", filename):
            rest = ["stdlib:" + (parts[-2] if not parts[-2].startswith("python3") else parts[-1])]
        else:
            rest = parts[-1:]
    rest = [p[:-3] if p.endswith(".py") else p for p in rest]
    if len(rest) > 2 and rest[0] in ("relay", "twisted"):
        return ".".join(rest[:2])
    return rest[0]


def _rssNow() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


_previous = []


def _dump(path: str) -> None:
    """
    Write what the process knows of its own memory to C{path} (JSON).
    """
    import collections
    import ctypes
    import gc
    import json
    import re
    import threading

    out = {}
    mods = collections.Counter(name.split(".")[0] for name in list(sys.modules))
    out["modules"] = len(sys.modules)
    out["blocks"] = sys.getallocatedblocks()
    out["modulesByTop"] = mods.most_common(25)
    out["moduleNames"] = list(sys.modules)
    out["threads"] = [t.name for t in threading.enumerate()]
    out["types"] = collections.Counter(
        f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects()).most_common(60)
    out["gc"] = {"objects": len(gc.get_objects()), "counts": gc.get_count(),
                 "frozen": gc.get_freeze_count()}
    libc = ctypes.CDLL("libc.so.6")
    try:
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        fp = libc.fopen((path + ".malloc").encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        with open(path + ".malloc") as f:
            xml = f.read()
        heaps = re.findall(r'<heap nr="(\d+)">.*?<system type="current" size="(\d+)"/>', xml, re.S)
        out["arenas"] = [(int(n), int(size)) for n, size in heaps]
    except OSError as e:
        out["arenas"] = str(e)
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
        out["mallinfo"] = {"heap": info.arena, "mmapped": info.hblkhd, "used": info.uordblks,
                           "free": info.fordblks}
    except (OSError, AttributeError) as e:
        out["mallinfo"] = str(e)
    import tracemalloc

    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        byPackage = collections.Counter()
        for stat in snap.statistics("filename"):
            byPackage[_package(stat.traceback[0].filename)] += stat.size
        out["traced"] = tracemalloc.get_traced_memory()
        out["tracedByPackage"] = byPackage.most_common(30)
        out["tracedTopLines"] = [(str(s.traceback[0]), s.size, s.count)
                                 for s in snap.statistics("lineno")[:15]]
        # Allocations not made while importing, by the innermost relay frame
        # (needs -X tracemalloc=N, N frames deep).
        runtime = collections.Counter()
        imported = 0
        for trace in snap.traces:
            frames = trace.traceback
            if any(f.filename.startswith("<frozen importlib") for f in frames):
                imported += trace.size
                continue
            where = next((f"{f.filename.split('/relay/', 1)[-1]}:{f.lineno}" for f in frames
                          if "/relay/" in f.filename and "/bench/" not in f.filename),
                         f"{_package(frames[0].filename)}")
            runtime[where] += trace.size
        out["tracedImported"] = imported
        out["tracedRuntime"] = runtime.most_common(25)
        if _previous:
            out["tracedGrowth"] = [(str(s.traceback[0]), s.size_diff, s.count_diff)
                                   for s in snap.compare_to(_previous[0], "lineno")[:15]]
        _previous[:] = [snap]
    # What the process could give back: a full collection, then malloc_trim.
    out["rss"] = [_rssNow()]
    gc.collect()
    out["rss"].append(_rssNow())
    try:
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
    out["rss"].append(_rssNow())
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.rename(path + ".tmp", path)


def inside(dumpPath: str, argv: list) -> None:
    """
    Run C{python -m twisted ARGV} with a C{SIGUSR2} handler that writes
    L{_dump} to C{dumpPath}. Twisted's reactor wakes on a signal
    (C{signal.set_wakeup_fd}), so the handler runs promptly on the main
    thread.
    """
    import runpy

    sys.path[0] = os.getcwd()  # as python -m twisted has it, not bench/
    signal.signal(signal.SIGUSR2, lambda *_: _dump(dumpPath))
    sys.argv = ["twisted"] + argv
    runpy.run_module("twisted", run_name="__main__", alter_sys=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--inside"]:
    inside(sys.argv[2], sys.argv[3:])
    sys.exit(0)

import argparse
import collections
import json
import re
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare

# -- outside --------------------------------------------------------------------


def smaps(pid: int) -> dict:
    """
    RSS by kind and by mapping from C{/proc/PID/smaps} (KiB).
    """
    byName = collections.Counter()
    kinds = collections.Counter()
    name = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split()
                name = fields[5] if len(fields) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                kb = int(line.split()[1])
                byName[os.path.basename(name) if name.startswith("/") else name] += kb
            elif line.startswith(("Anonymous:", "Shared_Clean:", "Private_Clean:",
                                  "Shared_Dirty:", "Private_Dirty:")):
                kinds[line.split(":")[0]] += int(line.split()[1])
    with open(f"/proc/{pid}/smaps_rollup") as f:
        rollup = {line.split(":")[0]: int(line.split()[1]) for line in f
                  if line.split(":")[0] in ("Rss", "Pss", "Anonymous", "Pss_Anon", "Pss_File")}
    return {"byName": byName, "kinds": kinds, "rollup": rollup}


def threadsOf(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def startProbed(procs, name: str, upstreamPort: int, tree: str, pyflags=()) -> tuple:
    """
    relay as C{compare.startRelay} starts it, through L{inside}.
    @return: C{(process, port, dump path)}.
    """
    port = compare.free()
    conf = compare.relayConfig(procs.tmp, name, port, upstreamPort)
    dump = os.path.join(procs.tmp, name + ".dump.json")
    p = procs.start(name, [sys.executable, *pyflags, os.path.abspath(__file__), "--inside", dump,
                           "relay", "--config", conf],
                    cpu=0, env=dict(os.environ, PYTHONPATH=tree))
    compare.waitReady(port, timeout=300)
    return p, port, dump


def askDump(pid: int, dump: str) -> dict:
    if os.path.exists(dump):
        os.unlink(dump)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 900
    while not os.path.exists(dump):
        if time.monotonic() > deadline:
            raise SystemExit(f"no dump from {pid}")
        time.sleep(0.1)
    with open(dump) as f:
        return json.load(f)


def load(procs, port: int, pid: int, seconds: float, afterWarm=None) -> dict:
    """
    compare's warm-up, then wrk c=128 JSON for C{seconds}, VmRSS sampled
    every 0.1 s. @return: KiB figures.
    """
    out = {"start": compare.memory(pid)["VmRSS"]}
    compare.wrk(procs.tmp, "json", port, 8, 1, cpu=1)
    compare.wrk(procs.tmp, "sse", port, 4, 1, cpu=1)
    compare.wrk(procs.tmp, "chat", port, 4, 1, cpu=1)
    out["warm"] = compare.memory(pid)["VmRSS"]
    if afterWarm is not None:
        afterWarm()
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.1):
            try:
                peak[0] = max(peak[0], compare.memory(pid)["VmRSS"])
            except OSError:
                pass

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    r = compare.wrk(procs.tmp, "json", port, 128, seconds, cpu=1)
    done.set()
    t.join()
    out["c128"] = peak[0]
    out["hwm"] = compare.memory(pid)["VmHWM"]
    out["after"] = compare.memory(pid)["VmRSS"]
    out["rps"] = r["rps"]
    out["errors"] = r["errors"]
    out["threads"] = threadsOf(pid)
    return out


def importTimes(logPath: str, top: int = 15) -> list:
    """
    The slowest imports (cumulative us) from a C{-X importtime} log.
    """
    rows = []
    with open(logPath, errors="replace") as f:
        for line in f:
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
            if m:
                rows.append((int(m.group(2)), len(m.group(3)), m.group(4)))
    level1 = [r for r in rows if r[1] <= 3]
    return sorted(level1, reverse=True)[:top], len(rows)


#: The import layers of L{layers}, in order: each step is charged for what
#: it imports first (so a module two layers share counts in the earlier).
LAYERS = [
    ("asyncio (twisted.internet.defer imports it)", ["asyncio"]),
    ("cryptography + pyOpenSSL (twisted.internet.tcp's TLS)", ["OpenSSL.SSL", "service_identity"]),
    ("the Twisted reactor and logger", ["twisted.internet.reactor", "twisted.logger"]),
    ("twisted.web server and client", ["twisted.web.server", "twisted.web.client"]),
    ("the twist launcher and its plugin scan",
     ["twisted.application.twist._twist", "plugins:"]),
    ("autobahn (the Responses WebSocket)", ["autobahn.twisted.websocket",
                                            "autobahn.twisted.resource"]),
    ("relay's modules (and what they import first)", "relay"),
    ("the rest of the running process's modules", "rest"),
]

_LAYERS_CODE = """
import importlib, json, sys
def rss():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1])
steps, names = json.loads(sys.stdin.read())
out = [('the interpreter (site included)', rss(), len(sys.modules))]
for label, mods in steps:
    if mods == 'relay':
        mods = [n for n in names if n.startswith('relay.') or n == 'relay']
    elif mods == 'rest':
        mods = [n for n in names if n not in sys.modules]
    for m in mods:
        try:
            if m == 'plugins:':
                from twisted.application.service import IServiceMaker
                from twisted.plugin import getPlugins
                list(getPlugins(IServiceMaker))
            else:
                importlib.import_module(m)
        except Exception:
            pass
    out.append((label, rss(), len(sys.modules)))
print(json.dumps(out))
"""


def layers(tree: str, tmp: str, names: list) -> list:
    """
    The import footprint in layers (L{LAYERS}): a fresh interpreter with
    C{PYTHONPATH=tree} imports each layer in turn and notes its VmRSS;
    the last layer imports the rest of C{names} (the running relay's
    C{sys.modules}). @return: C{[(label, VmRSS KiB, modules)]}.
    """
    import subprocess

    bare = subprocess.run([sys.executable, "-S", "-c", _LAYERS_CODE.split("steps,")[0]
                           + "print(rss())"], capture_output=True, text=True, check=True,
                          cwd=tmp).stdout
    out = subprocess.run([sys.executable, "-c", _LAYERS_CODE], input=json.dumps([LAYERS, names]),
                         capture_output=True, text=True, check=True, cwd=tmp,
                         env=dict(os.environ, PYTHONPATH=tree)).stdout
    return [("the interpreter without site (-S)", int(bare), 0)] + json.loads(out)


def mib(kb) -> str:
    return f"{kb / 1024:.1f}"


def measure(procs, uport: int, label: str, tree: str, seconds: float, breakdown: bool,
            report: list) -> dict:
    name = re.sub(r"\W", "-", label)
    p, port, dump = startProbed(procs, name, uport, tree)
    fig = load(procs, port, p.pid, seconds)
    fig["dump"] = askDump(p.pid, dump)
    fig["smaps"] = smaps(p.pid)
    procs.stop(p)
    fig["layers"] = layers(tree, procs.tmp, fig["dump"]["moduleNames"])
    if breakdown:
        # Start-up only, 20 frames a trace: what was allocated while importing.
        q, qport, qdump = startProbed(procs, name + "-start", uport, tree,
                                      pyflags=("-X", "tracemalloc=20"))
        fig["tracedStart"] = askDump(q.pid, qdump)
        procs.stop(q)
        # One frame a trace, under the same load: by package, and the growth.
        q, qport, qdump = startProbed(procs, name + "-traced", uport, tree,
                                      pyflags=("-X", "tracemalloc=1", "-X", "importtime"))
        load(procs, qport, q.pid, seconds, afterWarm=lambda: askDump(q.pid, qdump))
        fig["traced"] = askDump(q.pid, qdump)
        procs.stop(q)
        fig["imports"] = importTimes(os.path.join(procs.tmp, name + "-traced.log"))
    return fig


def _short(where: str) -> str:
    """
    A source location without this machine's paths: C{twisted/web/http.py:12},
    C{relay/base/logs.py:3}, C{stdlib/typing.py:9}.
    """
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in where:
            return where.split(marker, 1)[1]
    if "/relay/" in where:
        return "relay/" + where.rsplit("/relay/", 1)[1]
    m = re.search(r"/python3\.\d+/(.*)$", where)
    return "stdlib/" + m.group(1) if m else where


def render(figs: dict, report: list) -> None:
    labels = list(figs)
    report.append("## RSS of one relay process (KiB -> MiB)\n")
    report.append("| figure | " + " | ".join(labels) + " |")
    report.append("|---|" + "---:|" * len(labels))
    rows = [("VmRSS after start-up (/readyz 200)", lambda f: mib(f["start"])),
            ("VmRSS after warm-up", lambda f: mib(f["warm"])),
            ("peak VmRSS during c=128 JSON", lambda f: f"**{mib(f['c128'])}**"),
            ("VmHWM at the end", lambda f: mib(f["hwm"])),
            ("c=128 JSON RPS (pinned; noisy)", lambda f: f"{f['rps']:,.0f}"),
            ("wrk errors", lambda f: str(f["errors"])),
            ("smaps: anonymous", lambda f: mib(f["smaps"]["kinds"]["Anonymous"])),
            ("smaps: file-backed", lambda f: mib(f["smaps"]["rollup"]["Rss"]
                                                  - f["smaps"]["kinds"]["Anonymous"])),
            ("threads", lambda f: str(f["threads"])),
            ("glibc heap: in use / free (MiB)",
             lambda f: f"{f['dump']['mallinfo']['used'] / 1048576:.1f} / "
                       f"{f['dump']['mallinfo']['free'] / 1048576:.1f}"),
            ("VmRSS at the end -> after gc.collect() -> after malloc_trim(0)",
             lambda f: " -> ".join(mib(k) for k in f["dump"]["rss"])),
            ("glibc malloc arenas (current bytes)",
             lambda f: ", ".join(f"{s / 1048576:.1f}M" for _, s in f["dump"]["arenas"])
             if isinstance(f["dump"]["arenas"], list) else f["dump"]["arenas"]),
            ("sys.modules", lambda f: str(f["dump"]["modules"])),
            ("gc objects (frozen)", lambda f: f"{f['dump']['gc']['objects']:,} "
                                              f"({f['dump']['gc']['frozen']:,})"),
            ("Python heap traced (tracemalloc run)",
             lambda f: mib(f["traced"]["traced"][0] / 1024) if "traced" in f else "-")]
    for title, get in rows:
        report.append(f"| {title} | " + " | ".join(get(figs[k]) for k in labels) + " |")
    report.append("")
    report.append("## The import footprint in layers (a fresh interpreter importing each in "
                  "turn; MiB VmRSS added, modules added)\n")
    report.append("| layer | " + " | ".join(labels) + " |")
    report.append("|---|" + "---:|" * len(labels))
    first = figs[labels[0]]["layers"]
    for i, (title, _, _) in enumerate(first):
        cells = []
        for k in labels:
            rows_ = figs[k]["layers"]
            kb, mods = rows_[i][1], rows_[i][2]
            if i <= 1:
                cells.append(f"{mib(kb)}")
            else:
                cells.append(f"+{mib(kb - rows_[i - 1][1])} (+{mods - rows_[i - 1][2]})")
        report.append(f"| {title} | " + " | ".join(cells) + " |")
    report.append("| all imported (fresh interpreter) | " + " | ".join(
        mib(figs[k]["layers"][-1][1]) for k in labels) + " |")
    report.append("| running relay after start-up, over all imported | " + " | ".join(
        f"+{mib(figs[k]['start'] - figs[k]['layers'][-1][1])}" for k in labels) + " |")
    report.append("| warm-up, then c=128 JSON (peak) | " + " | ".join(
        f"+{mib(figs[k]['warm'] - figs[k]['start'])}, +{mib(figs[k]['c128'] - figs[k]['warm'])}"
        for k in labels) + " |")
    report.append("")
    for label, f in figs.items():
        report.append(f"### {label}\n")
        report.append("Largest mappings (RSS MiB): " + ", ".join(
            f"{n} {mib(kb)}" for n, kb in f["smaps"]["byName"].most_common(12)) + "\n")
        report.append("Modules by top-level package: " + ", ".join(
            f"{n} {c}" for n, c in f["dump"]["modulesByTop"]) + "\n")
        if "traced" in f:
            report.append("Python heap by package (tracemalloc, MiB): " + ", ".join(
                f"{n} {b / 1048576:.2f}" for n, b in f["traced"]["tracedByPackage"][:20]) + "\n")
            report.append("Top lines: " + "; ".join(
                f"{_short(where)} {size / 1024:.0f} KiB" for where, size, _ in
                f["traced"]["tracedTopLines"][:8]) + "\n")
            start = f["tracedStart"]
            report.append(f"Python heap after start-up: {mib(start['traced'][0] / 1024)} MiB, of "
                          f"which allocated while importing {mib(start['tracedImported'] / 1024)}"
                          " MiB; the rest by the innermost relay frame (KiB): " + "; ".join(
                              f"{w} {b / 1024:.0f}" for w, b in start["tracedRuntime"][:20]) + "\n")
            report.append("Python heap growth from warm-up to the end of c=128 (KiB): " + "; ".join(
                f"{_short(where)} {size / 1024:+.0f}" for where, size, _ in
                f["traced"].get("tracedGrowth", [])[:10]) + "\n")
            imports, count = f["imports"]
            report.append(f"Slowest top-level imports of {count} (cumulative ms): " + ", ".join(
                f"{n} {us / 1000:.0f}" for us, _, n in imports) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--baseline", help="a git ref (git archive) or another relay tree")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the tracemalloc/importtime process")
    parser.add_argument("--out", help="also write the report (markdown) here")
    args = parser.parse_args()
    compare._raiseFiles()
    import turncost

    tmp = tempfile.mkdtemp(prefix="relay-rss-")
    procs = compare.Procs(tmp)
    commit = turncost.exportTree(compare.ROOT, tmp)[1]
    trees = []
    if args.baseline:
        path, base = turncost.exportTree(args.baseline, tmp)
        trees.append((f"baseline {base or args.baseline}", path))
    trees.append((f"this tree {commit}", compare.ROOT))
    report = [f"# relay RSS: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
              f"Command: `python bench/rss.py {' '.join(sys.argv[1:])}`; Python "
              f"{sys.version.split()[0]}; load average before: {os.getloadavg()[0]:.2f}.\n"]
    try:
        bodies = compare.fetchBodies(procs)
        upstream, uport = compare.startUpstream(procs, bodies, cpu=1)
        figs = {}
        for label, tree in trees:
            figs[label] = measure(procs, uport, label, tree, args.seconds,
                                  not args.no_breakdown, report)
        render(figs, report)
    finally:
        procs.stopAll()
        if not os.environ.get("RELAY_BENCH_KEEP"):
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"(kept {tmp})")
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
