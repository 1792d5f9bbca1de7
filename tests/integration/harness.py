"""
Real-socket test harness: the bundled emulator and a relay, both on
127.0.0.1 with port 0, wired with the real dialer (treq), so tests exercise
the production code paths against loopback (DEVELOPERS.md).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile

import treq
from attrs import define, evolve, field
from twisted.internet import reactor
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import deferLater

from relay.process.app import buildApplication
from relay.configuration.parse import settingsFromString
from relay.emulator import Emulator

RELAY_KEY = "sk-relay-test"


def closedPort() -> int:
    """
    A loopback port with nothing listening (connection refused, not faked).
    """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@define(eq=False)
class Stack:
    """
    A running emulator + relay pair.
    """

    emulator: Emulator
    app: object = None
    port: object = None
    extraPorts: list = field(factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port.getHost().port}"

    def post(self, path: str, body: dict, key: str = RELAY_KEY, headers=None, **kw) -> Deferred:
        hdrs = {"Authorization": [f"Bearer {key}"], "Content-Type": ["application/json"]}
        hdrs.update(headers or {})
        return treq.post(self.url + path, json.dumps(body).encode(), headers=hdrs, **kw)

    async def postJSON(self, path: str, body: dict, **kw):
        response = await self.post(path, body, **kw)
        data = await response.content()
        return response, data

    async def stop(self) -> None:
        credentials = self.app.extras.get("credentials") if self.app is not None else None
        if credentials is not None:
            credentials.stop()
        if self.port is not None:
            await maybeDeferred(self.port.stopListening)
        for p in self.extraPorts:
            await maybeDeferred(p.stopListening)
        dialer = self.app.dialer if self.app is not None else None
        if dialer is not None and hasattr(dialer, "close"):
            await dialer.close()
        await self.emulator.stop()
        await deferLater(reactor, 0.01, lambda: None)


def accountsYAML(emulator: Emulator, accounts) -> str:
    """
    Render accounts for the config: each item is a dict with C{id},
    C{credential}, optional C{type} (apikey|oauth), C{base_url} (default: the
    emulator), and any other account keys.
    """
    lines = []
    for a in accounts:
        a = dict(a)
        kind = a.pop("type", "apikey")
        cred = a.pop("credential")
        base = a.pop("base_url", None) or emulator.baseURL(kind)
        entry = {"id": a.pop("id"), "type": kind, "base_url": base}
        if kind == "oauth":
            if cred is not None:
                entry["access_token"] = cred
            entry["chatgpt_account_id"] = a.pop("chatgpt_account_id", "acct-test")
        else:
            entry["api_key"] = cred
        entry.update(a)
        lines.append(entry)
    return json.dumps(lines)


async def startStack(accounts, gateway: str = "{}", emulatorConfig=None, keys=None, extra="",
                     emulator=None) -> Stack:
    """
    Start an emulator and a relay whose accounts point at it.

    @param accounts: see L{accountsYAML}; or a callable taking the
        listening emulator and returning them (to mint OAuth tokens).
    @param gateway: the C{gateway:} section as YAML/JSON text.
    @param keys: the C{keys:} section as JSON text (default: one test key).
    @param emulator: an emulator already listening, else one is started
        with C{emulatorConfig}.
    """
    if emulator is None:
        emulator = Emulator(reactor=reactor, config=emulatorConfig or {})
        await emulator.listen(reactor)
    if callable(accounts):
        accounts = accounts(emulator)
    keys = keys or json.dumps([{"name": "test", "key": RELAY_KEY, "concurrency": 0}])
    database = os.path.join(tempfile.mkdtemp(prefix="relay-test-db-"), "relay.sqlite")
    text = (
        'listen: "tcp:0:interface=127.0.0.1"\n'
        f"database: {json.dumps(database)}\n"
        f"keys: {keys}\n"
        f"accounts: {accountsYAML(emulator, accounts)}\n"
        f"gateway: {gateway}\n"
        f"{extra}"
    )
    config = settingsFromString(text)
    app = buildApplication(config, reactor)
    credentials = app.extras.get("credentials")
    if credentials is not None:
        await credentials.start()  # what relay's _Startup does (issue 12)
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(app.site)
    return Stack(emulator=emulator, app=app, port=port)


def sseEvents(data: bytes) -> list:
    """
    Parse an SSE body into a list of (event type, parsed data).
    """
    out = []
    for block in data.decode().split("\n\n"):
        etype, payload = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                etype = line[7:]
            elif line.startswith("data: "):
                payload.append(line[6:])
        if payload:
            raw = "\n".join(payload)
            parsed = json.loads(raw) if raw != "[DONE]" else "[DONE]"
            out.append((etype or (parsed.get("type") if isinstance(parsed, dict) else raw), parsed))
    return out


__all__ = ["Stack", "startStack", "closedPort", "sseEvents", "RELAY_KEY", "evolve"]
