# -*- test-case-name: tests.test_control -*-
"""
How accounts live in the control store (L{relay.interfaces.IControlStore}):
the record kinds, the fields an admin account may have, and the
public view of an account (never a secret).

B{Kind C{account}}: one record per account added through the admin API,
id = the account id, data::

    {"spec": {<the account's fields as in the file: id, type, base_url,
              api_key | access_token, refresh_token, id_token,
              chatgpt_account_id, concurrency, priority, models,
              model_mapping, ws_mode, proxy | proxy_id, pool_mode, ...>},
     "label": "<free text>" | null,
     "created_at": <Unix seconds>, "created_from": "<address>",
     "login": {"flow": "browser" | "device", "at": <Unix seconds>} | absent}

The spec is validated with the file's own rules
(L{relay.configuration.parse.parseAccount}) when written and again when read, so an
admin account is exactly what the same entry in the file would be.

B{Kind C{pause}}: one record per paused account (file or admin), id = the
account id, data C{{"paused_at", "by", "reason"}}; no record = not
paused.
"""

from __future__ import annotations

from typing import Any, Optional
from urllib.parse import urlsplit

from attrs import evolve

from relay.configuration.parse import parseAccount
from relay.base.records import Account, ConfigError
from relay.console.fields import (
    ANY_OBJECT,
    BOOLEAN,
    INTEGER,
    STRING,
    listOf,
    mapOf,
    oneOf,
)

__all__ = [
    "ACCOUNT", "ACCOUNT_BODY", "ADMIN_ONLY_FIELDS", "EDITABLE_FIELDS", "FILE_ONLY_FIELDS", "PAUSE",
    "SECRET_FIELDS", "TOKEN_SOURCE_ADMIN", "accountFromSpec", "describeConfigError",
    "publicAccount", "safeURL", "specSecrets",
]

ACCOUNT = "account"
"""The store kind of admin accounts."""

PAUSE = "pause"
"""The store kind of paused accounts."""

TOKEN_SOURCE_ADMIN = "admin"
"""C{token_source} of an admin account's tokens."""

SECRET_FIELDS = ("api_key", "access_token", "refresh_token", "id_token", "proxy")
"""Spec fields whose values are secrets (a proxy URL may hold a password):
written, never shown, never logged."""

FILE_ONLY_FIELDS = (
    "api_key_env", "access_token_env", "refresh_token_env", "id_token_env", "proxy_env",
    "auth_file",
)
"""File fields the API refuses: they name something on the relay host (an
environment variable, a file), which an admin client should not reach."""

ADMIN_ONLY_FIELDS = ("label", "auth_json")
"""Fields of an admin account that are not file fields: a display label,
and a Codex C{auth.json} document (read into the tokens, then dropped)."""

EDITABLE_FIELDS = (
    "priority", "concurrency", "models", "model_mapping", "proxy", "proxy_id", "ws_mode",
    "label", "api_key", "auto_redeem_resets",
)
"""What C{PATCH /admin/accounts/{id}} may change; C{api_key}
rotates an API-key account's key (write-only)."""


ACCOUNT_BODY = {
    **{name: STRING for name in (
        "id", "type", "base_url", "api_key", "api_key_env", "access_token", "access_token_env",
        "refresh_token", "refresh_token_env", "id_token", "id_token_env", "auth_file",
        "auth_base_url", "chatgpt_account_id", "proxy", "proxy_env", "proxy_id", "label")},
    "concurrency": INTEGER,
    "priority": INTEGER,
    "models": listOf(STRING),
    "model_mapping": mapOf(STRING),
    "ws_mode": oneOf(STRING, BOOLEAN),
    "pool_mode": BOOLEAN,
    "auto_redeem_resets": BOOLEAN,
    "pool_mode_retry_count": INTEGER,
    "pool_mode_retry_status_codes": listOf(INTEGER),
    "auth_json": ANY_OBJECT,
}
"""The JSON types of an account's body (C{POST}/C{PATCH /admin/accounts},
a new login's C{account}): the file's fields and the admin ones, checked
by L{relay.console.fields.checkTypes} before anything reads them."""


