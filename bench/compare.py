"""
relay side by side with nginx and a Go gateway's floor on one upstream, in one
run (issues 16 and 24).

  python bench/compare.py                 # everything, ~15 minutes
  python bench/compare.py --quick         # 3 s per scenario, smaller planning tests
  python bench/compare.py --only speed    # or: pool, turncost, workers, planning,
                                          # codex (issue 38: bench/codexbench.py)
  python bench/compare.py --out bench/results/compare.md
  python bench/compare.py --baseline main        # also relay at a git ref (git
                                                 # archive) or from another tree,
                                                 # in the same run
  python bench/compare.py --baseline-python /opt/py/bin/python
                                                 # the baseline relay (this tree
                                                 # unless --baseline) on another
                                                 # interpreter, in the same run

Not a test and not run by CI; it prints a markdown report (and writes it to
C{--out}). What it starts, all on 127.0.0.1:

  - the upstream: apt's nginx (1 process) answering C{POST /v1/responses}
    with a Responses JSON body, or -- for C{Accept: text/event-stream} --
    a 40-event Responses SSE stream, and C{POST /v1/chat/completions} with
    a chat completion. The bodies are what the bundled emulator answers
    (fetched from it once at start), served from memory by C{return 200}.
  - nginx C{proxy_pass} (apt's nginx, 1 process, keepalive upstream,
    C{proxy_buffering off} as an SSE gateway needs) in front of it;
  - relay (C{python -m twisted relay}, memory state, one API-key account
    on the same upstream, text logs to a file) in front of it;
  - the Go row (issue 24): C{bench/goproxy/main.go}, built here with
    Debian's C{go} (standard library only, offline), the minimum of a Go
    gateway -- check the client key, swap in the upstream credential,
    C{httputil.ReverseProxy} with keep-alive and C{FlushInterval: -1} --
    run with C{GOMAXPROCS=1} and pinned like relay; every issue-24 ratio
    is against it, in the same run;
  - the Twisted floor: C{bench/twistedfloor.py}, the Go row's work on the
    Twisted reactor and httptools in CPython with nothing of relay's, pinned
    like relay: its ratio to Go is the ceiling of relay's.

Pinning (C{taskset}): relay and the nginx proxy on CPU 0, wrk and the
upstream on CPU 1 (the box has two cores). Scenarios: C{c=1}, C{c=32},
C{c=128} JSON, the 40-event stream at C{c=16}, chat at C{c=32}; each against
direct (the upstream itself), nginx and relay. Per target: requests/s
(events/s for the stream), p50/p99, CPU per request of the process under
test, peak RSS; relay/nginx ratios.

Then C{pool} (issue 24): memory vs Redis state (JSON, stream, chat: CPU
per turn, target Redis <= 1.3x memory) and pools of 1, 100 and 2,000
identical accounts (c=32 JSON, memory and Redis). Then C{turncost}: the
instruction counts per turn of C{bench/turncost.py} (callgrind; robust to a
loaded box). Then C{workers}: relay with Redis state, one worker vs C{workers: 2}
(unpinned, both cores), C{c=32} JSON. Then C{planning}: RSS of one relay
process at C{c=128}; RSS growth per idle client WebSocket with 10,000 of
them (and the latency of a request made meanwhile); 1,000 concurrent slow
SSE streams (1 event/s) through one process, p99 delay of an event.

C{codex} (issue 38, only with C{--only codex}): Codex-shaped bodies of
64 KiB, 256 KiB and 1 MiB (C{bench/codexbody.py}) beside the Go row and the
Twisted floor, a 50-turn Codex WebSocket session in each mode, callgrind
instructions per 1 MiB turn, and the issue's targets
(C{bench/codexbench.py}).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELAY_KEY = "sk-relay-bench"
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
EVENTS_PER_STREAM = 40


# -- processes -----------------------------------------------------------------


def _raiseFiles() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free() -> int:
    """
    A free TCP port on 127.0.0.1.
    """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def waitPort(port: int, timeout: float = 30) -> None:
    """
    Wait until something accepts on C{port}.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listening on {port}")


def waitReady(port: int, timeout: float = 60) -> None:
    """
    Wait until relay on C{port} answers C{GET /readyz} with 200 (its keys
    and control plane read: before that a turn gets 503 C{keys_loading}).
    """
    waitPort(port, timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return  # a relay from before /readyz (a --baseline tree)
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"relay on {port} not ready after {timeout:g} s")


def cpuSeconds(pid: int) -> float:
    """
    CPU seconds (user + system) C{pid} has used so far.
    """
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def memory(pid: int) -> dict:
    """
    C{VmRSS} and C{VmHWM} (peak RSS) of C{pid}, in KiB.
    """
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def children(pid: int) -> list:
    """
    The pids of C{pid}'s direct children.
    """
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class Procs:
    """
    The processes a bench run started; all stopped at the end.
    """

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.procs = []

    def start(self, name: str, argv: list, cpu=None, env=None) -> subprocess.Popen:
        if cpu is not None:
            argv = ["taskset", "-c", str(cpu)] + argv
        with open(os.path.join(self.tmp, name + ".log"), "ab") as log:
            # preexec_fn: the samplers' threads are not running while we fork.
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                 env=env or os.environ, preexec_fn=_raiseFiles)  # noqa: PLW1509
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stopAll(self) -> None:
        for p in list(self.procs):
            self.stop(p)


# -- the upstream and nginx --------------------------------------------------------


def fetchBodies(procs: Procs) -> dict:
    """
    What the bundled emulator answers for a JSON turn, a 40-event streamed
    turn (32 text deltas) and a chat completion.
    """
    port = free()
    conf = os.path.join(procs.tmp, "emulator.yaml")
    with open(conf, "w") as f:
        f.write(f'listen: "tcp:{port}:interface=127.0.0.1"\n'
                "default_script: {text: '" + "w " * 32 + "', deltas: 32}\n")
    p = procs.start("emulator", [sys.executable, "-m", "twisted", "relay-emulator", "--config", conf],
                    env=dict(os.environ, PYTHONPATH=ROOT))
    waitPort(port)

    def post(path, body):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer x"})
        with urllib.request.urlopen(req) as r:
            return r.read().decode()

    bodies = {
        "json": post("/v1/responses", {"model": "gpt-5.5", "input": "hi"}),
        "sse": post("/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True}),
        "chat": post("/v1/chat/completions",
                     {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}]}),
    }
    procs.stop(p)
    assert bodies["sse"].count("\n\n") == EVENTS_PER_STREAM, bodies["sse"]
    return bodies


