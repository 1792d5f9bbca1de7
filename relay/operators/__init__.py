# -*- test-case-name: tests.test_operators -*-
"""
Operators: the people who run relay's console, each with a role (config.md
C{operators:}, docs/security.md "Operators"):

  - L{passwords}: Argon2id password hashes (argon2-cffi);
  - L{roles}: owner, admin, viewer, and what each may do;
  - L{directory}: the operators in force, the file's and the admin API's
    (kind C{operator} of the control store,
    L{relay.interfaces.IOperatorDirectory});
  - L{sessions}: server-side console sessions (kind C{op_session}), their
    cookie and CSRF token (L{relay.interfaces.IOperatorSessions});
  - L{throttle}: sign-in attempts per address;
  - L{oidc}: the optional OpenID Connect sign-in;
  - L{signin}: C{/auth/...} (sign-in, sign-out, who am I, OIDC);
  - L{resource}: C{/admin/operators} (list, add, change role, reset
    password, remove, sign out everywhere);
  - L{gate}: what the request intake asks of a console request (its
    session, its CSRF token, its role);
  - L{assemble}: the wiring into a relay.
"""
