"""
A local OpenID Connect provider stand-in for tests: discovery, an
authorize endpoint that "signs in" a configured user at once and
redirects back with a code, a token endpoint (PKCE checked) giving an
RS256 C{id_token} signed with a key made here, and its JWKS.

Knobs for refusals: C{user} (the claims of the next sign-in), C{audience}
(the id_token's C{aud}), C{nonceOverride}, C{signWith} (another key).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from urllib.parse import urlencode

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from twisted.internet import reactor
from twisted.web.resource import Resource
from twisted.web.server import Site


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


class _Endpoint(Resource):
    isLeaf = True

    def __init__(self, provider, handler):
        super().__init__()
        self.provider, self.handler = provider, handler

    def render(self, request):
        return self.handler(request)


class OIDCProvider:
    def __init__(self, clientId="relay-console", clientSecret="oidc-test-secret-42"):
        self.clientId, self.clientSecret = clientId, clientSecret
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.otherKey = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.user = {"sub": "u-1", "email": "bo@example.com", "email_verified": True}
        self.audience = None
        self.nonceOverride = None
        self.signWith = None
        self.codes = {}
        self.calls = []
        root = Resource()
        for path, handler in ((b"openid-configuration", self._discovery),
                              (b"authorize", self._authorize), (b"token", self._token),
                              (b"jwks", self._jwks)):
            root.putChild(path, _Endpoint(self, handler))
        wellKnown = Resource()
        wellKnown.putChild(b"openid-configuration", _Endpoint(self, self._discovery))
        root.putChild(b".well-known", wellKnown)
        self.port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.issuer = f"http://127.0.0.1:{self.port.getHost().port}"

    def stop(self):
        return self.port.stopListening()

    def _json(self, request, obj, status=200):
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(obj).encode()

    def _discovery(self, request):
        self.calls.append("discovery")
        return self._json(request, {
            "issuer": self.issuer, "authorization_endpoint": self.issuer + "/authorize",
            "token_endpoint": self.issuer + "/token", "jwks_uri": self.issuer + "/jwks",
            "response_types_supported": ["code"], "id_token_signing_alg_values_supported":
            ["RS256"], "code_challenge_methods_supported": ["S256"]})

    def _authorize(self, request):
        self.calls.append("authorize")
        arg = {k.decode(): v[0].decode() for k, v in request.args.items()}
        assert arg["response_type"] == "code" and arg["client_id"] == self.clientId
        assert arg["code_challenge_method"] == "S256" and "openid" in arg["scope"].split()
        code = secrets.token_urlsafe(16)
        self.codes[code] = dict(arg, user=dict(self.user))
        request.setResponseCode(302)
        request.setHeader(b"location", (arg["redirect_uri"] + "?" + urlencode(
            {"code": code, "state": arg["state"]})).encode())
        return b""

    def _token(self, request):
        self.calls.append("token")
        form = {k.decode(): v[0].decode() for k, v in request.args.items()}
        grant = self.codes.pop(form.get("code"), None)
        if (grant is None or form.get("client_secret") != self.clientSecret
                or form.get("redirect_uri") != grant["redirect_uri"]
                or _b64(hashlib.sha256(form.get("code_verifier", "").encode()).digest())
                != grant["code_challenge"]):
            return self._json(request, {"error": "invalid_grant"}, 400)
        now = int(time.time())
        claims = dict(grant["user"], iss=self.issuer, aud=self.audience or self.clientId,
                      iat=now, exp=now + 300, nonce=self.nonceOverride or grant["nonce"])
        token = jwt.encode(claims, self.signWith or self.key, algorithm="RS256",
                           headers={"kid": "k1"})
        return self._json(request, {"access_token": "at-" + secrets.token_hex(8),
                                    "token_type": "Bearer", "id_token": token})

    def _jwks(self, request):
        self.calls.append("jwks")
        jwk = jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key(), as_dict=True)
        jwk.update(kid="k1", use="sig", alg="RS256")
        return self._json(request, {"keys": [jwk]})