def _nginxString(text: str) -> str:
    assert "$" not in text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _nginxReturn(text: str) -> str:
    """
    C{return 200 ...} for C{text}; nginx limits one config token to 4 KiB,
    so a longer text is set in parts and returned as their concatenation.
    """
    parts = [text[i:i + 1500] for i in range(0, len(text), 1500)]
    if len(parts) == 1:
        return f"return 200 {_nginxString(text)};"
    sets = " ".join(f"set $part{i} {_nginxString(p)};" for i, p in enumerate(parts))
    return sets + ' return 200 "' + "".join(f"${{part{i}}}" for i in range(len(parts))) + '";'


def nginxConf(tmp: str, name: str, port: int, http: str) -> str:
    """
    Write an nginx config (one process, no daemon, no access log).
    """
    path = os.path.join(tmp, name + ".conf")
    with open(path, "w") as f:
        f.write(f"""
daemon off; master_process off; worker_processes 1; worker_rlimit_nofile 20000;
pid {tmp}/{name}.pid; error_log {tmp}/{name}.err warn;
events {{ worker_connections 16384; }}
http {{
  access_log off; keepalive_requests 1000000000; keepalive_timeout 300s;
  client_max_body_size 64m; client_body_buffer_size 2m;
  client_body_temp_path {tmp}/{name}-body; proxy_temp_path {tmp}/{name}-proxy;
  fastcgi_temp_path {tmp}/{name}-fcgi; uwsgi_temp_path {tmp}/{name}-uwsgi;
  scgi_temp_path {tmp}/{name}-scgi;
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
{http}
  }}
}}
""")
    return path


def startUpstream(procs: Procs, bodies: dict, cpu) -> tuple:
    """
    The nginx upstream on C{cpu}. @return: C{(process, port)}.
    """
    port = free()
    http = f"""
    location = /v1/responses {{
      if ($http_accept = "text/event-stream") {{ rewrite ^ /sse last; }}
      default_type application/json;
      {_nginxReturn(bodies["json"])}
    }}
    location = /sse {{ internal; default_type text/event-stream; {_nginxReturn(bodies["sse"])} }}
    location = /v1/chat/completions {{
      default_type application/json; {_nginxReturn(bodies["chat"])}
    }}"""
    conf = nginxConf(procs.tmp, "upstream", port, http)
    p = procs.start("upstream", ["nginx", "-c", conf, "-p", procs.tmp], cpu=cpu)
    waitPort(port)
    return p, port


def startNginxProxy(procs: Procs, upstreamPort: int, cpu) -> tuple:
    """
    nginx C{proxy_pass} to the upstream, keepalive connections, no
    buffering. @return: C{(process, port)}.
    """
    port = free()
    http = f"""
    location / {{
      proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
  upstream up {{ server 127.0.0.1:{upstreamPort}; keepalive 256; keepalive_requests 1000000000;"""
    conf = nginxConf(procs.tmp, "proxy", port, http)
    p = procs.start("proxy", ["nginx", "-c", conf, "-p", procs.tmp], cpu=cpu)
    waitPort(port)
    return p, port


GO_SOURCE = os.path.join(ROOT, "bench", "goproxy", "main.go")
GO_UPSTREAM_KEY = "sk-upstream-bench"


def buildGo(tmp: str) -> str:
    """
    Build L{GO_SOURCE} (standard library only, offline: no module is
    fetched) into C{tmp}. @return: the binary's path.
    """
    out = os.path.join(tmp, "goproxy")
    env = dict(os.environ, GOCACHE=os.path.join(tmp, "gocache"), GO111MODULE="off",
               GOFLAGS="", GOPROXY="off", CGO_ENABLED="0")
    subprocess.run(["go", "build", "-o", out, GO_SOURCE], check=True, env=env,
                   cwd=os.path.dirname(GO_SOURCE))
    return out


def startGo(procs: Procs, binary: str, upstreamPort: int, cpu) -> tuple:
    """
    The Go stdlib reverse proxy (issue 24's Go row) on C{cpu} with
    C{GOMAXPROCS=1}. @return: C{(process, port)}.
    """
    port = free()
    p = procs.start("goproxy", [binary, f"127.0.0.1:{port}", f"http://127.0.0.1:{upstreamPort}",
                                RELAY_KEY, GO_UPSTREAM_KEY],
                    cpu=cpu, env=dict(os.environ, GOMAXPROCS="1"))
    waitPort(port)
    return p, port


FLOOR_SOURCE = os.path.join(ROOT, "bench", "twistedfloor.py")


def startFloor(procs: Procs, upstreamPort: int, cpu) -> tuple:
    """
    The Twisted floor (L{FLOOR_SOURCE}: the Go row's work on the reactor
    and httptools, in CPython, without any of relay's) on C{cpu}.
    @return: C{(process, port)}.
    """
    port = free()
    p = procs.start("twistedfloor", [sys.executable, FLOOR_SOURCE, str(port), str(upstreamPort),
                                     RELAY_KEY, GO_UPSTREAM_KEY], cpu=cpu)
    waitPort(port)
    return p, port


def relayConfig(tmp: str, name: str, port: int, upstreamPort: int, extra: str = "") -> str:
    """
    Write a relay config: one key, one API-key account on the upstream.
    """
    path = os.path.join(tmp, name + ".yaml")
    account = {"id": "a1", "type": "apikey", "base_url": f"http://127.0.0.1:{upstreamPort}/v1",
               "api_key": "sk-upstream-bench", "concurrency": 0}
    with open(path, "w") as f:
        f.write(f'listen: "tcp:{port}:interface=127.0.0.1"\n'
                f"keys: [{{name: bench, key: {RELAY_KEY}, concurrency: 0}}]\n"
                f"accounts: [{json.dumps(account)}]\n"
                f"database: {tmp}/{name}.sqlite\n" + extra)
    return path


