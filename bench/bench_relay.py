"""
Hot-path benchmarks for relay (DEVELOPERS.md "Speed and memory targets live
in benchmarks"). Not a test: it prints figures.

  python bench/bench_relay.py pump       # in-process: SSE events/s through
                                         # the parser + StreamPump + SSE sink
  python bench/bench_relay.py http       # relay and emulator as processes,
                                         # wrk load: relayed requests/s, plus
                                         # the emulator alone for comparison
  python bench/bench_relay.py stream     # one long SSE stream through relay:
                                         # events/s end to end
  python bench/bench_relay.py logs       # in-process: the log lines of one
                                         # relayed request through the text
                                         # and JSON observers, us per request

Targets (DEVELOPERS.md): >= 5,000 relayed requests/s and >= 150k SSE
events/s per process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def benchPump(events: int = 200_000) -> None:
    """
    Feed a synthetic upstream SSE body through the real L{StreamPump} into
    an SSE sink over a StringTransport-like request; count events/s.
    """
    from twisted.internet.task import Clock

    from relay.policy.classify import DefaultClassifier
    from relay.engine.pump import StreamPump
    from relay.engine.runner import TurnRunner
    from relay.base.records import Account, ClientKey, Turn
    from relay.state.settings import RuntimeSettings
    from relay.wire.sse import Event

    delta = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"sequence_number":%d,"item_id":"msg_1","output_index":0,"content_index":0,'
        b'"delta":"hello "}\n\n'
    )
    head = (
        b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1",'
        b'"status":"in_progress","output":[]}}\n\n'
    )
    tail = (
        b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1",'
        b'"status":"completed","output":[{"type":"message"}],"usage":{"total_tokens":1}}}\n\n'
    )
    chunk = b"".join(delta % i for i in range(64))
    body = [head] + [chunk] * (events // 64) + [tail]
    written = [0]

    class Sink:
        committed = False

        def commit(self, headers):
            self.committed = True

        def writeEvent(self, event: Event):
            written[0] += len(event.raw)

        def fail(self, error):
            raise AssertionError(error)

    clock = Clock()
    runner = TurnRunner(
        clock=clock, scheduler=None, admission=None, dialer=None,
        classifier=DefaultClassifier(), health=None, settings=RuntimeSettings(),
    )
    account = Account(id="a", type="apikey", base_url="http://x", credential="k")
    turn = Turn(entrypoint="http", endpoint="responses", client=ClientKey("c", "k"),
                model="m", body={}, stream=True)

    class Transport:
        def stopProducing(self):
            pass

    pump = StreamPump(runner, turn, Sink(), account, lambda: None, None, 0)
    pump.makeConnection(Transport())
    start = time.perf_counter()
    for part in body:
        pump.dataReceived(part)
    elapsed = time.perf_counter() - start
    n = (events // 64) * 64 + 2
    print(f"pump: {n} events in {elapsed:.3f}s = {n / elapsed:,.0f} events/s "
          f"({written[0] / elapsed / 2**20:,.1f} MiB/s written)")


def _requestEvents():
    """
    The log lines one relayed non-streaming request writes, as
    C{(namespace, format, fields)}: the access line, the scheduling
    decision record and C{relay.turn_finished}, with the fields the real
    call sites pass. Older trees (before issue 15) logged the access line
    through twisted.web's Apache-style C{log_io} text; newer ones log
    C{relay.http_access} (L{relay.process.app}).
    """
    import relay.process.app

    rid = "req_0123456789abcdef"
    if hasattr(relay.process.app, "_Site"):
        access = ("relay.process.app._Site",
                  '{client} "{method} {path}" {status} {bytes} in {duration_ms}ms',
                  dict(event="relay.http_access", request_id=rid, client="127.0.0.1",
                       method="POST", path="/v1/responses", status=200, bytes=898,
                       duration_ms=2.5, user_agent="wrk"))
    else:
        access = ("twisted.python.log", "{log_io}",
                  dict(log_io='"127.0.0.1" - - [30/Nov/2026:22:18:35 +0000] '
                              '"POST /v1/responses HTTP/1.1" 200 898 "-" "-"'))
    decision = ("relay.scheduling.scheduler.AccountScheduler",
                "account {selected_account_id} chosen by {layer} for {request_id}",
                dict(event="openai.account_schedule_decision", request_id=rid,
                     entrypoint="http", layer="load_balance", sticky_previous_hit=False,
                     sticky_session_hit=False, selected_account_id="a1",
                     selected_account_type="apikey", candidate_count=1, excluded_count=0,
                     wait_plan=None, latency_ms=0.135, load_skew=0.0, top_k=1,
                     sticky_busy_bypass=False, preferred_account_hit=False))
    finished = ("relay.engine.runner.TurnRunner",
                "turn {request_id} {outcome} with status {status} on {account_id}"
                " after {attempts} attempt(s)",
                dict(event="relay.turn_finished", request_id=rid, entrypoint="http",
                     endpoint="responses", client="bench", model="gpt-5.5",
                     outcome="completed", status=200, account_id="a1", attempts=1,
                     switches=0, duration_ms=6, first_output_ms=5,
                     upstream_request_id="req_e63c6c7ff7e5de539ec60762"))
    return [access, decision, finished]


def benchLogs(requests: int = 20_000) -> None:
    """
    The logging cost per relayed request: the lines one request writes
    (L{_requestEvents}) emitted through a L{Logger} into the observer
    C{--log-format text} and C{json} build (redaction included), writing
    to an in-memory file. Prints microseconds per request and bytes per
    request for each format.
    """
    import io

    from twisted.logger import Logger

    from relay.base.logs import observerFor

    class Source:
        """Stands in for the logging object (log_source)."""

    shapes = _requestEvents()
    for fmt in ("text", "json"):
        out = io.StringIO()
        observer = observerFor(fmt, out, secrets=["sk-relay-bench-secret"])
        loggers = [Logger(namespace=ns, source=Source(), observer=observer) for ns, _, _ in shapes]
        calls = [(log.info, f, kw) for log, (_, f, kw) in zip(loggers, shapes)]
        for info, f, kw in calls * 200:  # warm up
            info(f, **kw)
        out.seek(0)
        out.truncate()
        start = time.perf_counter()
        for _ in range(requests):
            for info, f, kw in calls:
                info(f, **kw)
        elapsed = time.perf_counter() - start
        size = len(out.getvalue().encode()) / requests
        print(f"logs {fmt}: {elapsed / requests * 1e6:.1f} us per request "
              f"({len(shapes)} lines, {size:.0f} bytes per request)")


def _free() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _wait(port: int, timeout: float = 15) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listening on {port}")


def _start(deltas: int):
    tmp = tempfile.mkdtemp(prefix="relay-bench-")
    eport, rport = _free(), _free()
    with open(os.path.join(tmp, "emu.yaml"), "w") as f:
        f.write(f'listen: "tcp:{eport}:interface=127.0.0.1"\n'
                f"default_script: {{text: '{'w ' * deltas}', deltas: {deltas}}}\n")
    accounts = [{"id": "a1", "type": "apikey", "base_url": f"http://127.0.0.1:{eport}/v1",
                 "api_key": "sk-bench", "concurrency": 0}]
    with open(os.path.join(tmp, "relay.yaml"), "w") as f:
        f.write(f'listen: "tcp:{rport}:interface=127.0.0.1"\n'
                'keys: [{name: bench, key: sk-relay-bench, concurrency: 0}]\n'
                f"accounts: {json.dumps(accounts)}\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    log = open(os.path.join(tmp, "log"), "wb")
    procs = [
        subprocess.Popen([sys.executable, "-m", "twisted", "relay-emulator", "--config",
                          os.path.join(tmp, "emu.yaml")], env=env, cwd=ROOT, stdout=log, stderr=log),
        subprocess.Popen([sys.executable, "-m", "twisted", "relay", "--config",
                          os.path.join(tmp, "relay.yaml"), "--log-format",
                          os.environ.get("RELAY_BENCH_LOG_FORMAT", "text")], env=env, cwd=ROOT,
                         stdout=open(os.path.join(tmp, "relay.log"), "wb"), stderr=log),
    ]
    _wait(eport)
    _wait(rport)
    return procs, eport, rport, tmp


def _stop(procs, tmp) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)


def benchHTTP(seconds: int = 10, connections: int = 32) -> None:  # noqa: C901
    """
    wrk against relay (non-streaming POST /v1/responses) and against the
    emulator alone. Both processes share this 2-core machine with wrk.
    The relay logs to a file in C{RELAY_BENCH_LOG_FORMAT} (text or json,
    default text); its CPU time per relayed request is printed too.
    """
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    procs, eport, rport, tmp = _start(deltas=1)
    try:
        lua = os.path.join(tmp, "post.lua")
        with open(lua, "w") as f:
            f.write('wrk.method = "POST"\n'
                    'wrk.body = \'{"model":"gpt-5.5","input":"hi"}\'\n'
                    'wrk.headers["Content-Type"] = "application/json"\n'
                    'wrk.headers["Authorization"] = "Bearer sk-relay-bench"\n')
        for name, port, path in (("emulator alone", eport, "/v1/responses"),
                                 ("through relay", rport, "/v1/responses")):
            cpu0 = _cpu(procs[1].pid)
            out = subprocess.run(
                ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", lua,
                 f"http://127.0.0.1:{port}{path}"], capture_output=True, text=True
            ).stdout
            rps = [line for line in out.splitlines() if "Requests/sec" in line]
            errors = [line for line in out.splitlines() if "Non-2xx" in line or "errors" in line]
            done = [line for line in out.splitlines() if "requests in" in line]
            count = int(done[0].split()[0]) if done else 0
            cpu = _cpu(procs[1].pid) - cpu0
            extra = (f"; relay CPU {cpu / count * 1e6:.0f} us per request"
                     if port == rport and count else "")
            print(f"http {name}: {rps[0].split()[-1] if rps else '?'} requests/s {errors}{extra}")
    finally:
        _stop(procs, tmp)


def _cpu(pid: int) -> float:
    """
    CPU seconds (user + system) a process has used so far.
    """
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def benchStream(deltas: int = 50_000) -> None:
    """
    One streaming turn with C{deltas} text deltas, read raw through relay.
    """
    procs, eport, rport, tmp = _start(deltas=deltas)
    try:
        body = json.dumps({"model": "gpt-5.5", "input": "hi", "stream": True}).encode()
        for name, port in (("emulator alone", eport), ("through relay", rport)):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer sk-relay-bench\r\nConnection: close\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            start = time.perf_counter()
            cpu0 = _cpu(procs[1].pid)
            total = 0
            events = 0
            tail = b""
            while True:
                data = s.recv(1 << 20)
                if not data:
                    break
                total += len(data)
                events += (tail + data).count(b"\n\n")
                tail = data[-1:]
            elapsed = time.perf_counter() - start
            cpu = _cpu(procs[1].pid) - cpu0
            extra = f"; relay CPU {cpu:.2f}s = {events / cpu:,.0f} events per relay CPU-second" if port == rport and cpu else ""
            print(f"stream {name}: ~{events} events, {total / 2**20:.1f} MiB in {elapsed:.2f}s "
                  f"= {events / elapsed:,.0f} events/s{extra}")
    finally:
        _stop(procs, tmp)


if __name__ == "__main__":
    which = sys.argv[1:] or ["pump"]
    for w in which:
        {"pump": benchPump, "http": benchHTTP, "stream": benchStream, "logs": benchLogs}[w]()
