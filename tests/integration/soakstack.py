"""
The chaos soak's processes (issue 14): one bundled emulator process in chaos mode
(L{relay.emulator.chaos}), two relay processes with JSON logs on one real C{redis-server},
and the operations the soak performs on them while clients run (Redis restarts, a
C{SIGHUP} reload, a C{SIGTERM} restart). Only the PIDs of the children started here are
ever signalled.

Accounts: three API-key accounts (C{a1}-C{a3}) serve both models, two OAuth accounts
(C{o1}, C{o2}) only L{MODEL} (the chained HTTP conversations use L{CHAIN_MODEL}, which needs
an API-key account, R42). WebSocket modes: relay 0 defaults to C{ctx_pool}, relay 1 to
C{passthrough}, and C{a3} and C{o2} are C{http_bridge} on both, so WebSocket turns meet all
three modes. The new configuration (C{a4} added, C{a2}'s priority and C{o2}'s concurrency
changed) is written for both relays; relay 0 reads it on C{SIGHUP}, relay 1 when restarted.
OAuth access tokens live L{TOKEN_TTL} seconds, so both relays refresh them mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import treq
import yaml
from attrs import define, field
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from relay.emulator import Emulator
from tests.integration.redis_server import RedisServer, freePort
from tests.integration.relayproc import ROOT, RelayProcess
from tests.integration.soakclients import CHAIN_MODEL, KEY, MODEL

ADMIN = "admin-soak-0000000"
SECRET = "soak-emulator-secret-0123456789abcdef"
APIKEYS = ("a1", "a2", "a3")
OAUTH = ("o1", "o2")
CONCURRENCY = {"a1": 8, "a2": 8, "a3": 6, "a4": 6, "o1": 6, "o2": 6}
BRIDGED = ("a3", "o2")
TOKEN_TTL = 40
"""Seconds an OAuth access token lives: with L{REFRESH_MARGIN}, each relay refreshes the OAuth
tokens during the run (two processes sharing the refresh lock and the records in Redis, across
the Redis restarts and the relay restart)."""
REFRESH_MARGIN = 20

FAULTS = [
    # Every kind the emulator can inject, weighted; see relay.emulator.chaos. Status faults
    # are lighter than their share of kinds: R11 blocks and R12 rate limits park accounts
    # for seconds, and a soak that only answers "no account" exercises little else.
    {"weight": 1, "kind": "status", "preset": "unavailable"},
    {"weight": 0.5, "kind": "status", "preset": "server_error"},
    {"weight": 0.5, "kind": "status", "preset": "overloaded"},
    {"weight": 0.5, "kind": "status", "preset": "usage_limit", "resets_in_seconds": 3},
    {"weight": 0.5, "kind": "status", "preset": "rate_limit"},
    {"weight": 1, "kind": "reset_before_headers"},
    {"weight": 0.5, "kind": "hang_before_headers"},
    {"weight": 0.5, "kind": "hang_after_headers"},
    {"weight": 1, "kind": "cut_after_events", "events": 2},
    {"weight": 1, "kind": "cut_after_events", "events": 6},
    {"weight": 0.5, "kind": "stall_after_events", "events": 1, "seconds": 6},
    {"weight": 1, "kind": "delay_first_output", "seconds": 1.5},
    {"weight": 0.5, "kind": "end_after_events", "events": 2},
    {"weight": 0.5, "kind": "end_after_events", "events": 6},
    {"weight": 0.5, "kind": "stream_error", "code": "server_error"},
    {"weight": 1, "kind": "ws_handshake_status", "code": 503},
    {"weight": 0.5, "kind": "ws_handshake_reset"},
    {"weight": 0.5, "kind": "ws_handshake_hang"},
]

GATEWAY = {
    "max_account_switches": 3,
    "transport_error_cooldown_seconds": 5,
    "shutdown_grace_seconds": 5,
    "breaker": {"failures": 3, "window_seconds": 10, "open_seconds": 2,
                "max_open_seconds": 5},
    "scheduling": {"fallback_wait_timeout": 8, "sticky_session_wait_timeout": 8,
                   "ping_interval": 5},
    "upstream": {"connect_timeout_seconds": 3, "header_timeout_seconds": 4,
                 "stream_idle_timeout_seconds": 4},
}


def emulatorConfig(port: int, seed: int, rate: float) -> dict:
    """
    The emulator's configuration: the soak's accounts, a streamed text reply, chaos.
    """
    accounts = [{"name": a, "credential": f"sk-soak-{a}"} for a in (*APIKEYS, "a4")]
    accounts += [{"name": o, "type": "oauth", "refresh_token": f"rt-{o}-0",
                  "chatgpt_account_id": f"acct-{o}"} for o in OAUTH]
    return {
        "listen": f"tcp:{port}:interface=127.0.0.1",
        "accept_any": False,
        "oauth": {"access_token_ttl": TOKEN_TTL, "secret": SECRET},
        "default_script": {"text": "soak answer from {credential_name} to {input}",
                           "delay": 0.03, "deltas": 6},
        "accounts": accounts,
        "chaos": {"seed": seed, "rate": rate, "handshake_rate": 0.15, "faults": FAULTS},
    }


def relayConfig(port: int, emulatorPort: int, redisURL: str, mode: str, tokens: dict,
                reloaded: bool = False) -> dict:
    """
    One relay's configuration. C{reloaded} is the file the C{SIGHUP} reads: C{a4} added,
    C{a2}'s priority and C{o2}'s concurrency changed (its pooled upstream WebSockets are
    retired).
    """
    base = f"http://127.0.0.1:{emulatorPort}"
    accounts = []
    for a in APIKEYS + (("a4",) if reloaded else ()):
        accounts.append({
            "id": a, "type": "apikey", "base_url": base + "/v1", "api_key": f"sk-soak-{a}",
            "concurrency": CONCURRENCY[a], "models": [MODEL, CHAIN_MODEL],
            "priority": 10 if (reloaded and a == "a2") else 50,
        })
    for o in OAUTH:
        accounts.append({
            "id": o, "type": "oauth", "base_url": base + "/backend-api/codex",
            "access_token": tokens[o], "refresh_token": f"rt-{o}-0",
            "chatgpt_account_id": f"acct-{o}", "auth_base_url": base,
            "concurrency": CONCURRENCY[o] - (2 if (reloaded and o == "o2") else 0),
            "models": [MODEL],
        })
    for account in accounts:
        if account["id"] in BRIDGED:
            account["ws_mode"] = "http_bridge"
    gateway = dict(GATEWAY, websocket={"mode_default": mode},
                   oauth={"auth_base_url": base, "refresh_margin_seconds": REFRESH_MARGIN})
    return {
        "listen": f"tcp:{port}:interface=127.0.0.1",
        "admin_key": ADMIN,
        "log": {"format": "json"},
        "keys": [{"name": "soak", "key": KEY, "concurrency": 0}],
        "accounts": accounts,
        "gateway": gateway,
        "state": {"backend": "redis", "redis_url": redisURL, "on_redis_error": "fail_open"},
    }


def vmHWM(pid: int) -> int:
    """
    A process's peak resident set size (C{VmHWM} in C{/proc/<pid>/status}) in KiB.
    """
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


@define(eq=False)
class SoakStack:
    """
    The soak's processes.

    @ivar tmp: the working directory (configs, logs).
    @ivar seed: the soak's seed (the emulator's chaos seed).
    @ivar rate: the chaos fault rate.
    @ivar relayLogs: per relay, its log files (a restart starts a new one).
    @ivar peakKiB: per relay process started, C{(relay index, pid, VmHWM KiB)}.
    @ivar events: C{(time, what)} of the operations performed.
    """

    tmp: str
    seed: int
    rate: float
    redis: RedisServer = field(factory=RedisServer)
    emulatorPort: int = field(factory=freePort)
    relays: list = field(factory=list)
    relayLogs: list = field(factory=list)
    peakKiB: list = field(factory=list)
    events: list = field(factory=list)
    emulator: subprocess.Popen = None
    tokens: dict = field(factory=dict)

    @property
    def emulatorURL(self) -> str:
        """
        The emulator's root URL.
        """
        return f"http://127.0.0.1:{self.emulatorPort}"

    @property
    def emulatorLog(self) -> str:
        """
        The emulator's log file.
        """
        return os.path.join(self.tmp, "emulator.log")

    def _configPath(self, index: int) -> str:
        return os.path.join(self.tmp, f"relay{index}.yaml")

    def _writeRelayConfig(self, index: int, port: int, reloaded: bool = False) -> None:
        mode = ("ctx_pool", "passthrough")[index]
        config = relayConfig(port, self.emulatorPort, self.redis.url, mode, self.tokens,
                             reloaded)
        with open(self._configPath(index), "w") as f:
            yaml.safe_dump(config, f)

    async def start(self) -> None:
        """
        Start Redis, the emulator and two relays; wait until all answer.
        """
        self.redis.start()
        config = emulatorConfig(self.emulatorPort, self.seed, self.rate)
        path = os.path.join(self.tmp, "emulator.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        minter = Emulator(reactor=reactor, config=dict(config, listen=None, chaos=None))
        self.tokens = {o: minter.mintAccessToken(o, TOKEN_TTL) for o in OAUTH}
        self.emulator = subprocess.Popen(
            [sys.executable, "-m", "twisted", "relay-emulator", "--config", path],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
            stdout=open(self.emulatorLog, "ab"), stderr=subprocess.STDOUT,
        )
        for index in (0, 1):
            port = freePort()
            self._writeRelayConfig(index, port)
            self.relays.append(None)
            self.relayLogs.append([])
            self._startRelay(index, port)
        await self._waitEmulator()
        for relay in self.relays:
            await relay.waitHealthy(30)

    def _startRelay(self, index: int, port: int) -> None:
        log = os.path.join(self.tmp, f"relay{index}-{len(self.relayLogs[index])}.log")
        relay = RelayProcess(config=self._configPath(index), log=log, port=port)
        relay.start()
        self.relays[index] = relay
        self.relayLogs[index].append(log)

    async def _waitEmulator(self, timeout: float = 30.0) -> None:
        deadline = reactor.seconds() + timeout
        while reactor.seconds() < deadline:
            if self.emulator.poll() is not None:
                raise AssertionError("emulator exited: " + _tail(self.emulatorLog))
            try:
                r = await treq.get(self.emulatorURL + "/_emulator/stats", persistent=False)
                await r.content()
                if r.code == 200:
                    return
            except Exception:
                pass
            await deferLater(reactor, 0.1, lambda: None)
        raise AssertionError("emulator did not start: " + _tail(self.emulatorLog))

    @property
    def urls(self) -> list:
        """
        The relays' base URLs, by index.
        """
        return [relay.url for relay in self.relays]

    def note(self, what: str) -> None:
        """
        Record an operation with its time (for the figures and the checks).
        """
        self.events.append((reactor.seconds(), what))

    # -- operations during the run ---------------------------------------------------------

    async def restartRedis(self, down: float = 1.0) -> None:
        """
        Kill Redis (SIGKILL, nothing saved) and start it again on the same port.
        """
        self.note("redis killed")
        await deferToThread(self.redis.stop)
        await deferLater(reactor, down, lambda: None)
        await deferToThread(self.redis.start)
        self.note("redis started")

    def reload(self, index: int) -> None:
        """
        Roll out the new configuration (see L{relayConfig}'s C{reloaded}) to both relays'
        files, as an operator would, and send relay C{index} C{SIGHUP}; the other relay reads
        it when it is restarted.
        """
        for each, relay in enumerate(self.relays):
            self._writeRelayConfig(each, relay.port, reloaded=True)
        os.kill(self.relays[index].process.pid, signal.SIGHUP)
        self.note(f"relay {index} SIGHUP")

    async def restartRelay(self, index: int) -> int:
        """
        C{SIGTERM} relay C{index}, wait for it to exit, start it again on the same port.

        @return: its exit code.
        """
        relay = self.relays[index]
        self.peakKiB.append((index, relay.process.pid, vmHWM(relay.process.pid)))
        relay.process.send_signal(signal.SIGTERM)
        self.note(f"relay {index} SIGTERM")
        code = await relay.waitExit(60)
        self.note(f"relay {index} exited {code}")
        self._startRelay(index, relay.port)
        await self.relays[index].waitHealthy(30)
        self.note(f"relay {index} started again")
        return code

    # -- afterwards ------------------------------------------------------------------------

    def recordPeaks(self) -> None:
        """
        Record the peak RSS of the relays running now.
        """
        for index, relay in enumerate(self.relays):
            if relay.process.poll() is None:
                self.peakKiB.append((index, relay.process.pid, vmHWM(relay.process.pid)))

    async def ledger(self) -> dict:
        """
        The emulator's turn ledger (C{GET /_emulator/turns}).
        """
        r = await treq.get(self.emulatorURL + "/_emulator/turns", persistent=False)
        return json.loads(await r.content())

    async def inflight(self) -> dict:
        """
        Upstream turns the emulator still has in flight, per account name (C{GET
        /_emulator/stats}); only non-zero counts.
        """
        r = await treq.get(self.emulatorURL + "/_emulator/stats", persistent=False)
        stats = json.loads(await r.content())
        return {name: v["inflight"] for name, v in stats.items() if v["inflight"]}

    async def oauthStats(self) -> dict:
        """
        The emulator's token endpoint counters (C{GET /_emulator/oauth}): per account
        C{token_requests}, C{refreshes}, C{reuse_attempts}.
        """
        r = await treq.get(self.emulatorURL + "/_emulator/oauth", persistent=False)
        return json.loads(await r.content())["accounts"]

    def redisKeys(self, pattern: str) -> list:
        """
        The keys matching C{pattern} (C{redis-cli --scan}).
        """
        out = subprocess.run(["redis-cli", "-p", str(self.redis.port), "--scan", "--pattern",
                              pattern], capture_output=True, timeout=10, check=True)
        return out.stdout.decode().split()

    def redisCommand(self, *args: str) -> str:
        """
        Run one C{redis-cli} command; its output, stripped.
        """
        out = subprocess.run(["redis-cli", "-p", str(self.redis.port), *args],
                             capture_output=True, timeout=10, check=True)
        return out.stdout.decode().strip()

    def stopEmulator(self) -> None:
        """
        Stop the emulator (SIGTERM, then SIGKILL after 10 s); its log is complete afterwards.
        """
        if self.emulator is not None and self.emulator.poll() is None:
            self.emulator.terminate()
            try:
                self.emulator.wait(10)
            except subprocess.TimeoutExpired:
                self.emulator.kill()
                self.emulator.wait()

    def stop(self) -> None:
        """
        Stop every child (SIGTERM, then SIGKILL after 10 s), by its own PID.
        """
        for relay in self.relays:
            if relay is not None:
                relay.stop()
        self.stopEmulator()
        self.redis.cleanup()


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""
