"""
The front door: everything that happens to a turn before the engine runs
it, for every entrypoint (behaviour.md R102, R103, R105, R108).

  - L{relay.frontdoor.keyring}: authenticate: the client keys in force
    (L{KeyRing}) and the one check of a presented key, before any of the
    body is read (R103);
  - L{relay.frontdoor.budgets}: the bytes held for request bodies and
    WebSocket frames, per key and in total, raw while they arrive, then
    their parsed-size estimate;
  - L{relay.frontdoor.parse}: parse once and check once: the one reader of
    a client body or frame (C{readJSON}) and the one check of a turn's
    fields (C{turnFields}), for HTTP bodies and WebSocket frames alike;
  - L{relay.frontdoor.keychecks}: the key's policy (models, expiry, R102),
    its budget with the turn's reservation (R108) and its C{rpm}/C{tpm}
    windows, after the start-up gate (R105);
  - L{relay.frontdoor.door}: C{FrontDoor}, to which the HTTP resources and
    the WebSocket protocol hand a turn and its sink: it admits the key's
    slot before a body is decoded (R26, R103), runs the checks and hands
    the admitted turn to L{relay.engine.runner.TurnRunner.run}, or has the
    engine record it as refused (C{TurnRunner.refuse}), the turn's sink
    writing the refusal in the transport's form;
  - L{relay.frontdoor.record}: C{Admission}, the key and its admitted slot,
    travelling with the request (or frame) to its turn.

The engine does not check keys; what needs the chosen account (a money
budget's unpriced model, R109) stays in the engine. The HTTP intake
(L{relay.entry.intake}, L{relay.entry.body}) sequences these steps on
twisted.web's request before a resource is found.
"""
