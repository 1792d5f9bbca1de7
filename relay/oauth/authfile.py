# -*- test-case-name: tests.test_oauth -*-
"""
Codex's credential file C{$CODEX_HOME/auth.json} (protocol.md 7.4) and the
C{relay-import-codex-auth} command.

The file looks like::

    {"OPENAI_API_KEY": null,
     "tokens": {"id_token": "<JWT>", "access_token": "<JWT>",
                "refresh_token": "<opaque>", "account_id": "<chatgpt account id>"},
     "last_refresh": "<RFC 3339>"}

A bare C{tokens} object is accepted too. Give relay its own login: a
refresh token is single-use, so relay and a Codex that keep refreshing the
same file would each invalidate the other's token. relay never writes the
file back; its newest tokens live in its own store.

C{relay-import-codex-auth FILE...} prints the C{accounts:} YAML for one or
more files. Secrets go, at the operator's choice, into an env file (0600)
referenced with C{*_env} keys (the default), inline, or stay in the file
(C{auth_file: PATH}). The env file is merged, not overwritten: importing
one account after another keeps the earlier ones' variables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from datetime import datetime
from typing import Optional

from attrs import frozen

from relay.oauth.tokens import accountIdOf


class AuthFileError(ValueError):
    """
    An C{auth.json} cannot be used; the message says why (never a secret).
    """


@frozen
class CodexAuth:
    """
    The tokens read from one C{auth.json}.

    @ivar access_token: the access token, or L{None}.
    @ivar refresh_token: the refresh token, or L{None}.
    @ivar id_token: the ID token, or L{None}.
    @ivar account_id: C{tokens.account_id}, else the token's account claim.
    @ivar last_refresh: C{last_refresh} as Unix seconds, or L{None}.
    """

    access_token: Optional[str]
    refresh_token: Optional[str]
    id_token: Optional[str]
    account_id: Optional[str]
    last_refresh: Optional[float]


def _rfc3339(value) -> Optional[float]:
    """
    @return: an RFC 3339 time as Unix seconds, or L{None}.
    """
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    # Python < 3.11 cannot parse more than 6 fractional digits; Codex
    # writes nanoseconds.
    text = re.sub(r"(\.\d{6})\d+", r"\1", text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return when.timestamp()


def parseAuth(document) -> CodexAuth:
    """
    Read the tokens of an C{auth.json} document (or its C{tokens} object).

    @param document: the parsed JSON.
    @raise AuthFileError: no tokens object, or neither an access nor a
        refresh token.
    """
    if not isinstance(document, dict):
        raise AuthFileError("expected a JSON object")
    tokens = document.get("tokens", document)
    if not isinstance(tokens, dict):
        raise AuthFileError("no tokens object (is this a Codex auth.json after a ChatGPT login?)")

    def text(name):
        value = tokens.get(name)
        return value.strip() if isinstance(value, str) and value.strip() else None

    access, refresh, idToken = text("access_token"), text("refresh_token"), text("id_token")
    if not access and not refresh:
        raise AuthFileError("tokens has neither access_token nor refresh_token")
    accountId = text("account_id") or accountIdOf(access, idToken)
    return CodexAuth(
        access_token=access, refresh_token=refresh, id_token=idToken, account_id=accountId,
        last_refresh=_rfc3339(document.get("last_refresh")),
    )


def readAuthFile(path: str) -> CodexAuth:
    """
    Read and parse an C{auth.json}.

    @raise AuthFileError: unreadable, not JSON, or no usable tokens.
    """
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except OSError as e:
        raise AuthFileError(f"cannot read {path}: {e.strerror or e}")
    try:
        document = json.loads(raw)
    except ValueError:
        raise AuthFileError(f"{path} is not valid JSON")
    try:
        return parseAuth(document)
    except AuthFileError as e:
        raise AuthFileError(f"{path}: {e}")


# ---------------------------------------------------------------------------
# relay-import-codex-auth
# ---------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "account"


def _envName(accountId: str, what: str) -> str:
    return "RELAY_" + re.sub(r"[^A-Za-z0-9]+", "_", accountId).upper() + "_" + what


def _yamlString(value: str) -> str:
    return json.dumps(value)


def accountEntry(auth: CodexAuth, accountId: str, mode: str, path: str, env: dict) -> list:
    """
    The YAML lines of one C{accounts:} entry.

    @param mode: C{env}, C{inline} or C{file}.
    @param path: the C{auth.json} path (for C{file}).
    @param env: filled with variable name -> secret for C{env}.
    @return: lines, without a trailing newline.
    """
    lines = [f"  - id: {_yamlString(accountId)}", "    type: oauth"]
    if auth.account_id:
        lines.append(f"    chatgpt_account_id: {_yamlString(auth.account_id)}")
    if mode == "file":
        lines.append(f"    auth_file: {_yamlString(os.path.abspath(path))}")
        return lines
    for name, value in (
        ("refresh_token", auth.refresh_token),
        ("access_token", auth.access_token),
        ("id_token", auth.id_token),
    ):
        if not value:
            continue
        if mode == "inline":
            lines.append(f"    {name}: {_yamlString(value)}")
        else:
            variable = _envName(accountId, name.upper())
            env[variable] = value
            lines.append(f"    {name}_env: {variable}")
    return lines


_TOKEN_VARIABLES = ("REFRESH_TOKEN", "ACCESS_TOKEN", "ID_TOKEN")
"""The suffixes of the variables L{accountEntry} writes for one account."""


def writeEnvFile(path: str, env: dict, replaced) -> None:
    """
    Merge C{NAME=value} lines into the env file at C{path}, which ends up
    mode 0600 whatever it was: lines of other variables (other accounts'
    tokens, comments) are kept in their order; every line setting a name in
    C{replaced} (the imported accounts' variables, also ones this import no
    longer sets) or in C{env} is dropped, and C{env} is appended. The file
    is replaced atomically (a 0600 temporary file renamed over it).

    @param env: variable name -> secret.
    @param replaced: names whose old lines are dropped.
    @raise OSError: the file cannot be read or written.
    """
    drop = set(replaced) | set(env)
    kept = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name = line.split("=", 1)[0].strip()
                if name.startswith("export "):
                    name = name[len("export "):].strip()
                if "=" in line and name in drop:
                    continue
                kept.append(line if line.endswith("\n") else line + "\n")
    except FileNotFoundError:
        pass
    # An unpredictable name in the target directory,
    # created exclusively with mode 0600 (never a file someone planted).
    descriptor, temporary = tempfile.mkstemp(
        prefix="." + os.path.basename(path) + ".", suffix=".tmp",
        dir=os.path.dirname(os.path.abspath(path)),
    )
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)  # an old temporary file keeps its mode
            f.writelines(kept)
            for name, value in env.items():
                f.write(f"{name}={value}\n")
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def main(argv=None, stdout=None, stderr=None) -> int:
    """
    C{relay-import-codex-auth [--secrets env|inline|file] [--env-file PATH]
    [--id ID] FILE...}: print the C{accounts:} YAML for Codex C{auth.json}
    files.

    @return: the exit status (0 ok, 2 a file could not be used).
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    parser = argparse.ArgumentParser(
        prog="relay-import-codex-auth",
        description="Print relay account YAML for Codex auth.json files.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="a Codex auth.json")
    parser.add_argument(
        "--secrets", choices=("env", "inline", "file"), default="env",
        help="env: write the tokens to --env-file and reference them with *_env keys "
        "(default); inline: put them in the YAML; file: reference the file (auth_file)",
    )
    parser.add_argument(
        "--env-file", default="relay-codex.env",
        help="where --secrets env writes NAME=value lines (mode 0600; other variables in an "
        "existing file are kept, the imported accounts' are replaced; default %(default)s)",
    )
    parser.add_argument(
        "--id", action="append", default=[],
        help="the relay account id for each FILE, in order (default codex-<account id>)",
    )
    args = parser.parse_args(argv)
    lines = ["accounts:"]
    env: dict = {}
    seen = set()
    for index, path in enumerate(args.files):
        try:
            auth = readAuthFile(path)
        except AuthFileError as e:
            print(f"relay-import-codex-auth: {e}", file=stderr)
            return 2
        if index < len(args.id):
            accountId = args.id[index]
        else:
            accountId = "codex-" + _slug((auth.account_id or f"{index + 1}")[:12])
        while accountId in seen:
            accountId += "-2"
        seen.add(accountId)
        if not auth.refresh_token:
            lines.append(f"  # {accountId}: no refresh token: the access token cannot be renewed")
        lines.extend(accountEntry(auth, accountId, args.secrets, path, env))
    if args.secrets == "env" and env:
        replaced = {
            _envName(accountId, what) for accountId in seen for what in _TOKEN_VARIABLES
        }
        try:
            writeEnvFile(args.env_file, env, replaced)
        except OSError as e:
            print(f"relay-import-codex-auth: cannot write {args.env_file}: {e.strerror or e}",
                  file=stderr)
            return 2
        lines.insert(0, f"# secrets written to {args.env_file} (mode 0600); load it into "
                        "relay's environment, e.g. with systemd EnvironmentFile=")
    print("\n".join(lines), file=stdout)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
