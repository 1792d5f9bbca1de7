# -*- test-case-name: tests.test_operators -*-
"""
Operator passwords, hashed with Argon2id (argon2-cffi, RFC 9106's second
recommended parameters as the library sets them): only the encoded hash
(C{$argon2id$v=19$m=...}) is ever stored, in the control store or an
environment variable named by C{password_hash_env} (config.md
C{operators:}).

C{python -m relay.operators.passwords} reads a password from the terminal
and prints its hash, for the file's operators (L{main}).
"""

from __future__ import annotations

from typing import Optional

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

__all__ = ["MIN_PASSWORD_LENGTH", "checkPassword", "hashPassword", "isHash", "main", "verifyPassword"]

MIN_PASSWORD_LENGTH = 12
"""The shortest password an operator may be given, characters."""

MAX_PASSWORD_LENGTH = 1024
"""The longest, characters (a bound on the work a sign-in can ask for)."""

_HASHER = PasswordHasher()

_DUMMY = _HASHER.hash("relay-no-such-operator")
"""Verified against when the name is unknown, so an unknown name costs what
a wrong password costs (no timing oracle for names)."""


def checkPassword(password) -> Optional[str]:
    """
    @return: L{None} for an acceptable new password, else one line saying
        what is wrong (never the password).
    """
    if not isinstance(password, str):
        return "password: expected a string"
    if len(password) < MIN_PASSWORD_LENGTH:
        return f"password: at least {MIN_PASSWORD_LENGTH} characters"
    if len(password) > MAX_PASSWORD_LENGTH:
        return f"password: at most {MAX_PASSWORD_LENGTH} characters"
    return None


def hashPassword(password: str) -> str:
    """
    @param password: the plain password.
    @return: its Argon2id hash, salted (two calls never give the same).
    """
    return _HASHER.hash(password)


def isHash(value) -> bool:
    """
    @return: whether C{value} reads as an Argon2 hash this library verifies.
    """
    if not isinstance(value, str) or not value.startswith("$argon2"):
        return False
    try:
        _HASHER.check_needs_rehash(value)
    except (InvalidHashError, ValueError):
        return False
    return True


def verifyPassword(encoded: Optional[str], password) -> bool:
    """
    @param encoded: the stored hash, or L{None} for an unknown operator (a
        dummy hash is verified then, so both take as long).
    @param password: what was typed.
    @return: whether it matches; never raises for a bad hash or input.
    """
    if not isinstance(password, str) or len(password) > MAX_PASSWORD_LENGTH:
        password = ""
    try:
        ok = _HASHER.verify(encoded or _DUMMY, password)
    except (VerifyMismatchError, VerificationError, InvalidHashError, ValueError):
        return False
    return ok and encoded is not None


def main(argv=None, ask=None, out=None) -> int:
    """
    C{python -m relay.operators.passwords}: ask for a password twice and
    print its hash, for a file operator's C{password_hash_env} (config.md
    C{operators:}). Without a terminal it reads the two lines from standard
    input.

    @param argv: the arguments after the program name (C{--help} only).
    @param ask: C{getpass.getpass}-like; the default reads the terminal.
    @param out: where the hash (or the help) goes; standard output by default.
    @return: the exit status: 0 with the hash printed.
    @raise SystemExit: with one line and status 1 when no password could be
        read (no terminal, end of input), it is too short or too long, or the
        two differ; status 2 for an unknown argument.
    """
    import getpass
    import sys

    argv = sys.argv[1:] if argv is None else argv
    out = sys.stdout if out is None else out
    ask = getpass.getpass if ask is None else ask
    if argv in (["-h"], ["--help"]):
        out.write(
            "usage: python -m relay.operators.passwords\n"
            "Asks for a password twice and prints its Argon2id hash, for the variable an\n"
            "operator's password_hash_env names (quote it in a shell: it holds $ signs).\n")
        return 0
    if argv:
        print(f"relay.operators.passwords: unknown argument {argv[0]!r} (try --help)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        first = ask("password: ")
        problem = checkPassword(first)
        if problem:
            raise SystemExit(problem)
        if ask("again: ") != first:
            raise SystemExit("the two passwords differ")
    except (EOFError, KeyboardInterrupt):
        raise SystemExit("no password read: run it in a terminal, or give the password"
                         " twice on standard input, one line each") from None
    out.write(hashPassword(first) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover - a terminal tool
    raise SystemExit(main())