def startRelay(procs: Procs, name: str, upstreamPort: int, cpu=None, extra: str = "",
               args=(), tree: str = ROOT, python: str | None = None) -> tuple:
    """
    relay (twist) on C{cpu}, from the source tree C{tree} (this checkout
    by default), run by the interpreter C{python} (this one by default).
    @return: C{(process, port)}.
    """
    port = free()
    conf = relayConfig(procs.tmp, name, port, upstreamPort, extra)
    p = procs.start(name, [python or sys.executable, "-m", "twisted", "relay", "--config", conf,
                           *args],
                    cpu=cpu, env=dict(os.environ, PYTHONPATH=tree))
    waitReady(port)
    return p, port


_BUILD = ("import sys; maps = open('/proc/self/maps').read(); "
          "print(sys.version.split()[0], 'libpython shared' if 'libpython' in maps "
          "else 'libpython linked in')")


def interpreterProblem(python: str) -> str | None:
    """
    Why C{python} cannot run relay (not found, or relay's dependencies
    missing), or L{None}.
    """
    try:
        done = subprocess.run([python, "-c", "import twisted, autobahn, httptools, orjson"],
                              capture_output=True, text=True, timeout=60, check=False)
    except OSError as e:
        return f"{python}: {e.strerror}"
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return f"{python} cannot import relay's dependencies ({last})"
    return None


def interpreterBuild(python: str) -> str:
    """
    C{python}'s version, and whether its C{libpython} is a shared library
    (a default pyenv build) or linked into the executable (Debian's
    C{/usr/bin/python3.11}, PGO + LTO): read from the running process's
    maps, since Debian's C{sysconfig} reports its shared build's flags.
    """
    done = subprocess.run([python, "-c", _BUILD], capture_output=True, text=True, timeout=60,
                          check=False)
    return done.stdout.strip() or "unknown"


# -- wrk -----------------------------------------------------------------------------


SCRIPTS = {
    "json": ("/v1/responses", {"model": "gpt-5.5", "input": "hi"}, None),
    "sse": ("/v1/responses", {"model": "gpt-5.5", "input": "hi", "stream": True},
            "text/event-stream"),
    "chat": ("/v1/chat/completions",
             {"model": "gpt-5.5", "messages": [{"role": "user", "content": "hi"}]}, None),
}


def wrkScript(tmp: str, kind: str) -> str:
    """
    A wrk Lua script POSTing the C{kind} body with relay's key.
    """
    path = os.path.join(tmp, kind + ".lua")
    _, body, accept = SCRIPTS[kind]
    with open(path, "w") as f:
        f.write('wrk.method = "POST"\n'
                f"wrk.body = '{json.dumps(body)}'\n"
                'wrk.headers["Content-Type"] = "application/json"\n'
                f'wrk.headers["Authorization"] = "Bearer {RELAY_KEY}"\n'
                + (f'wrk.headers["Accept"] = "{accept}"\n' if accept else ""))
    return path


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s|m)$", text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(tmp: str, kind: str, port: int, connections: int, seconds: float, cpu=None,
        watch=(), script=None) -> dict:
    """
    Run wrk; measure the CPU and memory of the C{watch} pids meanwhile.
    C{script}: a wrk script of the caller's (C{bench/codexbench.py}'s
    bodies) instead of C{kind}'s, POSTed to C{kind}'s path.

    @return: C{requests}, C{rps}, C{p50}, C{p99} (ms), C{errors},
        C{cpu} (seconds used by C{watch}), C{rss} (the highest VmRSS seen,
        KiB).
    """
    path = SCRIPTS[kind][0]
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s",
            script or wrkScript(tmp, kind), f"http://127.0.0.1:{port}{path}"]
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu)] + argv
    cpu0 = sum(cpuSeconds(p) for p in watch)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.25):
            try:
                peak[0] = max(peak[0], sum(memory(p)["VmRSS"] for p in watch))
            except OSError:
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60,
                         check=False).stdout
    done.set()
    sampler.join()
    used = sum(cpuSeconds(p) for p in watch) - cpu0
    result = {"requests": 0, "rps": 0.0, "p50": None, "p99": None, "errors": 0,
              "cpu": used, "rss": peak[0]}
    for line in out.splitlines():
        words = line.split()
        if "requests in" in line:
            result["requests"] = int(words[0])
        elif line.startswith("Requests/sec:"):
            result["rps"] = float(words[1])
        elif re.match(r"\s+50%", line):
            result["p50"] = _ms(words[1])
        elif re.match(r"\s+99%", line):
            result["p99"] = _ms(words[1])
        elif "Non-2xx" in line or "Socket errors" in line:
            result["errors"] += sum(int(n) for n in re.findall(r"\d+", line))
    if not result["requests"]:
        raise SystemExit("wrk failed:\n" + out)
    return result


# -- the scenarios -----------------------------------------------------------------


SPEED = [
    ("c=1 JSON", "json", 1),
    ("c=32 JSON", "json", 32),
    ("c=128 JSON", "json", 128),
    ("stream 40 events c=16", "sse", 16),
    ("chat c=32", "chat", 32),
]


