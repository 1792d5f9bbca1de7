# -*- test-case-name: tests.test_operators_config -*-
"""
The configuration file's console operators and their optional OpenID
Connect sign-in (config.md C{operators:}; docs/security.md "Operators"):

    operators:
      - {name: ana, role: owner, password_hash_env: RELAY_OP_ANA}
      - {name: bo, role: viewer, email: bo@example.com}   # OIDC only
    oidc:
      issuer: https://login.example.com
      client_id: relay-console
      client_secret_env: RELAY_OIDC_SECRET
      claim: email                 # the id_token claim matched to an operator
      redirect_url: https://relay.example.com/auth/oidc/callback

Each problem is one line naming the key path; a hash is never echoed.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from attrs import field, frozen

from relay.base.records import ConfigError

__all__ = ["OIDCSettings", "OperatorSpec", "OPERATOR_NAME", "ROLES", "checkOperatorsNeedAdmin",
           "oidcFrom", "operatorsFrom"]

ROLES = ("owner", "admin", "viewer")

OPERATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
"""An operator's name: 1 to 64 letters, digits and C{. _ @ -}."""


@frozen
class OperatorSpec:
    """
    One operator of the file.

    @ivar name: unique among operators.
    @ivar role: C{owner}, C{admin} or C{viewer}.
    @ivar password_hash: the Argon2 hash read from C{password_hash_env}, or
        L{None} (this operator signs in with OIDC only).
    @ivar email: matched against the OIDC claim, or L{None}.
    """

    name: str
    role: str
    password_hash: Optional[str] = field(default=None, repr=False)
    email: Optional[str] = None


@frozen
class OIDCSettings:
    """
    The OpenID Connect sign-in (config.md C{oidc:}).

    @ivar issuer: the provider's issuer URL (its discovery document is at
        C{<issuer>/.well-known/openid-configuration}).
    @ivar client_id: relay's client id at the provider.
    @ivar client_secret: relay's client secret, or L{None} (a public
        client, PKCE only).
    @ivar claim: the id_token claim matched to an operator's C{email} (or,
        failing that, name).
    @ivar redirect_url: the callback URL registered at the provider, or
        L{None}: C{<the request's origin>/auth/oidc/callback}.
    @ivar scopes: asked for.
    """

    issuer: str
    client_id: str
    client_secret: Optional[str] = field(default=None, repr=False)
    claim: str = "email"
    redirect_url: Optional[str] = None
    scopes: tuple = ("openid", "email", "profile")


def operatorsFrom(entries: list, environ: Mapping[str, str]) -> tuple:
    """
    Build C{operators:} from its entries, each already checked against its
    table (L{relay.configuration.parse}: known keys, types, roles).

    @param entries: C{(path, values)} pairs, e.g. C{("operators[0]", {...})}.
    @param environ: where C{password_hash_env} is read.
    @rtype: L{tuple} of L{OperatorSpec}
    @raise ConfigError: one line naming the key path.
    """
    names: dict = {}
    out = []
    for path, values in entries:
        for required in ("name", "role"):
            if required not in values:
                raise ConfigError(f"{path}: {required} is required")
        name = values["name"]
        if not OPERATOR_NAME.fullmatch(name):
            raise ConfigError(f"{path}.name: 1 to 64 letters, digits and . _ @ - (starting with"
                              f" a letter or digit), got {name[:40]!r}")
        if name in names:
            raise ConfigError(f"{path}.name: duplicate operator name {name!r}"
                              f" (also {names[name]})")
        names[name] = path
        variable = values.get("password_hash_env")
        digest = None
        if variable is not None:
            where = f"{path}.password_hash_env"
            digest = environ.get(variable)
            if digest is None:
                raise ConfigError(f"{where}: environment variable {variable} is not set")
            digest = digest.strip()
            if not digest.startswith("$argon2"):
                raise ConfigError(
                    f"{where}: environment variable {variable} does not hold an Argon2 hash"
                    " (make one with python -m relay.operators.passwords)")
        elif "email" not in values:
            raise ConfigError(f"{path} ({name}): password_hash_env is required (or email, to"
                              " sign in with oidc only)")
        out.append(OperatorSpec(name=name, role=values["role"], password_hash=digest,
                                email=values.get("email")))
    return tuple(out)


def oidcFrom(values: dict, secret: Optional[str]) -> OIDCSettings:
    """
    Build C{oidc:} from its checked values.

    @param secret: the client secret (C{client_secret} or
        C{client_secret_env}, resolved), or L{None}.
    @raise ConfigError: a required key missing, or C{scopes} without
        C{openid}.
    """
    for required in ("issuer", "client_id"):
        if required not in values:
            raise ConfigError(f"oidc: {required} is required")
    scopes = values.get("scopes")
    if scopes is not None and "openid" not in scopes:
        raise ConfigError("oidc.scopes: must include openid")
    return OIDCSettings(client_secret=secret, **values)


def checkOperatorsNeedAdmin(config) -> None:
    """
    Console operators sign in to the admin API, which is off without an
    admin key (config.md C{admin_key}).

    @raise ConfigError: C{operators} or C{oidc} without C{admin_key}.
    """
    if (config.operators or config.oidc is not None) and not config.admin_key:
        which = "operators" if config.operators else "oidc"
        raise ConfigError(f"{which}: needs admin_key (or admin_key_env): the admin API and"
                          " its console are off without it")
