"""
Operating a running relay without dropping turns:

  - L{relay.process.live}: the live configuration's one home (the
    accounts registry every consumer reads through, the key ring, the
    admin key) and the "account set changed" hook other components
    subscribe to;
  - L{relay.process.reload}: C{SIGHUP} / C{POST /admin/reload}: re-read
    the file, validate it as start-up does, apply the difference;
  - L{relay.process.drain}: the graceful stop on C{SIGTERM}: stop
    accepting, let running turns finish within
    C{gateway.shutdown_grace_seconds}, cancel the rest, give back every
    slot.
"""