def speed(procs: Procs, bodies: dict, seconds: float, report: list, baseline=None) -> dict:
    """
    Direct, nginx and relay for every L{SPEED} scenario, one after the
    other, on one upstream; and relay from the C{baseline} source tree,
    when given, pinned like relay.
    """
    upstream, uport = startUpstream(procs, bodies, cpu=1)
    proxy, pport = startNginxProxy(procs, uport, cpu=0)
    relay, rport = startRelay(procs, "relay", uport, cpu=0)
    goproxy, gport = startGo(procs, buildGo(procs.tmp), uport, cpu=0)
    floor, fport = startFloor(procs, uport, cpu=0)
    targets = [("direct", uport, upstream.pid), ("nginx", pport, proxy.pid),
               ("go", gport, goproxy.pid), ("floor", fport, floor.pid),
               ("relay", rport, relay.pid)]
    base = None
    if baseline:
        base, bport = startRelay(procs, "relay-baseline", uport, cpu=0, tree=baseline[0],
                                 python=baseline[2])
        targets.append(("baseline", bport, base.pid))
    # Warm up (connection pools, imports, caches).
    for _, port, pid in targets:
        wrk(procs.tmp, "json", port, 8, 1, cpu=1)
        wrk(procs.tmp, "sse", port, 4, 1, cpu=1)
        wrk(procs.tmp, "chat", port, 4, 1, cpu=1)
    results = {}
    for label, kind, conns in SPEED:
        for name, port, pid in targets:
            results[label, name] = wrk(procs.tmp, kind, port, conns, seconds, cpu=1, watch=[pid])
    peaks = {name: memory(pid)["VmHWM"] for name, _, pid in targets}
    report.append("## Per process: direct, nginx proxy_pass, Go stdlib proxy, the Twisted floor, "
                  "relay (same upstream, same run)\n")
    report.append("relay, the nginx proxy, the Go proxy (`bench/goproxy/main.go`, "
                  "`GOMAXPROCS=1`) and the Twisted floor pinned to CPU 0; wrk and the upstream (nginx `return 200`) on "
                  "CPU 1. CPU per request is the process under test (for direct: the upstream). "
                  "Stream: events/s = responses/s x 40.\n")
    report.append("The Twisted floor (`bench/twistedfloor.py`) is the Go row's work written on "
                  "the Twisted reactor and httptools in CPython, with nothing of relay's (no "
                  "policy, logs, metrics, state or body parsing): the least a Twisted gateway "
                  "does per request. *floor / Go* is the ceiling of any *relay / Go* ratio.\n")
    report.append("| scenario | direct | nginx | Go | Twisted floor | relay | relay / nginx | "
                  "floor / Go | relay / Go | relay / floor |")
    report.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, kind, conns in SPEED:
        d, n, g, f, r = (results[label, t] for t in ("direct", "nginx", "go", "floor", "relay"))
        if conns == 1:
            report.append(f"| {label}: p50 / p99 ms | {d['p50']:.3f} / {d['p99']:.3f} | "
                          f"{n['p50']:.3f} / {n['p99']:.3f} | {g['p50']:.3f} / {g['p99']:.3f} | "
                          f"{f['p50']:.3f} / {f['p99']:.3f} | "
                          f"{r['p50']:.3f} / {r['p99']:.3f} | | | | |")
            added = max(_added(g, d), 1e-6)
            report.append(f"| {label}: added p50 over direct | | {n['p50'] - d['p50']:.3f} ms | "
                          f"{g['p50'] - d['p50']:.3f} ms | {f['p50'] - d['p50']:.3f} ms | "
                          f"**{r['p50'] - d['p50']:.3f} ms** | | "
                          f"{_added(f, d) / added:.1f}x | **{_added(r, d) / added:.1f}x** | "
                          f"{_added(r, d) / max(_added(f, d), 1e-6):.1f}x |")
        mult, unit = (EVENTS_PER_STREAM, "events/s") if kind == "sse" else (1, "RPS")
        report.append(f"| {label}: {unit} | {d['rps'] * mult:,.0f} | {n['rps'] * mult:,.0f} | "
                      f"{g['rps'] * mult:,.0f} | {f['rps'] * mult:,.0f} | {r['rps'] * mult:,.0f} | "
                      f"**{r['rps'] / n['rps']:.3f}x** | {f['rps'] / g['rps']:.3f}x | "
                      f"**{r['rps'] / g['rps']:.3f}x** | {r['rps'] / f['rps']:.3f}x |")
        report.append(f"| {label}: p50 / p99 ms | {d['p50']:.2f} / {d['p99']:.2f} | "
                      f"{n['p50']:.2f} / {n['p99']:.2f} | {g['p50']:.2f} / {g['p99']:.2f} | "
                      f"{f['p50']:.2f} / {f['p99']:.2f} | "
                      f"{r['p50']:.2f} / {r['p99']:.2f} | | | | |"
                      if conns > 1 else "")
        report.append(f"| {label}: CPU per request | {_us(d)} | {_us(n)} | {_us(g)} | {_us(f)} | "
                      f"{_us(r)} | {_ratio(r, n)} | {_ratio(f, g)} | {_ratio(r, g)} | "
                      f"{_ratio(r, f)} |")
        errs = [f"{t} {results[label, t]['errors']}"
                for t in ("direct", "nginx", "go", "floor", "relay")
                if results[label, t]["errors"]]
        if errs:
            report.append(f"| {label}: errors | " + ", ".join(errs) + " | | | | | | | | |")
    report[:] = [line for line in report if line != ""]
    report.append(f"| peak RSS (VmHWM) | {peaks['direct'] / 1024:.1f} MiB | "
                  f"{peaks['nginx'] / 1024:.1f} MiB | {peaks['go'] / 1024:.1f} MiB | "
                  f"{peaks['floor'] / 1024:.1f} MiB | "
                  f"{peaks['relay'] / 1024:.1f} MiB | | | | |")
    report.append(f"| RSS during c=128 | | | {results['c=128 JSON', 'go']['rss'] / 1024:.1f} MiB | "
                  f"{results['c=128 JSON', 'floor']['rss'] / 1024:.1f} MiB | "
                  f"{results['c=128 JSON', 'relay']['rss'] / 1024:.1f} MiB | | | | |")
    report.append("")
    _goTargets(results, report, ["floor", "relay"] + (["baseline"] if base is not None else []))
    if base is not None:
        _baselineTable(results, peaks, baseline, report)
        procs.stop(base)
    for p in (relay, floor, goproxy, proxy, upstream):
        procs.stop(p)
    return results


def _added(r: dict, d: dict) -> float:
    """
    Added p50 latency of C{r} over direct C{d}, ms.
    """
    return r["p50"] - d["p50"]


#: issue 24's per-process targets against the Go row: (label, scenario,
#: how to read it, target, higher is better)
GO_TARGETS = [
    ("c=32 JSON RPS", "c=32 JSON", "rps", 0.25, True),
    ("c=128 JSON RPS", "c=128 JSON", "rps", None, True),
    ("chat c=32 RPS", "chat c=32", "rps", None, True),
    ("stream events/s", "stream 40 events c=16", "rps", 0.2, True),
    ("c=1 added p50", "c=1 JSON", "added", 3.0, False),
]


