# -*- test-case-name: tests.test_control -*-
"""
What operators change while relay runs (architecture.md
"relay/control/"): accounts added, edited, paused and deleted, ChatGPT
logins, the audit of every admin change; client keys, account groups and
prices.

One concept per subpackage, each split in three (as codex-lb splits its
C{app/modules/<concept>/}, in Twisted's idiom): the HTTP C{resource}
(twisted.web, behind the admin key), the C{service} holding the rules, and
its C{records} in the one control store:

  - L{relay.control.store}: L{relay.interfaces.IControlStore}, records per
    kind with a version and a change notification; memory, SQLite (the
    C{database}) and Redis (pub/sub) providers, one contract suite;
  - L{relay.control.accounts}: C{POST/PATCH/DELETE /admin/accounts},
    pause and resume, the file-versus-admin rule;
  - L{relay.control.logins}: the browser (PKCE) and device-code ChatGPT
    logins (protocol.md 7.5);
  - L{relay.control.audit}: C{GET /admin/audit} and the C{/admin} tree
    that records every change;
  - L{relay.control.keys}: C{/admin/keys}: keys issued (the secret shown
    once, kept as a digest), edited, disabled, revoked;
  - L{relay.control.groups}: C{/admin/groups};
  - L{relay.control.prices}: C{/admin/prices} over the file's and the
    shipped prices;
  - L{relay.control.plane}: the changes applied to the live account set,
    the key ring, the groups and the prices, the way a reload applies a
    file (L{relay.process.reload});
  - L{relay.control.web}: the admin key check and the one admin body
    reader the resources share;
  - L{relay.control.assemble}: the wiring into a relay.
"""
