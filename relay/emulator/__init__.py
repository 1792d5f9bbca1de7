# -*- test-case-name: tests.test_emulator -*-
"""
The bundled OpenAI upstream emulator: a product feature for trying relay offline and
rehearsing faults, and the upstream every relay test runs against.

It serves, on one port (plain TCP or TLS):

  - C{POST /v1/responses} and C{/responses} (API-key style: C{previous_response_id} works
    against responses stored by the same credential) and
    C{POST /backend-api/codex/responses} (OAuth style, as the ChatGPT backend: non-stream
    requests get 400 C{{"detail":"Stream must be set to true"}}, C{max_output_tokens},
    C{temperature} and C{top_p} get 400 C{{"detail":"Unsupported parameter: <name>"}},
    the terminal event carries C{output: []} (the items are only in the
    C{response.output_item.done} events; script C{completed_output} changes that), and
    nothing is stored);
  - compaction turns (the last input item is C{compaction_trigger}: one C{compaction} item
    whose C{encrypted_content} only the producing account can open; a misplaced trigger or
    another account's compaction / encrypted reasoning item is refused with 400), and the
    routes beyond the turn (L{relay.emulator.responsesapi}): C{POST /v1/responses/compact},
    C{POST /v1/responses/input_tokens}, stored and C{background: true} responses
    (C{GET}/C{DELETE /v1/responses/{id}}, C{?stream=true&starting_after=N}, C{GET …/input_items},
    C{POST …/cancel}; L{relay.emulator.stored}) on the API-key route, whose input items given
    by id (C{item_reference}, an id-only item, a C{reasoning} item without
    C{encrypted_content}) are resolved from the account's stored responses (their input and
    output items), else answered 404 "Item with id '…' not found." (C{param: input}), as the
    API does; on the OAuth route
    C{/responses/compact} is retired (404) and nothing is stored; the OAuth route answers
    with C{x-codex-turn-state} on HTTP and on the WebSocket 101;
  - the Responses WebSocket on C{GET} of the same paths with C{Upgrade: websocket};
  - C{POST /v1/chat/completions} (and C{/chat/completions});
  - C{GET /v1/models} (and C{/models}); C{GET /backend-api/codex/models?client_version=...}
    is the Codex models manifest with an C{ETag} (C{If-None-Match} answered 304);
  - C{POST /oauth/token} and C{GET /backend-api/wham/usage} for C{type: oauth} accounts (JWT
    access tokens with C{exp} and the account claim, single-use refresh tokens, token faults,
    usage windows in C{x-codex-*} headers and C{codex.rate_limits} events): see
    L{relay.emulator.oauth};
  - the control API under C{/_emulator/} (no authentication; listen on loopback):

    - C{GET /_emulator/requests}: the recorded requests as JSON (names instead of credentials,
      C{authorization} shown as C{Bearer ***});
    - C{DELETE /_emulator/requests}: forget them;
    - C{PUT /_emulator/faults/<credential-or-name>} with a fault object, a list, or C{null}
      (clears); C{DELETE} on the same path clears; C{*} addresses every account that has no
      faults of its own;
    - C{GET /_emulator/faults}, C{DELETE /_emulator/faults}: list / clear every fault;
    - C{PUT /_emulator/scripts/<credential-or-name>} with a script object (C{null} resets;
      C{*} is the default script);
    - C{GET /_emulator/stats}: C{{name: {"inflight": n, "peak": n}}};
      C{DELETE /_emulator/peaks} resets peaks;
    - C{GET /_emulator/oauth} (token requests, refreshes, reuse attempts; never a token),
      C{PUT|DELETE /_emulator/oauth/faults/<name>}, C{POST /_emulator/oauth/release};
    - C{GET|PUT|DELETE /_emulator/chaos}: seeded random faults (chaos mode);
    - C{GET /_emulator/turns}: requests and generations per client turn (the turn ledger);
      C{DELETE} forgets it. Both are described in L{relay.emulator.chaos};
    - C{GET /_emulator/generations}: C{{"total": n, "by_account": {name: n}, "generations":
      [{"time", "account", "response_id", "model", "input_tokens", "cached_tokens",
      "output_tokens", "reasoning_tokens"}]}}, every generation with or without a turn key
      and the usage its answer reported (sub-routes never add to it);

An account is identified by its credential, the C{Authorization: Bearer} token.  Unknown
credentials are served as anonymous accounts named C{key-<sha256 prefix>} when C{accept_any}
is true (the default, for demo convenience); otherwise they get OpenAI's 401
C{invalid_api_key} body.  The secret is never echoed in replies or in the control API.

The script and fault formats are documented in L{relay.emulator.state}.  The configuration
(the YAML file of the C{relay-emulator} twistd plugin, or the C{config} dict of L{Emulator})::

    listen: "tcp:9090:interface=127.0.0.1"
    accept_any: true
    ws_max_age: 3600            # seconds; older WebSockets get websocket_connection_limit_reached
    ws_max_frame_bytes: 67108864  # a bigger client frame is closed 1009 (frame too big)
    models: [gpt-5.5]
    default_script: {text: "...", tool_call: {...}}
    default_fault: null
    chaos: {seed: 7, rate: 0.3, faults: [{weight: 2, kind: status, preset: unavailable}]}
    oauth: {access_token_ttl: 864000}   # seconds; optional secret: HS256 key
    accounts:
      - {name: a1, credential: sk-emu-a1, script: {...}, fault: {...}}
      - {name: o1, type: oauth, refresh_token: rt-o1, chatgpt_account_id: acct-o1,
         plan_type: plus, usage: {primary_used_percent: 10, primary_capacity_tokens: 100000}}

Python use (e.g. in a pytest-twisted test)::

    emulator = Emulator(reactor=reactor, config={...})
    await emulator.listen(reactor)              # tcp:0 on 127.0.0.1
    url = emulator.baseURL("apikey")            # http://127.0.0.1:<port>/v1
    emulator.setFault("sk-emu-a2", {"kind": "status", "preset": "unavailable", "times": 1})
    ...
    await emulator.stop()
"""

from relay.emulator.core import Emulator, EmulatorConfigError, validateConfig
from relay.emulator.state import EmulatorState, Fault, RecordedRequest, ReplyScript

__all__ = [
    "Emulator",
    "EmulatorConfigError",
    "EmulatorState",
    "Fault",
    "RecordedRequest",
    "ReplyScript",
    "validateConfig",
]
