# -*- test-case-name: tests.test_oauth -*-
"""
OAuth (ChatGPT / Codex) accounts that run for months
(protocol.md 7.4).

  - L{relay.oauth.tokens}: access/ID token claims (C{exp}, the account
    claim), the L{TokenSet} and the persisted L{TokenRecord};
  - L{relay.oauth.authfile}: Codex C{auth.json} reading and the
    C{relay-import-codex-auth} command;
  - L{relay.oauth.store}: where the newest tokens live (memory, the SQLite
    C{database}, Redis) with a per-account lock for cross-process single
    flight;
  - L{relay.oauth.endpoint}: C{POST /oauth/token} through the account's
    egress proxy;
  - L{relay.oauth.credentials}: L{OAuthCredentials}, the
    L{relay.interfaces.ICredentialSource} the engine and dialers read:
    proactive and reactive refresh, single flight, backoff with jitter,
    C{needs_login}, and the in-doubt rule;
  - L{relay.oauth.crashpoints}: the test-only crash hook.
"""
