"""
C{workers: N} (issue 16): real relay processes -- a supervisor and its
workers sharing one listening port with C{SO_REUSEPORT}, Redis state --
against the real emulator. Two workers both serve; a killed worker is
restarted; SIGTERM to the supervisor stops every worker and then the
supervisor; N > 1 with memory state is a one-line configuration error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import deferLater

from relay.emulator import Emulator
from tests.integration.redis_server import redisServer  # noqa: F401 (fixture)
from tests.integration.relayproc import ADMIN, KEY, RelayProcess, writeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _children(pid: int) -> list:
    """
    The pids of C{pid}'s live child processes.
    """
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """
    Whether C{pid} exists and is not a zombie.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _sockets(pid: int, port: int, state: str) -> int:
    """
    How many TCP sockets in C{state} (C{/proc/net/tcp} hex: C{01}
    established, C{0A} listening) with local port C{port} process C{pid}
    holds (its socket inodes matched against C{/proc/net/tcp}).
    """
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return 0
    count = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, inode = fields[1], fields[9]
            if fields[3] == state and int(local.split(":")[1], 16) == port and inode in inodes:
                count += 1
    return count


def _establishedOn(pid: int, port: int) -> int:
    """
    How many established TCP connections with local port C{port} C{pid} holds.
    """
    return _sockets(pid, port, "01")


async def _until(predicate, timeout: float, what: str) -> None:
    """
    Wait (polling the event, not sleeping a fixed time) until C{predicate()}.
    """
    deadline = reactor.seconds() + timeout
    while not predicate():
        if reactor.seconds() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await deferLater(reactor, 0.05, lambda: None)


def _account(emulator, accountId: str) -> dict:
    """
    An API-key account on the emulator.
    """
    return {"id": accountId, "type": "apikey", "base_url": emulator.baseURL("apikey"),
            "api_key": f"sk-workers-{accountId}", "concurrency": 0}


def _writeWorkersConfig(relay: RelayProcess, accounts: list, redisURL: str, workers: int = 2,
                        extra: str = "") -> None:
    """
    (Re)write C{relay}'s configuration: C{workers} workers on Redis state.
    """
    writeConfig(relay.config, relay.port, accounts,
                extra=f"workers: {workers}\nstate: {{backend: redis, redis_url: '{redisURL}'}}\n"
                + extra)


async def _startWorkers(tmp: str, emulator, redisURL: str, workers: int = 2,
                        extra: str = "") -> RelayProcess:
    path = os.path.join(tmp, "relay.yaml")
    relay = RelayProcess(config=path, log=os.path.join(tmp, "relay.log"))
    _writeWorkersConfig(relay, [_account(emulator, "a1")], redisURL, workers, extra)
    relay.start()
    await relay.waitHealthy()
    await _until(lambda: len(_children(relay.process.pid)) == workers, 20, "the workers")
    for pid in _children(relay.process.pid):
        await _until(lambda pid=pid: _listening(pid, relay.port), 20, f"worker {pid} listening")
    return relay


def _listening(pid: int, port: int) -> bool:
    """
    Whether C{pid} holds a listening socket on C{port}.
    """
    return _sockets(pid, port, "0A") > 0


def _servedBy(client: socket.socket, workers: list, port: int) -> int | None:
    """
    The worker (of C{workers}) that accepted C{client}'s connection to
    C{port}, found by the connection's addresses in C{/proc/net/tcp}, or
    L{None} while none has accepted it yet.
    """
    clientPort = client.getsockname()[1]
    ours = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if (int(local.split(":")[1], 16) == port
                    and int(remote.split(":")[1], 16) == clientPort):
                ours.add(inode)
    for pid in workers:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in ours:
                return pid
    return None


def _accountsByWorker(port: int, workers: list, attempts: int = 60) -> dict:
    """
    C{GET /admin/accounts} on new connections until every one of
    C{workers} has answered at least twice (blocking; run in a thread).

    @return: worker pid -> the list of account-id sets it answered.
    """
    import time

    answers = {pid: [] for pid in workers}
    for _ in range(attempts):
        if all(len(a) >= 2 for a in answers.values()):
            break
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            deadline = time.monotonic() + 5
            pid = _servedBy(s, workers, port)
            while pid is None and time.monotonic() < deadline:
                time.sleep(0.01)
                pid = _servedBy(s, workers, port)
            assert pid is not None, "no worker accepted the connection"
            s.sendall(b"GET /admin/accounts HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer "
                      + ADMIN.encode() + b"\r\nConnection: close\r\n\r\n")
            data = b""
            while True:
                part = s.recv(65536)
                if not part:
                    break
                data += part
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == b"200", data
        answers[pid].append({a["id"] for a in json.loads(body)["accounts"]})
    assert all(len(a) >= 2 for a in answers.values()), answers
    return answers


async def _inThread(f, *args):
    from twisted.internet.threads import deferToThread

    return await deferToThread(f, *args)


