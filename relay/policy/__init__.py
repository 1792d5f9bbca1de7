# -*- test-case-name: tests.test_policy -*-
"""
What an upstream attempt's end means, and what it does to account state
(behaviour.md R2, R86).

  - L{relay.policy.ends}: the facts every transport reports (a status, an
    in-band failure, a transport failure, a cut, a clean end, relay's own
    timeout, a departed client...);
  - L{relay.policy.judgement}: the verdict for a fact, through the failure
    classifier seam, independent of the fact's wire form;
  - L{relay.policy.bookkeeping}: the one writer of account state for an
    attempt's end.

The turn engine (L{relay.engine.runner}) asks these and acts on the
answers; the transports (HTTP, chat, WebSocket modes) only report facts.
"""
