"""
OIDC sign-in to the console (L{relay.operators.oidc}) against a local
OpenID Connect provider stand-in started in the test
(L{tests.integration.oidcprovider}): discovery, the authorize redirect
(PKCE, state, nonce), the code redeemed at the token endpoint, the
id_token verified against the JWKS, its e-mail matched to an operator;
refused: an unknown e-mail, a wrong audience, a foreign signature, a
wrong nonce, a replayed state.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest_twisted
import treq

from relay.operators.passwords import hashPassword
from tests.integration.oidcprovider import OIDCProvider
from tests.integration.relayproc import RelayProcess, writeConfig


async def _get(url, cookies=None):
    r = await treq.get(url, allow_redirects=False, persistent=False, cookies=cookies or {})
    return r, await r.content()


async def _signIn(relay):
    r, _ = await _get(relay.url + "/auth/oidc/start")
    assert r.code == 302, r.code
    location = r.headers.getRawHeaders(b"location")[0].decode()
    r, _ = await _get(location)  # the provider signs the user in at once
    assert r.code == 302
    back = r.headers.getRawHeaders(b"location")[0].decode()
    assert back.startswith(relay.url + "/auth/oidc/callback?")
    r, body = await _get(back)
    return r, body, back


def _cookie(r):
    for header in r.headers.getRawHeaders(b"set-cookie") or []:
        name, _, rest = header.decode().partition("=")
        if name == "relay_session":
            return rest.split(";")[0], header.decode()
    return None, None


@pytest_twisted.ensureDeferred
async def test_oidcSignIn():
    provider = OIDCProvider()
    tmp = tempfile.mkdtemp(prefix="relay-oidc-")
    path = os.path.join(tmp, "relay.yaml")
    relay = RelayProcess(config=path, log=os.path.join(tmp, "relay.log"))
    writeConfig(path, relay.port, [], extra=(
        f"oidc: {{issuer: {provider.issuer}, client_id: relay-console,"
        " client_secret_env: RELAY_OIDC_SECRET}\n"
        "operators:\n"
        "  - {name: ana, role: owner, password_hash_env: RELAY_OP_ANA}\n"
        "  - {name: bo, role: viewer, email: bo@example.com}\n"))
    relay.start(env={"RELAY_OIDC_SECRET": provider.clientSecret,
                     "RELAY_OP_ANA": hashPassword("ana-password-123")})
    try:
        await relay.waitHealthy()
        r, body, back = await _signIn(relay)
        assert r.code == 302, body
        assert r.headers.getRawHeaders(b"location") == [b"/admin/"]
        cookie, header = _cookie(r)
        assert cookie and "HttpOnly" in header and "SameSite=Strict" in header
        assert provider.calls[:4] == ["discovery", "authorize", "token", "jwks"]
        r, raw = await _get(relay.url + "/admin/operators", {"relay_session": cookie})
        assert r.code == 200, raw
        assert json.loads(raw)["me"] == {"name": "bo", "role": "viewer", "via": "oidc"}

        # The same callback again (a replayed state): refused.
        r, body = await _get(back)
        assert r.code == 403 and b"already used" in body and _cookie(r)[0] is None

        # Refusals: no session for any of them.
        refusals = {
            "no operator matches": lambda: provider.user.update(email="eve@example.com"),
            "does not verify": lambda: setattr(provider, "audience", "another-client"),
            "nonce": lambda: setattr(provider, "nonceOverride", "not-this-one"),
            "signature": lambda: setattr(provider, "signWith", provider.otherKey),
        }
        for expected, spoil in refusals.items():
            provider.user.update(email="bo@example.com")
            provider.audience = provider.nonceOverride = provider.signWith = None
            spoil()
            r, body, _ = await _signIn(relay)
            assert r.code == 403, (expected, r.code, body)
            assert expected.encode() in body or b"does not verify" in body, (expected, body)
            assert _cookie(r)[0] is None
        with open(relay.log, "rb") as f:
            log = f.read()
        assert provider.clientSecret.encode() not in log
        assert cookie.encode() not in log
    finally:
        relay.stop()
        await provider.stop()
