"""
Helpers for the OAuth tests of issue 12: an emulator with ChatGPT logins
(L{relay.emulator.oauth}) and relay accounts that refresh against it.
"""

from __future__ import annotations

import base64
import json

import jwt
from twisted.internet import reactor
from twisted.internet.task import deferLater

from relay.emulator import Emulator
from relay.emulator.oauth import AUTH_CLAIM, KID

RESPONSES = "/v1/responses"


def emulatorConfig(names=("o1",), ttl=600, usage=None, script=None, apikeys=()) -> dict:
    """
    An emulator configuration with one OAuth login per name (first refresh
    token C{rt-<name>-0}, account id C{acct-<name>}) and access tokens
    valid for C{ttl} seconds.
    """
    accounts = []
    for name in names:
        entry = {"name": name, "type": "oauth", "refresh_token": f"rt-{name}-0",
                 "chatgpt_account_id": f"acct-{name}"}
        if usage is not None:
            entry["usage"] = usage[name] if isinstance(usage, dict) and name in usage else usage
        accounts.append(entry)
    for key in apikeys:
        accounts.append({"name": key, "credential": key})
    config = {"oauth": {"access_token_ttl": ttl}, "accounts": accounts}
    if script is not None:
        config["default_script"] = script
    return config


def oauthAccount(emulator: Emulator, name: str, accessTtl=600, **extra) -> dict:
    """
    A relay account for emulator login C{name}: an access token valid for
    C{accessTtl} seconds (L{None}: none configured, negative: expired), its
    first refresh token, and the emulator as C{auth_base_url}.
    """
    account = {
        "id": name, "type": "oauth",
        "credential": None if accessTtl is None else emulator.mintAccessToken(name, accessTtl),
        "refresh_token": f"rt-{name}-0",
        "auth_base_url": emulator.baseURL("root"),
        "chatgpt_account_id": f"acct-{name}",
    }
    account.update(extra)
    return account


def forgedToken(name: str, ttl: float = 600) -> str:
    """
    A JWT that looks valid to relay (future C{exp}) but that the emulator
    rejects with 401 (wrong signature): the upstream 401 path.
    """
    now = int(reactor.seconds())
    claims = {"sub": name, "iat": now, "exp": now + int(ttl),
              AUTH_CLAIM: {"chatgpt_account_id": f"acct-{name}"}}
    return jwt.encode(claims, b"not-the-emulator-secret-" * 2, algorithm="HS256",
                      headers={"kid": KID})


def bearers(emulator: Emulator, name: str, kind=None) -> list:
    """
    The bearer tokens of the emulator's recorded requests for C{name}
    (its turns: the usage probes of an idle account, issue 21, are left
    out).
    """
    out = []
    for record in emulator.requestsFor(name, kind):
        if record.path == "/backend-api/wham/usage":
            continue
        header = record.headers.get("authorization", "")
        out.append(header.partition(" ")[2])
    return out


def expOf(token: str) -> float:
    """
    @return: a JWT's C{exp}.
    """
    payload = token.split(".")[1]
    payload += "=" * (-len(payload) % 4)
    return json.loads(base64.urlsafe_b64decode(payload))["exp"]


def oauthStats(emulator: Emulator, name: str) -> dict:
    """
    @return: C{token_requests}, C{refreshes}, C{reuse_attempts} of a login.
    """
    return emulator.oauth.stats()["accounts"][name]


async def sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


async def waitFor(predicate, timeout=10.0, step=0.05):
    """
    Wait until C{predicate()} is true (polling on the reactor).
    """
    deadline = reactor.seconds() + timeout
    while not predicate():
        if reactor.seconds() > deadline:
            raise AssertionError("condition not reached in time")
        await sleep(step)


def turnBody(text="hi", stream=True) -> dict:
    return {"model": "gpt-5.5", "input": text, "stream": stream}
