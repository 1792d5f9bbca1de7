# -*- test-case-name: tests.test_control_identity -*-
"""
Who a ChatGPT login is, and whether that identity is already in the pool:
the warning on a login's result and on an added account (the same person
added twice shares one set of usage limits, so the pool is smaller than
it looks).

An identity is the ChatGPT account id (the workspace) and the signed-in
person's e-mail address, read from the tokens' claims
(L{relay.oauth.tokens.accountIdOf}, L{relay.oauth.tokens.emailOf}). Two
accounts are the same identity when their ChatGPT account ids are equal
and their e-mail addresses are equal or one is unknown (members of one
team workspace share the id but are different people).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from relay.oauth.tokens import accountIdOf, emailOf

__all__ = ["duplicateWarnings", "identityOf"]


def identityOf(*tokens: Optional[str]) -> dict:
    """
    @return: C{{"chatgpt_account_id", "email"}} from the tokens (each
        L{None} when unknown).
    """
    return {"chatgpt_account_id": accountIdOf(*tokens), "email": emailOf(*tokens)}


def duplicateWarnings(identity: dict, accounts, exclude: str,
                      emailOf: Callable[[Any], Optional[str]]) -> list:
    """
    The C{duplicate_identity} warning when another account in the pool is
    the same identity.

    @param identity: the new login's L{identityOf}.
    @param accounts: the accounts in force (L{relay.base.records.Account}s).
    @param exclude: the id of the account the identity belongs to.
    @param emailOf: an account's e-mail address, or L{None} when unknown.
    @return: C{[]} or one warning C{{"code", "message", "accounts",
        "chatgpt_account_id", "email"}}.
    """
    chatgptId, email = identity.get("chatgpt_account_id"), identity.get("email")
    if not chatgptId:
        return []
    same = []
    for account in accounts:
        if account.id == exclude or account.type != "oauth":
            continue
        if account.chatgpt_account_id != chatgptId:
            continue
        other = emailOf(account)
        if email and other and other.lower() != email.lower():
            continue
        same.append(account.id)
    if not same:
        return []
    who = f"ChatGPT account {chatgptId}" + (f" ({email})" if email else "")
    return [{
        "code": "duplicate_identity",
        "message": f"{who} is already in the pool as {', '.join(sorted(same))}: the same"
                   " login shares one set of usage limits",
        "accounts": sorted(same), "chatgpt_account_id": chatgptId, "email": email,
    }]