def _goTargets(results: dict, report: list, names: list) -> None:
    """
    Issue 24's ratios against the Go row, for the Twisted floor, relay
    (and the baseline).
    """
    report.append("### Issue 24 ratios against the Go row (same run)\n")
    report.append("| figure | target | " + " | ".join(names) + " |")
    report.append("|---|---:|" + "---:|" * len(names))
    for label, scenario, how, target, higher in GO_TARGETS:
        g, d = results[scenario, "go"], results[scenario, "direct"]
        cells = []
        for name in names:
            r = results[scenario, name]
            if how == "rps":
                value = r["rps"] / g["rps"]
            else:
                value = _added(r, d) / max(_added(g, d), 1e-6)
            met = "" if target is None else (" (met)" if (value >= target if higher
                                                         else value <= target) else " (not met)")
            cells.append(f"{value:.3f}x{met}" if how == "rps" else f"{value:.1f}x{met}")
        goal = "" if target is None else (f">= {target}x" if higher else f"<= {target}x")
        report.append(f"| {label} vs Go | {goal} | " + " | ".join(cells) + " |")
    cells = []
    for name in names:
        rss = results["c=128 JSON", name]["rss"] / 1024
        cells.append(f"{rss:.1f} MiB{' (met)' if rss <= 64 else ' (not met)'}")
    report.append("| RSS at c=128 | <= 64 MiB | " + " | ".join(cells) + " |")
    report.append("")


def _baselineTable(results: dict, peaks: dict, baseline: str, report: list) -> None:
    """
    This checkout's relay against the baseline tree's, scenario by
    scenario, from the same run.
    """
    report.append(f"## relay vs the baseline relay ({baseline[1]}), same run, same pinning\n")
    report.append("| scenario | baseline | relay | relay / baseline | CPU per request: "
                  "baseline -> relay |")
    report.append("|---|---:|---:|---:|---:|")
    for label, kind, conns in SPEED:
        b, r = results[label, "baseline"], results[label, "relay"]
        mult, unit = (EVENTS_PER_STREAM, "events/s") if kind == "sse" else (1, "RPS")
        report.append(f"| {label}: {unit} | {b['rps'] * mult:,.0f} | {r['rps'] * mult:,.0f} | "
                      f"**{r['rps'] / b['rps']:.2f}x** | {_us(b)} -> {_us(r)} |")
        if conns == 1:
            report.append(f"| {label}: p50 ms | {b['p50']:.3f} | {r['p50']:.3f} | | |")
    report.append(f"| peak RSS | {peaks['baseline'] / 1024:.1f} MiB | {peaks['relay'] / 1024:.1f} MiB "
                  "| | |")
    report.append("")


def _us(r: dict) -> str:
    return f"{r['cpu'] / r['requests'] * 1e6:,.0f} us" if r["requests"] else "-"


def _ratio(r: dict, n: dict) -> str:
    if not (r["requests"] and n["requests"] and n["cpu"]):
        return "-"
    return f"{(r['cpu'] / r['requests']) / (n['cpu'] / n['requests']):.1f}x"


