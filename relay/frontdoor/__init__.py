"""
The front door: everything that happens to a turn before the engine runs
it, for every entrypoint (behaviour.md R102, R103, R105, R108).

  - L{relay.frontdoor.parse}: the one reader of a client body or
    WebSocket frame (L{readJSON}) and the one check of a turn's fields
    (L{turnFields}), for HTTP bodies and WebSocket frames alike;
  - L{relay.frontdoor.keychecks}: the key's policy (models, expiry,
    R102), its money/token budget with the turn's reservation (R108) and
    its C{rpm}/C{tpm} windows, after the start-up gate (R105);
  - L{relay.frontdoor.door}: L{FrontDoor}, the object the HTTP resources
    and the WebSocket protocol hand a turn and its sink to: it admits the
    key's slot (R26, R103), runs the checks and hands the admitted turn
    to L{relay.engine.runner.TurnRunner.run}; a refusal is answered by the
    turn's sink in the transport's form and recorded by the engine like
    any ended turn;
  - L{relay.frontdoor.record}: L{Admission}, what the door decided for a
    request before its body was parsed (the key, its slot), travelling
    with the request to the resource that builds the turn.

The key's authentication from the headers and the body's bytes budget
stay with the HTTP intake (L{relay.entry.intake}, L{relay.entry.body}),
which run before twisted.web finds a resource.
"""
