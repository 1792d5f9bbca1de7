# -*- test-case-name: tests.test_control_keys -*-
"""
How client keys live in the control store (L{relay.interfaces.IControlStore}):
the record kinds, the policy fields a key may have, and the
public view of a key (never a secret, never its digest).

B{Kind C{key}}: one record per key issued through the admin API, id = the
key's name, data::

    {"digest": "<hex SHA-256 of the secret>",
     "hint": "sk-relay-\u2026<last 4>",
     "policy": {<the file's key fields but name and key: concurrency,
                daily_tokens, monthly_tokens, models, deny_models,
                expires_at (Unix seconds), rpm, tpm, accounts, group,
                daily_usd, monthly_usd, max_turn_output_tokens>},
     "label": "<free text>" | null,
     "created_at": <Unix seconds>, "created_from": "<address>",
     "updated_at": ..., "updated_from": ...}

The secret itself is never stored (L{relay.tenants.keydigest}). The policy
is validated with the file's own rules (C{keys[]} in config.md) when
written and again when read.

B{Kind C{key_disabled}}: one record per key (file or admin) disabled
through the API, id = the key's name, data C{{"disabled_at", "by",
"reason"}}; no record = not disabled by an admin (a file key may still be
C{disabled: true} in the file).

Account groups added through the API are L{relay.control.groups}'.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from relay.base.records import ClientKey, ConfigError

__all__ = [
    "KEY", "KEY_DISABLED", "NAME", "POLICY_FIELDS", "keyFromRecord", "policyOf", "publicKey",
    "storedPolicy", "validatePolicy",
]

KEY = "key"
"""The store kind of admin keys."""

KEY_DISABLED = "key_disabled"
"""The store kind of keys disabled through the admin API."""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")
"""What an admin key's or group's name may be: it appears in URL paths,
metric labels, logs and the request log."""

POLICY_FIELDS = (
    "concurrency", "daily_tokens", "monthly_tokens", "models", "deny_models", "expires_at",
    "rpm", "tpm", "accounts", "group", "daily_usd", "monthly_usd", "max_turn_output_tokens",
)
"""A key's policy fields (config.md C{keys[]}, behaviour.md R102): what
C{POST} and C{PATCH /admin/keys} accept besides C{name} and C{label}."""


def validatePolicy(values: dict, path: str = "key") -> dict:
    """
    Check policy fields with the file's validators.

    @param values: field -> JSON value (C{null} for "no limit").
    @param path: the key path messages name.
    @return: field -> converted value (tuples for lists, Unix seconds for
        C{expires_at}).
    @raise ConfigError: one line naming the field (C{key.rpm: ...}).
    """
    from relay.configuration.parse import KEY_FIELDS, validateSection

    table = {name: KEY_FIELDS[name] for name in POLICY_FIELDS}
    converted = validateSection(dict(values), path, table)
    if converted.get("accounts") is not None and converted.get("group") is not None:
        raise ConfigError(f"{path}: give accounts or group, not both")
    return converted


def policyOf(key: ClientKey) -> dict:
    """
    @return: a key's policy as JSON (lists, not tuples), every field present
        (C{null}: no limit).
    """
    out: dict[str, Any] = {}
    for name in POLICY_FIELDS:
        value = getattr(key, name)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def storedPolicy(converted: dict) -> dict:
    """
    @return: validated policy values as stored (JSON: lists, no L{None}).
    """
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in converted.items()
            if v is not None}


def keyFromRecord(record) -> ClientKey:
    """
    The L{ClientKey} of a stored admin key: no secret (C{key} is empty),
    its digest, its policy.

    @raise ConfigError: a policy that no longer validates.
    @raise ValueError: a record without a readable digest.
    """
    digest = bytes.fromhex(record.data.get("digest") or "")
    if len(digest) != 32:
        raise ValueError(f"key {record.id!r} has no digest")
    policy = validatePolicy(record.data.get("policy") or {}, f"key {record.id}")
    # R104: the owner identity of this issuance (a record written before
    # issuance ids existed is told apart by its creation time).
    issuance = record.data.get("issuance") or "c%r" % (record.data.get("created_at") or 0.0)
    return ClientKey(name=record.id, key="", digest=digest, issuance=str(issuance), **policy)


def publicKey(key: ClientKey, source: str, now: float, data: Optional[dict] = None,
              disabled: Optional[dict] = None, fileDisabled: bool = False) -> dict:
    """
    The admin view of a key: what it may do and where it comes from, never
    its secret or digest (R99).

    @param key: the L{ClientKey} in force.
    @param source: C{file} or C{admin}.
    @param now: Unix seconds (for C{expired}).
    @param data: the admin record's data, if any.
    @param disabled: the C{key_disabled} record's data, or L{None}.
    @param fileDisabled: whether the file says C{disabled: true}.
    @return: a JSON-ready dict.
    """
    data = data or {}
    return {
        "name": key.name,
        "source": source,
        "label": data.get("label"),
        "hint": data.get("hint"),
        "disabled": bool(disabled is not None or fileDisabled),
        "disabled_by": "admin" if disabled is not None else ("file" if fileDisabled else None),
        "disabled_at": (disabled or {}).get("disabled_at"),
        "disabled_reason": (disabled or {}).get("reason"),
        "expired": key.expires_at is not None and now >= key.expires_at,
        "policy": policyOf(key),
        "created_at": data.get("created_at"),
        "updated_at": data.get("updated_at"),
    }