def workers(procs: Procs, bodies: dict, seconds: float, report: list) -> None:
    """
    One relay worker vs C{workers: 2} (Redis state, unpinned), c=32 JSON.
    """
    redisPort = free()
    redis = procs.start("redis", ["redis-server", "--port", str(redisPort), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"])
    waitPort(redisPort)
    upstream, uport = startUpstream(procs, bodies, cpu=None)
    state = f"state: {{backend: redis, redis_url: 'redis://127.0.0.1:{redisPort}/0'}}\n"
    rows = []
    relays = {}
    for n in (1, 2):
        relay, rport = startRelay(procs, f"relay-w{n}", uport, extra=state + f"workers: {n}\n")
        deadline = time.monotonic() + 30
        while len(children(relay.pid)) < (n if n > 1 else 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)
        relays[n] = (relay, rport, [relay.pid] + children(relay.pid))
        wrk(procs.tmp, "json", rport, 32, 2)
    # Alternate (1, 2, 1, 2): the box is shared, so neighbours' load hits both.
    for n in (1, 2, 1, 2):
        relay, rport, pids = relays[n]
        r0, u0 = cpuSeconds(redis.pid), cpuSeconds(upstream.pid)
        t0 = os.times()
        r = wrk(procs.tmp, "json", rport, 32, seconds, watch=pids)
        t1 = os.times()
        r["redisCpu"] = cpuSeconds(redis.pid) - r0
        r["upstreamCpu"] = cpuSeconds(upstream.pid) - u0
        r["wrkCpu"] = (t1.children_user + t1.children_system) - (t0.children_user + t0.children_system)
        r["load"] = os.getloadavg()[0]
        rows.append((n, r))
    for relay, _, _ in relays.values():
        procs.stop(relay)
    procs.stop(upstream)
    procs.stop(redis)
    one = sum(r["rps"] for n, r in rows if n == 1) / 2
    two = sum(r["rps"] for n, r in rows if n == 2) / 2
    report.append("## Workers across cores\n")
    report.append("relay with `state.backend: redis`, nothing pinned (relay, wrk, the upstream "
                  "and redis-server share both cores), c=32 JSON. The other columns: what the "
                  "rest of the box spent meanwhile (the cores relay did not get).\n")
    report.append("| workers | RPS | RPS per worker | p50 / p99 ms | CPU per request (all workers) "
                  "| relay cores used | redis / upstream / wrk CPU per request | load avg "
                  "| vs 1 worker |")
    report.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in rows:
        per = lambda k, r=r: f"{r[k] / r['requests'] * 1e6:,.0f}"  # noqa: E731
        report.append(f"| {n} | {r['rps']:,.0f} | {r['rps'] / n:,.0f} | {r['p50']:.2f} / "
                      f"{r['p99']:.2f} | {_us(r)} | {r['cpu'] / seconds:.2f} | "
                      f"{per('redisCpu')} / {per('upstreamCpu')} / {per('wrkCpu')} us | "
                      f"{r['load']:.2f} | {r['rps'] / one:.2f}x |")
    report.append(f"| **2 vs 1 (means of the alternating runs)** | {two:,.0f} vs {one:,.0f} | "
                  "| | | | | | "
                  f"**{two / one:.2f}x** |")
    report.append("")
    _scalingCeiling(rows, report)
    _planning(rows, report)


def _scalingCeiling(rows: list, report: list) -> None:
    """
    Issue 24 item 4: what the workers cost each other, apart from the cores
    the box lets them have. With relay's CPU per turn M{r1} (one worker)
    and M{r2} (two), and M{o} the rest of the box's per turn (redis-server,
    the upstream, wrk), two workers on a 2-core box carry at most
    M{2 / (r2 + o)} turns/s and one worker M{1 / r1}: the ratio the box
    allows is M{2 r1 / (r2 + o)}, below 2 whatever relay does. The
    workers' own scaling is M{2 r1 / r2} (two workers on cores of their
    own, the rest of the box elsewhere).
    """
    def mean(n, key):
        picked = [r for m, r in rows if m == n]
        return sum(r[key] for r in picked) / sum(r["requests"] for r in picked)

    r1, r2 = mean(1, "cpu"), mean(2, "cpu")
    rest = sum(mean(2, k) for k in ("redisCpu", "upstreamCpu", "wrkCpu"))
    report.append("### Workers: what they cost each other, and what this box allows\n")
    report.append(f"relay CPU per turn: one worker {r1 * 1e6:,.0f} us, two workers "
                  f"{r2 * 1e6:,.0f} us ({r2 / r1:.2f}x); the rest of the box (redis-server, "
                  f"upstream, wrk) {rest * 1e6:,.0f} us per turn on the same two cores.\n")
    report.append("| figure | value |")
    report.append("|---|---:|")
    report.append(f"| two workers on cores of their own vs one (2 r1 / r2) | **{2 * r1 / r2:.2f}x** |")
    report.append(f"| the most 2 vs 1 can show on this 2-core box (2 r1 / (r2 + rest)) | "
                  f"{2 * r1 / (r2 + rest):.2f}x |")
    report.append("")


def _planning(rows: list, report: list) -> None:
    """
    Issue 24 item 4: turns per second for N workers on N cores of their own,
    on paper from the one-worker runs' CPU per turn (relay's and
    redis-server's): N / relay CPU per turn, capped by one redis-server
    core (it runs scripts on one thread).
    """
    ones = [r for n, r in rows if n == 1]
    relayCpu = sum(r["cpu"] for r in ones) / sum(r["requests"] for r in ones)
    redisCpu = sum(r["redisCpu"] for r in ones) / sum(r["requests"] for r in ones)
    report.append("### Planning: turns per second by workers (on paper, from CPU per turn)\n")
    report.append(f"From the one-worker runs: relay {relayCpu * 1e6:,.0f} us of CPU per turn, "
                  f"redis-server {redisCpu * 1e6:,.0f} us (one core: at most "
                  f"{1 / redisCpu:,.0f} turns/s). N workers, each on a core of its own (Redis, "
                  "the upstream and the clients elsewhere), carry N / relay CPU per turn; "
                  "scaling loss between workers is not modelled.\n")
    report.append("| workers (cores) | turns/s | turns/s per worker | bound by |")
    report.append("|---:|---:|---:|---|")
    for n in (1, 2, 4, 8, 16):
        relayBound = n / relayCpu
        value = min(relayBound, 1 / redisCpu)
        report.append(f"| {n} | {value:,.0f} | {value / n:,.0f} | "
                      f"{'relay CPU' if relayBound <= 1 / redisCpu else 'redis-server (one core)'} |")
    report.append("")


# -- state backends and pool sizes (issue 24) ----------------------------------------


POOL_SIZES = (1, 100, 2000)
STATE_KINDS = [("c=32 JSON", "json", 32), ("stream 40 events c=16", "sse", 16),
               ("chat c=32", "chat", 32)]


def statePool(procs: Procs, bodies: dict, seconds: float, report: list, trees: list) -> dict:
    """
    Issue 24 items 3 and 5, for each C{(label, source tree)}: memory vs
    Redis state (one account; JSON, stream and chat) and pools of 1, 100
    and 2,000 identical healthy accounts (c=32 JSON), memory and Redis.
    Key and account C{concurrency: 64}, so each turn takes both slots.
    relay pinned to CPU 0; wrk, the upstream and redis-server on CPU 1.
    """
    import turncost

    upstream, uport = startUpstream(procs, bodies, cpu=1)
    redisPort = free()
    redis = procs.start("redis-pool", ["redis-server", "--port", str(redisPort), "--bind",
                                       "127.0.0.1", "--save", "", "--appendonly", "no"], cpu=1)
    waitPort(redisPort)
    results = {}
    for label, tree in trees:
        for state in ("memory", "redis"):
            for n in POOL_SIZES:
                extra = ""
                if state == "redis":
                    subprocess.run(["redis-cli", "-p", str(redisPort), "FLUSHALL"],
                                   capture_output=True, check=True)
                    extra = (f"state: {{backend: redis, redis_url: "
                             f"'redis://127.0.0.1:{redisPort}/0'}}\n")
                port = free()
                name = f"relay-{state}-{n}"
                config = os.path.join(procs.tmp, name + ".yaml")
                turncost.relayYaml(config, port, uport, n, turncost.LIMITS, extra)
                relay = procs.start(name, [sys.executable, "-m", "twisted", "relay", "--config",
                                           config], cpu=0, env=dict(os.environ, PYTHONPATH=tree))
                waitReady(port)
                kinds = STATE_KINDS if n == 1 else STATE_KINDS[:1]
                for scenario, kind, conns in kinds:
                    wrk(procs.tmp, kind, port, 8, 1, cpu=1)
                    r0 = cpuSeconds(redis.pid)
                    r = wrk(procs.tmp, kind, port, conns, seconds, cpu=1, watch=[relay.pid])
                    r["redisCpu"] = cpuSeconds(redis.pid) - r0 if state == "redis" else 0.0
                    r["load"] = os.getloadavg()[0]
                    results[label, state, n, scenario] = r
                procs.stop(relay)
    procs.stop(redis)
    procs.stop(upstream)
    _statePoolReport(results, trees, report)
    return results


def _statePoolReport(results: dict, trees: list, report: list) -> None:
    report.append("## Memory vs Redis state (issue 24 item 3)\n")
    report.append("One account, key and account concurrency 64; relay on CPU 0, wrk, the "
                  "upstream and redis-server on CPU 1. CPU per request: relay's process (and "
                  "redis-server's beside it). Target: Redis <= 1.3x memory.\n")
    report.append("| tree | scenario | memory RPS | Redis RPS | relay CPU/request memory -> "
                  "Redis | Redis / memory | redis-server CPU/request | load avg |")
    report.append("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, _ in trees:
        for scenario, kind, _ in STATE_KINDS:
            m = results.get((label, "memory", 1, scenario))
            r = results.get((label, "redis", 1, scenario))
            if not (m and r):
                continue
            mult = EVENTS_PER_STREAM if kind == "sse" else 1
            unit = " events/s" if kind == "sse" else ""
            report.append(
                f"| {label} | {scenario} | {m['rps'] * mult:,.0f}{unit} | "
                f"{r['rps'] * mult:,.0f}{unit} | {_us(m)} -> {_us(r)} | **{_ratio(r, m)}** | "
                f"{r['redisCpu'] / r['requests'] * 1e6:,.0f} us | {r['load']:.2f} |")
    report.append("")
    report.append("## Pool size (issue 24 item 5)\n")
    report.append("c=32 JSON, identical healthy accounts (the bench's repeated body takes the "
                  "sticky-session path). Target: 2,000 accounts >= 0.8x the 1-account RPS, on "
                  "memory and on Redis.\n")
    report.append("| tree | state | accounts | RPS | vs 1 account | relay CPU/request | "
                  "load avg |")
    report.append("|---|---|---:|---:|---:|---:|---:|")
    for label, _ in trees:
        for state in ("memory", "redis"):
            one = results.get((label, state, 1, "c=32 JSON"))
            for n in POOL_SIZES:
                r = results.get((label, state, n, "c=32 JSON"))
                if not (r and one):
                    continue
                report.append(f"| {label} | {state} | {n:,} | {r['rps']:,.0f} | "
                              f"**{r['rps'] / one['rps']:.2f}x** | {_us(r)} | {r['load']:.2f} |")
    report.append("")


# -- planning figures ----------------------------------------------------------------


async def _openWebSockets(port: int, count: int, opened: list) -> list:
    key = "dGhlIHNhbXBsZSBub25jZQ=="
    request = (f"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               "Upgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
               f"Authorization: Bearer {RELAY_KEY}\r\n\r\n").encode()
    conns = []
    sem = asyncio.Semaphore(200)

    async def one():
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 101"):
                raise SystemExit(f"WebSocket upgrade refused: {head[:200]!r}")
            conns.append(writer)
            opened[0] += 1

    await asyncio.gather(*(one() for _ in range(count)))
    return conns


def _timedRequest(port: int) -> float:
    """
    One JSON turn through relay; seconds it took.
    """
    start = time.perf_counter()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/responses",
        data=json.dumps(SCRIPTS["json"][1]).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {RELAY_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()
    return time.perf_counter() - start


def idleWebSockets(procs: Procs, bodies: dict, count: int, report: list) -> None:
    """
    RSS growth of one relay process per idle client WebSocket, and the
    latency of requests made while C{count} of them are open.
    """
    upstream, uport = startUpstream(procs, bodies, cpu=1)
    relay, rport = startRelay(procs, "relay-ws", uport, cpu=0)
    for _ in range(50):
        _timedRequest(rport)
    before = memory(relay.pid)["VmRSS"]
    opened = [0]
    latencies = []

    opening = []

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(_openWebSockets(rport, count, opened))
        while not task.done():
            opening.append(await loop.run_in_executor(None, _timedRequest, rport))
            await asyncio.sleep(0.2)
        conns = task.result()
        await asyncio.sleep(3)
        after = memory(relay.pid)["VmRSS"]
        for _ in range(50):
            latencies.append(await loop.run_in_executor(None, _timedRequest, rport))
            await asyncio.sleep(0.1)
        for w in conns:
            w.close()
        return after

    after = asyncio.run(main())
    per = (after - before) / count
    latencies.sort()
    opening.sort()
    report.append(f"| RSS growth per idle client WebSocket ({count:,} open on one process; "
                  f"{before / 1024:.1f} -> {after / 1024:.1f} MiB) | **{per:.1f} KiB** | <= 20 KiB |")
    report.append(f"| a JSON request while the {count:,} are open: max of {len(latencies)} | "
                  f"**{latencies[-1] * 1000:.1f} ms** (p50 {latencies[len(latencies) // 2] * 1000:.1f} ms) "
                  f"| <= 50 ms |")
    report.append(f"| a JSON request while they are being opened (200 handshakes in flight): "
                  f"max of {len(opening)} | {opening[-1] * 1000:.1f} ms "
                  f"(p50 {opening[len(opening) // 2] * 1000:.1f} ms) | |")
    procs.stop(relay)
    procs.stop(upstream)


SLOW_UPSTREAM = r'''
import json, sys, time
from twisted.internet import reactor, task
from twisted.web import server, resource

EVENTS = int(sys.argv[2])

def sse(kind, payload):
    payload["type"] = kind
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(payload).encode() + b"\n\n"

class Slow(resource.Resource):
    isLeaf = True
    def render_POST(self, request):
        request.setHeader(b"content-type", b"text/event-stream")
        request.write(sse("response.created", {"response": {"id": "resp_1", "status": "in_progress", "output": []}}))
        state = {"n": 0}
        def tick():
            if request.finished or request._disconnected:
                loop.stop(); return
            if state["n"] == EVENTS:
                request.write(sse("response.completed", {"response": {"id": "resp_1", "status": "completed", "output": [], "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}}))
                request.finish(); loop.stop(); return
            state["n"] += 1
            request.write(sse("response.output_text.delta", {"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "%.6f " % time.time()}))
        loop = task.LoopingCall(tick)
        loop.start(1.0, now=True)
        return server.NOT_DONE_YET

reactor.listenTCP(int(sys.argv[1]), server.Site(Slow()), backlog=4096, interface="127.0.0.1")
reactor.run()
'''


async def _slowClients(port: int, count: int, path: str, spread: float) -> list:
    body = json.dumps(SCRIPTS["sse"][1]).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Authorization: Bearer {RELAY_KEY}\r\nAccept: text/event-stream\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    delays = []
    started = []
    pattern = re.compile(rb'"delta": ?"([\d.]+) ')

    async def one(i):
        await asyncio.sleep(spread * i / count)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        first = True
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.time()
            for m in pattern.finditer(data):
                if first:
                    started.append(now)
                    first = False
                sent = float(m.group(1))
                delays.append((sent, now - sent))
        writer.close()

    await asyncio.gather(*(one(i) for i in range(count)))
    return delays, max(started)


def slowStreams(procs: Procs, count: int, events: int, report: list, spread: float = 3.0) -> None:
    """
    C{count} concurrent streams of C{events} events 1 s apart, direct and
    through one relay process; the delay of each event (client receive time
    minus the upstream's write time, in the event).
    """
    uport = free()
    script = os.path.join(procs.tmp, "slow_upstream.py")
    with open(script, "w") as f:
        f.write(SLOW_UPSTREAM)
    upstream = procs.start("slow-upstream", [sys.executable, script, str(uport), str(events)], cpu=1)
    waitPort(uport)
    relay, rport = startRelay(procs, "relay-slow", uport, cpu=0)
    _timedRequest  # noqa: B018 - (the upstream answers SSE only)
    rows = []
    for name, port in (("direct", uport), ("relay", rport)):
        cpu0 = cpuSeconds(relay.pid)
        delays, allStarted = asyncio.run(_slowClients(port, count, "/v1/responses", spread))
        used = cpuSeconds(relay.pid) - cpu0
        rows.append((name, delays, allStarted, used))
    rss = memory(relay.pid)["VmHWM"]
    procs.stop(relay)
    procs.stop(upstream)

    def pct(values, q):
        return values[min(len(values) - 1, int(len(values) * q))] * 1000

    for name, delays, allStarted, used in rows:
        steady = sorted(d for sent, d in delays if sent > allStarted + 0.5)
        every = sorted(d for _, d in delays)
        target = "<= 20 ms" if name == "relay" else ""
        extra = (f"; relay CPU {used:.1f} s, peak RSS {rss / 1024:.0f} MiB"
                 if name == "relay" else "")
        report.append(f"| {count:,} slow SSE streams (1 event/s, {events} each, started over "
                      f"{spread:g} s), {name}: event delay p50 / p99 once all are open "
                      f"({len(steady):,} events{extra}) | "
                      f"{pct(steady, 0.5):.1f} / **{pct(steady, 0.99):.1f} ms** | {target} |")
        report.append(f"| ... {name}, every event including the ramp-up ({len(every):,}) | "
                      f"{pct(every, 0.5):.1f} / {pct(every, 0.99):.1f} ms | |")
    report.append("")


def planning(procs: Procs, bodies: dict, quick: bool, report: list) -> None:
    """
    The planning figures.
    """
    report.append("## Planning figures\n")
    report.append("| figure | value | target |")
    report.append("|---|---:|---:|")
    idleWebSockets(procs, bodies, 2_000 if quick else 10_000, report)
    slowStreams(procs, 200 if quick else 1_000, 6 if quick else 20, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--quick", action="store_true", help="3 s per scenario, smaller planning")
    parser.add_argument("--only", action="append",
                        choices=["speed", "workers", "planning", "idle", "slow", "pool",
                                 "turncost", "codex"])
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--baseline", help="a git ref (exported with git archive) or another "
                        "relay source tree, measured in the same run beside this one")
    parser.add_argument("--baseline-python", metavar="PATH",
                        help="the interpreter the baseline relay runs on (speed only; default: "
                        "this one); without --baseline the baseline is this tree, so one run "
                        "compares two interpreters")
    parser.add_argument("--turns", type=int, default=200,
                        help="turns per instruction count (turncost)")
    parser.add_argument("--codex-turns", type=int, default=30,
                        help="1 MiB turns per instruction count (codex)")
    args = parser.parse_args()
    if args.baseline_python:
        problem = interpreterProblem(args.baseline_python)
        if problem:
            raise SystemExit(f"--baseline-python: {problem}")
    for tool in ("nginx", "wrk", "taskset", "redis-server", "go", "valgrind"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install nginx wrk util-linux "
                             "redis-server golang-go valgrind)")
    if os.cpu_count() < 2:
        raise SystemExit("needs two CPUs for the pinning")
    _raiseFiles()
    seconds = 3 if args.quick else args.seconds
    only = args.only or ["speed", "pool", "turncost", "workers", "planning"]
    tmp = tempfile.mkdtemp(prefix="relay-compare-")
    procs = Procs(tmp)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    nginxVersion = subprocess.run(["nginx", "-v"], capture_output=True, text=True,
                                  check=False).stderr.strip()
    report = [f"# relay bench: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
              (f"Command: `python bench/compare.py {' '.join(sys.argv[1:])}`; relay {commit}; "
               f"{nginxVersion}; Python {sys.version.split()[0]}; {os.cpu_count()} CPUs; "
               f"load average before: {os.getloadavg()[0]:.2f}; {seconds:g} s per scenario.\n")]
    try:
        baseline = None
        trees = [(f"this tree {commit}", ROOT)]
        if args.baseline:
            import turncost

            path, baseCommit = turncost.exportTree(args.baseline, tmp)
            baseline = (path, f"baseline {baseCommit or args.baseline}", args.baseline_python)
            trees.insert(0, (baseline[1], path))
            report.append(f"Baseline: `{args.baseline}` ({baseCommit}), measured in the same "
                          "run.\n")
        elif args.baseline_python:
            baseline = (ROOT, f"baseline: this tree on {args.baseline_python}",
                        args.baseline_python)
        if args.baseline_python:
            report.append(f"Baseline interpreter: `{args.baseline_python}` "
                          f"({interpreterBuild(args.baseline_python)}); relay's: "
                          f"`{sys.executable}` ({interpreterBuild(sys.executable)}).\n")
        bodies = fetchBodies(procs)
        if "speed" in only:
            speed(procs, bodies, seconds, report, baseline=baseline)
            print("\n".join(report), flush=True)
        if "pool" in only:
            statePool(procs, bodies, seconds, report, trees)
            print("\n".join(report), flush=True)
        if "codex" in only:
            import codexbench

            codexbench.run(procs, bodies, seconds, report, baseline, trees, turns=args.codex_turns)
            print("\n".join(report), flush=True)
        if "turncost" in only:
            import turncost

            costs = turncost.run(procs, trees, ["kinds", "state", "load", "pool"], args.turns,
                                 bodies)
            turncost.report(costs, trees, args.turns, report)
            print("\n".join(report), flush=True)
        if "workers" in only:
            workers(procs, bodies, seconds, report)
        if "planning" in only:
            planning(procs, bodies, args.quick, report)
        elif "idle" in only or "slow" in only:
            report.append("## Planning figures\n")
            report.append("| figure | value | target |")
            report.append("|---|---:|---:|")
            if "idle" in only:
                idleWebSockets(procs, bodies, 2_000 if args.quick else 10_000, report)
            if "slow" in only:
                slowStreams(procs, 200 if args.quick else 1_000, 6 if args.quick else 20, report)
    finally:
        procs.stopAll()
        if os.environ.get("RELAY_BENCH_KEEP"):
            print(f"(kept {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
