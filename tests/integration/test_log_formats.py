"""
Issue 15: relay's logs as a real process writes them (both runners,
C{python -m twisted relay} and C{twistd -n relay}), and the pid files of
the two twistd plugins started side by side.

JSON: every line of a real relay's log -- start-up, a turn that fails over,
relay's own error answers, shutdown -- parses with C{json.loads} into one
flat object whose first keys are C{time}, C{level}, C{event}, C{message},
C{request_id}, with nothing of Twisted's internals, and C{relay-report}
reads the file. Text: every line shows its time (ISO-8601 UTC), its event
name and level, and the request id on the lines of a turn; times inside
messages are ISO-8601 too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue

from relay.emulator import Emulator
from relay.base.logs import JSON_FIXED_KEYS
from tests.integration.harness import closedPort
from tests.integration.test_twistd import (
    ACCOUNT_KEY,
    CLIENT_KEY,
    Collector,
    environment,
    removeConfig,
    runners,
    startRelay,
    stopRelay,
    writeConfig,
)

BAD_KEY = "sk-emu-logformat-bad-0123456789"

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \[(?P<name>[^\]#\s]+)#(?P<level>[a-z]+)"
    r"(?: req=(?P<req>[A-Za-z0-9._:\-]+))?\] "
)
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
TWISTED_INTERNALS = ("log_logger", "log_format", "log_namespace", "__class_uuid__",
                     "unpersistable", "log_source", "log_time", "log_level")


def failoverConfig(emulatorPort: int) -> str:
    """
    Two accounts on the emulator: C{bad} (preferred, made to answer 503)
    and C{a1}.
    """
    base = f"http://127.0.0.1:{emulatorPort}/v1"
    return (
        'listen: "tcp:0:interface=127.0.0.1"\n'
        f"keys: [{{name: t, key: {CLIENT_KEY}}}]\n"
        "accounts:\n"
        f'  - {{id: bad, type: apikey, api_key: {BAD_KEY}, base_url: "{base}", priority: 1}}\n'
        f'  - {{id: a1, type: apikey, api_key: {ACCOUNT_KEY}, base_url: "{base}",'
        " priority: 50}\n"
    )


async def _traffic(url: str) -> None:
    """
    Two turns that fail over (the second puts C{bad} in a cooldown, R11),
    relay's 401 and 404, then let the lines out.
    """
    auth = {"Authorization": [f"Bearer {CLIENT_KEY}"], "Content-Type": ["application/json"]}
    for n in range(2):
        response = await treq.post(
            url + "/v1/responses",
            json.dumps({"model": "gpt-5.5", "input": f"hi {n}", "stream": True}).encode(),
            headers={**auth, "X-Request-Id": [f"logfmt-{n}"]}, persistent=False,
        )
        await response.content()
        assert response.code == 200
    for path, headers in (("/v1/responses", {}), ("/nowhere", auth)):
        response = await treq.post(url + path, b"{}", headers=headers, persistent=False)
        await response.content()
    await deferLater(reactor, 0.3, lambda: None)  # the access lines of the last answers


async def _runRelay(runner: str, fmt: str):
    """
    A relay process logging C{fmt}, given L{_traffic}.

    @return: its whole output (stdout and stderr).
    """
    emulator = Emulator(reactor=reactor, config={})
    await emulator.listen(reactor)
    emulator.setFault(BAD_KEY, {"kind": "status", "code": 503})
    path = writeConfig(failoverConfig(emulator.port))
    try:
        collector, process, url = await startRelay(runner, path, "--log-format", fmt)
        try:
            await _traffic(url)
        finally:
            await stopRelay(collector, process)
    finally:
        removeConfig(path)
        await emulator.stop()
    return collector.text


@runners
@pytest_twisted.ensureDeferred
async def test_every_json_line_is_one_flat_object(runner, tmp_path):
    """
    Issue 15 "done when": every line of a real relay's JSON log parses with
    C{json.loads} into an object whose keys start with C{time} (ISO-8601
    UTC), C{level}, C{event}, C{message}, C{request_id}, holding none of
    Twisted's internals; the turn's lines carry relay's id (also the
    cooldown health wrote without knowing the turn, with its C{until} in
    ISO-8601 in the message) and its end the client's as
    C{client_request_id} (R111); C{relay-report} and C{jq} read the file.
    """
    output = await _runRelay(runner, "json")
    lines = [line for line in output.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, or this raises
    assert len(records) > 10
    for record in records:
        assert isinstance(record, dict)
        assert list(record)[:5] == list(JSON_FIXED_KEYS), record
        assert ISO.match(record["time"]), record
        assert record["level"] in ("debug", "info", "warn", "error", "critical"), record
        assert isinstance(record["event"], str) and record["event"], record
        assert isinstance(record["message"], str), record
    for internal in TWISTED_INTERNALS:
        assert internal not in output, internal
    byEvent = {}
    for record in records:
        byEvent.setdefault(record["event"], []).append(record)
    finished = byEvent["relay.turn_finished"]
    assert [r["client_request_id"] for r in finished] == ["logfmt-0", "logfmt-1"]
    second = finished[1]["request_id"]
    assert second.startswith("req_") and finished[0]["request_id"] != second
    (cooldown,) = byEvent["relay.account_cooldown_set"]
    assert cooldown["request_id"] == second
    assert re.search(r"until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", cooldown["message"])
    assert isinstance(cooldown["until"], float)
    access = byEvent["relay.http_access"]
    assert {r["status"] for r in access} >= {200, 401, 404}
    assert all(r["request_id"] for r in access)
    log = tmp_path / "relay.json.log"
    log.write_text(output)
    out, err, code = await getProcessOutputAndValue(
        sys.executable, ["-m", "relay.console.report", str(log), "--json"],
        env=environment(), reactor=reactor,
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["events"]["relay.turn_finished"] == 2
    assert report["events"]["openai.upstream_failover_switching"] == 2
    jq = shutil.which("jq")
    if jq is not None:  # CI installs it (.ci/run)
        out, err, code = await getProcessOutputAndValue(
            jq, ["-r", f'select(.request_id == "{second}") | .event', str(log)],
            env=environment(), reactor=reactor,
        )
        assert code == 0, err
        events = out.decode().split()
        assert events[-1] == "relay.turn_finished" and "relay.account_cooldown_set" in events


@runners
@pytest_twisted.ensureDeferred
async def test_text_lines_show_event_and_request_id(runner):
    """
    Issue 15: every text line starts with an ISO-8601 UTC time and
    C{[<event>#<level>]}, the turn's lines add C{req=<id>}, and the names
    the README tells operators to watch appear; times in messages are
    ISO-8601, not epoch floats.
    """
    output = await _runRelay(runner, "text")
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("\t")]
    parsed = [TEXT_LINE.match(line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed) if not m]
    names = {m["name"] for m in parsed}
    for name in ("openai.upstream_failover_switching", "relay.account_cooldown_set",
                 "relay.turn_finished", "relay.http_access"):
        assert name in names, names
    turnLines = [m for m in parsed if m["name"] == "relay.turn_finished"]
    ids = [m["req"] for m in turnLines]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("req_") for i in ids), ids
    cooldown = next(line for line in lines if "[relay.account_cooldown_set#" in line)
    assert f" req={ids[1]}] " in cooldown
    assert re.search(r"until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", cooldown), cooldown
    assert not re.search(r"until \d{10}\.\d", output)


@pytest_twisted.ensureDeferred
async def test_twistd_relay_and_emulator_side_by_side():
    """
    Issue 15: C{twistd -n relay} and C{twistd -n relay-emulator} started
    from one directory without C{--pidfile} both run (each writes its own
    pid file, C{relay.pid} and C{relay-emulator.pid}, not C{twistd.pid}).
    """
    directory = tempfile.mkdtemp(prefix="relay-pidfiles-")
    emulatorPort = closedPort()
    twistd = ["-c", "from twisted.scripts.twistd import run; run()", "-n"]
    emulator = Collector()
    emulatorProcess = reactor.spawnProcess(
        emulator, sys.executable,
        [sys.executable, *twistd, "relay-emulator", "--port", str(emulatorPort)],
        env=environment(), path=directory,
    )
    path = os.path.join(directory, "relay.yaml")
    Path(path).write_text(failoverConfig(emulatorPort), encoding="utf-8")
    relayPort = closedPort()
    relay = Collector()
    relayProcess = reactor.spawnProcess(
        relay, sys.executable,
        [sys.executable, *twistd, "relay", "--config", path,
         "--listen", f"tcp:{relayPort}:interface=127.0.0.1"],
        env=environment(), path=directory,
    )
    try:
        for _ in range(150):
            if relay.ended.called or emulator.ended.called:
                break
            if {"relay.pid", "relay-emulator.pid"} <= set(os.listdir(directory)):
                try:
                    response = await treq.get(
                        f"http://127.0.0.1:{relayPort}/healthz", timeout=1, persistent=False
                    )
                    await response.content()
                    if response.code == 200:
                        break
                except Exception:  # noqa: BLE001, S110 - not listening yet
                    pass
            await deferLater(reactor, 0.1, lambda: None)
        assert not relay.ended.called, relay.text
        assert not emulator.ended.called, emulator.text
        files = set(os.listdir(directory))
        assert {"relay.pid", "relay-emulator.pid"} <= files, files
        assert "twistd.pid" not in files
    finally:
        await stopRelay(relay, relayProcess)
        await stopRelay(emulator, emulatorProcess)
        removeConfig(path)