def _post(port: int) -> tuple:
    """
    One JSON turn on a new connection, blocking (run in a thread).
    """
    body = json.dumps({"model": "gpt-5.5", "input": "hi"}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        data = b""
        while True:
            part = s.recv(65536)
            if not part:
                break
            data += part
    return int(data.split(b" ", 2)[1]), data


@pytest_twisted.ensureDeferred
async def test_two_workers_serve_and_a_killed_one_is_restarted(redisServer):  # noqa: F811
    """
    With C{workers: 2} both workers accept connections on the one port
    (held keep-alive connections land on both), turns succeed through
    them, and a worker killed with SIGKILL is replaced by a new process
    that serves too. Without the supervisor's restart the child count
    stays at one.
    """
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-workers-")
    relay = None
    held = []
    try:
        relay = await _startWorkers(tmp, emulator, redisServer.url)
        workers = _children(relay.process.pid)
        assert len(workers) == 2 and workers[0] != relay.process.pid
        # SO_REUSEPORT spreads connections by their address hash: 24 held
        # connections all landing on one worker has odds of 2**-23.
        for _ in range(24):
            held.append(socket.create_connection(("127.0.0.1", relay.port)))
        await _until(lambda: sum(_establishedOn(p, relay.port) for p in workers) == 24, 10,
                     "the held connections to be accepted")
        counts = [_establishedOn(p, relay.port) for p in workers]
        assert all(c > 0 for c in counts), counts
        for s in held:
            s.close()
        held.clear()

        results = await gatherResults(
            [Deferred.fromCoroutine(_threaded(relay.port)) for _ in range(8)])
        assert [code for code, _ in results] == [200] * 8, results

        victim = workers[0]
        os.kill(victim, signal.SIGKILL)
        await _until(lambda: victim not in _children(relay.process.pid)
                     and len(_children(relay.process.pid)) == 2, 20, "the restarted worker")
        replacement = [p for p in _children(relay.process.pid) if p not in workers]
        assert len(replacement) == 1
        await _until(lambda: _listening(replacement[0], relay.port), 20, "the new worker listening")
        results = await gatherResults(
            [Deferred.fromCoroutine(_threaded(relay.port)) for _ in range(8)])
        assert [code for code, _ in results] == [200] * 8, results
        assert "relay.worker_exited" in relay.tail(20000) or "exited" in relay.tail(20000)
    finally:
        for s in held:
            s.close()
        if relay is not None:
            relay.stop()
        await emulator.stop()


async def _threaded(port: int):
    from twisted.internet.threads import deferToThread

    return await deferToThread(_post, port)


@pytest_twisted.ensureDeferred
async def test_sigterm_stops_every_worker_then_the_supervisor(redisServer):  # noqa: F811
    """
    SIGTERM to the supervisor reaches every worker; each drains and exits
    cleanly (status 0, not a SIGKILL) and the supervisor exits 0 after
    them (issues 14 and 16).
    """
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-workers-")
    relay = None
    try:
        relay = await _startWorkers(tmp, emulator, redisServer.url)
        workers = _children(relay.process.pid)
        relay.process.send_signal(signal.SIGTERM)
        code = await relay.waitExit(30)
        assert code == 0, code  # issue 14: SIGTERM is a clean stop
        for pid in workers:
            assert not _alive(pid), f"worker {pid} outlived its supervisor"
        log = relay.tail(20000)
        assert log.count("relay.worker_stopped") == 2, log
        assert "signal 9" not in log and "relay.worker_exited" not in log, log
    finally:
        if relay is not None:
            relay.stop()
        await emulator.stop()


@pytest_twisted.ensureDeferred
async def test_sighup_to_the_supervisor_reloads_every_worker(redisServer):  # noqa: F811
    """
    C{kill -HUP <supervisor>} after an account was added to the file: the
    supervisor stays up (no handler made SIGHUP's default action kill it,
    and the workers with it), forwards the signal, and both workers (told
    apart by which pid accepted each connection) then list the new
    account; no worker was restarted.
    """
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-workers-")
    relay = None
    try:
        relay = await _startWorkers(tmp, emulator, redisServer.url)
        workers = _children(relay.process.pid)
        before = await _inThread(_accountsByWorker, relay.port, workers)
        assert all(s == {"a1"} for a in before.values() for s in a), before

        _writeWorkersConfig(relay, [_account(emulator, "a1"), _account(emulator, "a2")],
                            redisServer.url)
        relay.process.send_signal(signal.SIGHUP)
        await _until(lambda: relay.tail(50000).count("relay.config_reloaded") == 2
                     or relay.process.poll() is not None, 15, "both workers to reload")
        assert relay.process.poll() is None, relay.tail()
        after = await _inThread(_accountsByWorker, relay.port, workers)
        assert all(s == {"a1", "a2"} for a in after.values() for s in a), after
        assert sorted(_children(relay.process.pid)) == sorted(workers)
        log = relay.tail(50000)
        assert "relay.workers_reload_forwarded" in log, log
        assert "relay.worker_exited" not in log, log
    finally:
        if relay is not None:
            relay.stop()
        await emulator.stop()


async def _adminReload(relay: RelayProcess) -> tuple:
    """
    C{POST /admin/reload} on a new connection (one worker answers).

    @return: C{(status, JSON answer)}.
    """
    import treq

    r = await treq.post(relay.url + "/admin/reload", b"",
                        headers={"Authorization": [f"Bearer {ADMIN}"]}, persistent=False)
    return r.code, json.loads(await r.content())


@pytest_twisted.ensureDeferred
async def test_admin_reload_reaches_every_worker(redisServer):  # noqa: F811
    """
    C{POST /admin/reload}, answered by one worker with its own result, has
    the other worker reload the same file too (through the supervisor):
    both then list the added account, and each reloaded once. A bad file
    is refused by the worker asked and not forwarded. Each worker's JSON
    log lines carry its index as C{worker}; the supervisor's do not.
    """
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    tmp = tempfile.mkdtemp(prefix="relay-workers-")
    relay = None
    try:
        jsonLog = "log: {format: json}\n"
        relay = await _startWorkers(tmp, emulator, redisServer.url, extra=jsonLog)
        workers = _children(relay.process.pid)
        a1, a2 = _account(emulator, "a1"), _account(emulator, "a2")
        _writeWorkersConfig(relay, [a1, a2], redisServer.url, extra=jsonLog)
        code, answer = await _adminReload(relay)
        assert code == 200 and answer["changes"]["accounts"]["added"] == ["a2"], answer
        assert answer["refused"] == [], answer

        def reloaded():
            return relay.tail(100000).count("relay.config_reloaded")

        await _until(lambda: reloaded() >= 2, 15, "the other worker to reload")
        after = await _inThread(_accountsByWorker, relay.port, workers)
        assert all(s == {"a1", "a2"} for a in after.values() for s in a), after
        assert reloaded() == 2, relay.tail()
        # Every worker line names its worker; the supervisor's lines do not.
        records = [json.loads(line) for line in relay.tail(100000).splitlines()
                   if line.startswith("{")]
        byEvent = {}
        for record in records:
            byEvent.setdefault(record["event"], []).append(record)
        assert sorted(r["worker"] for r in byEvent["relay.config_reloaded"]) == [0, 1], records
        [forwarded] = byEvent["relay.workers_reload_forwarded"]
        assert "worker" not in forwarded and forwarded["signalled"] == 1, forwarded
        assert all("worker" not in r for r in byEvent["relay.worker_started"]), records
        assert {r.get("worker") for r in records} == {None, 0, 1}

        # A bad file: refused where asked, not forwarded. The good reload
        # after it is forwarded; the forwards arrive in order, so a
        # forwarded bad one would have been refused by the other worker
        # before it reloads the good one.
        with open(relay.config, "a") as f:
            f.write("gateway: {max_account_switches: lots}\n")
        code, answer = await _adminReload(relay)
        assert code == 400 and answer["applied"] is False, answer
        _writeWorkersConfig(relay, [a1], redisServer.url, extra=jsonLog)
        code, answer = await _adminReload(relay)
        assert code == 200 and answer["changes"]["accounts"]["removed"] == ["a2"], answer
        await _until(lambda: reloaded() >= 4, 15, "both workers to reload again")
        log = relay.tail(100000)
        assert log.count("relay.config_reload_failed") == 1, log
        assert log.count("relay.workers_reload_forwarded") == 2, log
        after = await _inThread(_accountsByWorker, relay.port, workers)
        assert all(s == {"a1"} for a in after.values() for s in a), after
        assert sorted(_children(relay.process.pid)) == sorted(workers)
    finally:
        if relay is not None:
            relay.stop()
        await emulator.stop()


def _runToExit(args: list, cwd: str) -> tuple:
    process = subprocess.run(
        [sys.executable, "-m", "twisted", "relay", *args], check=False, cwd=cwd,
        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60,
    )
    return process.returncode, process.stderr, process.stdout


def test_workers_with_memory_state_is_a_config_error():
    """
    C{workers: 2} (or C{--workers 2}) with C{state.backend: memory} exits
    with status 2 and one line naming C{workers}; no process is started.
    """
    tmp = tempfile.mkdtemp(prefix="relay-workers-")
    path = os.path.join(tmp, "relay.yaml")
    accounts = [{"id": "a1", "type": "apikey", "base_url": "http://127.0.0.1:9/v1",
                 "api_key": "sk-workers-a1"}]
    writeConfig(path, 0, accounts, extra="workers: 2\n")
    code, err, out = _runToExit(["--config", path], tmp)
    assert code == 2, (code, err, out)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("relay: config error: workers: "), err
    assert "state.backend: redis" in lines[0]
    assert "Traceback" not in err + out

    writeConfig(path, 0, accounts)
    code, err, out = _runToExit(["--config", path, "--workers", "2"], tmp)
    assert code == 2, (code, err, out)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("relay: config error: workers: "), err