def accountFromSpec(spec: dict, proxies: tuple, path: str = "account") -> Account:
    """
    Build an admin account from its stored (or submitted) spec, with the
    file's validation.

    @param spec: the file-like fields (secrets included).
    @param proxies: the file's top-level proxies, for C{proxy_id}.
    @param path: the key path messages name.
    @rtype: L{Account}
    @raise ConfigError: one line naming the field.
    """
    account = parseAccount(dict(spec), proxies, {}, path)
    if account.type == "oauth":
        account = evolve(account, token_source=TOKEN_SOURCE_ADMIN)
    return account


def specSecrets(spec: dict, account: Optional[Account] = None) -> set:
    """
    @return: every secret value of a spec (and of its built account's proxy
        password), for log redaction (L{relay.base.logs.registerSecrets}).
    """
    secrets = {spec.get(name) for name in SECRET_FIELDS}
    if account is not None and account.proxy is not None and account.proxy.password:
        secrets.add(account.proxy.password)
    return {s for s in secrets if isinstance(s, str) and s}


def safeURL(url: Optional[str]) -> Optional[str]:
    """
    A URL as admin views may show it (behaviour.md R100): scheme, host,
    port and path; never userinfo, query or fragment.
    """
    if not url:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{port}" if port else "")
    return f"{parts.scheme}://{netloc}{parts.path}"


def _proxyView(account: Account) -> Optional[dict]:
    proxy = account.proxy
    if proxy is None:
        return None
    return {"id": proxy.id, "scheme": proxy.scheme, "host": proxy.host, "port": proxy.port}


def publicAccount(account: Account, source: str, data: Optional[dict] = None,
                  pause: Optional[dict] = None) -> dict:
    """
    The admin view of an account's configuration: what it is and where it
    comes from, never a secret (R99, R100).

    @param account: the L{Account} in force.
    @param source: C{file} or C{admin}.
    @param data: the admin record's data (label, creation), if any.
    @param pause: the pause record's data, or L{None} when not paused.
    @return: a JSON-ready dict.
    """
    data = data or {}
    view: dict[str, Any] = {
        "id": account.id,
        "type": account.type,
        "source": source,
        "label": data.get("label"),
        "base_url": safeURL(account.base_url),
        "priority": account.priority,
        "concurrency": account.concurrency,
        "models": list(account.models) if account.models is not None else None,
        "model_mapping": dict(account.model_mapping),
        "ws_mode": account.ws_mode,
        "proxy": _proxyView(account),
        "credential": "set" if account.credential or account.refresh_token else "none",
        "paused": pause is not None,
        "paused_at": (pause or {}).get("paused_at"),
        "created_at": data.get("created_at"),
    }
    if account.type == "oauth":
        view["chatgpt_account_id"] = account.chatgpt_account_id
        view["auth_base_url"] = safeURL(account.auth_base_url)
        if data.get("login"):
            view["login"] = {k: data["login"].get(k) for k in ("flow", "at", "plan")}
    return view


def describeConfigError(error: ConfigError, path: str = "account") -> tuple:
    """
    A file validation message as the API says it: C{account.priority:
    expected an integer} becomes C{priority: expected an integer}.

    @return: C{(message, param)}: the param is the field named, or L{None}.
    """
    text = str(error)
    unknown = f"unknown key {path}."
    if text.startswith(unknown):
        rest = text[len(unknown):]
        return "unknown field " + rest, rest.split(" ")[0]
    head, sep, rest = text.partition(": ")
    param = None
    if sep:
        if head.startswith(path + "."):
            param = head[len(path) + 1:].split(".")[0].split("[")[0]
            text = head[len(path) + 1:] + ": " + rest
        elif head == path or head.startswith(path + " ("):
            text = rest
    return text, param
