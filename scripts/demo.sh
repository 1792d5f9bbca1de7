#!/usr/bin/env bash
# The offline relay demo: the bundled upstream emulator (etc/emulator.yaml) and a relay
# (etc/demo.yaml) on loopback, no network and no real secrets.
#
#   scripts/demo.sh            start both, print how to use them (and the status page's
#                              address with the demo admin key), stop both on Ctrl-C
#   scripts/demo.sh --check    start both, run one streaming and one non-streaming request
#                              with curl, log a ChatGPT account in with the device-code flow
#                              and serve a turn with it, stop both; exit non-zero if anything
#                              failed
#   scripts/demo.sh --codex    print how to point Codex CLI at the demo (etc/codex.toml and
#                              the command the README's "Talking to the demo" shows); start
#                              nothing
#
# The first two modes show a device-code login against the emulator (docs/accounts.md):
# relay asks the emulator for a user code, the code is approved (as a person would at the
# verification page), relay polls, stores the tokens and adds the account demo-login.
#
# Environment:
#   RELAY_PORT      the relay's port          (default 8080)
#   EMULATOR_PORT   the emulator's port       (default 9090; the demo accounts follow it)
#   RELAY_KEY       the client key for curl   (default sk-relay-demo, the demo's key)
#   PYTHON          the interpreter           (default: python3, else python)
#
# Both servers run with `python -m twisted <plugin>` (no pid files) and PYTHONPATH set to
# the repository root, so the demo works from a fresh clone with or without `pip install`
# (an editable install hides the twistd plugins: style.md trap T2).

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RELAY_PORT="${RELAY_PORT:-8080}"
EMULATOR_PORT="${EMULATOR_PORT:-9090}"
RELAY_KEY="${RELAY_KEY:-sk-relay-demo}"
if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3 >/dev/null 2>&1; then PYTHON=python3; else PYTHON=python; fi
fi

CHECK=0
CODEX=0
case "${1:-}" in
    "") ;;
    --check) CHECK=1 ;;
    --codex) CODEX=1 ;;
    -h|--help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "demo.sh: unknown argument $1 (expected --check, --codex or nothing)" >&2; exit 2 ;;
esac

for port in "$RELAY_PORT" "$EMULATOR_PORT"; do
    if ! [[ "$port" =~ ^[0-9]+$ ]] || (( port < 1 || port > 65535 )); then
        echo "demo.sh: bad port '$port' (RELAY_PORT / EMULATOR_PORT)" >&2
        exit 2
    fi
done

# codexInstructions: how to point Codex CLI at the demo -- etc/codex.toml (the one copy of the
# configuration; the README shows it too) with this demo's port, and the command to run.
codexInstructions() {
    cat <<EOF
Point Codex CLI at it (docs/reference/protocol.md section 8): put this in
\$CODEX_HOME/config.toml (default ~/.codex; the file is etc/codex.toml). The pinned CLI
installs with npm install -g --prefix "\$HOME/.local/codex" @openai/codex@0.171.0

EOF
    grep -v '^#' "$ROOT/etc/codex.toml" \
        | sed -e "s#http://127\.0\.0\.1:8080/#http://127.0.0.1:${RELAY_PORT}/#" -e 's/^./  &/'
    cat <<EOF

and run

  RELAY_API_KEY=$RELAY_KEY ~/.local/codex/bin/codex exec --skip-git-repo-check "Say hi" </dev/null

Codex runs the emulator's echo hi tool call and prints the final message.
EOF
}

if (( CODEX )); then
    codexInstructions
    exit 0
fi

command -v curl >/dev/null 2>&1 || { echo "demo.sh: curl is required" >&2; exit 2; }

# A port something already listens on (most often a demo still running in another shell)
# would let the checks below talk to that process instead of this demo's: refuse to start.
for spec in "RELAY_PORT:$RELAY_PORT" "EMULATOR_PORT:$EMULATOR_PORT"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/${spec#*:}") 2>/dev/null; then
        echo "demo.sh: port ${spec#*:} (${spec%%:*}) is in use -- is a demo already running?" \
            "Stop it, or choose free ports: RELAY_PORT=18080 EMULATOR_PORT=19090 scripts/demo.sh" >&2
        exit 2
    fi
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/relay-demo.XXXXXX")"
RELAY_URL="http://127.0.0.1:${RELAY_PORT}"
EMULATOR_URL="http://127.0.0.1:${EMULATOR_PORT}"

stopAll() {
    local pidfile pid
    for pidfile in "$WORK/relay.pid" "$WORK/emulator.pid"; do
        [[ -f "$pidfile" ]] || continue
        pid="$(cat "$pidfile")"
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for pidfile in "$WORK/relay.pid" "$WORK/emulator.pid"; do
        [[ -f "$pidfile" ]] || continue
        pid="$(cat "$pidfile")"
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap stopAll EXIT
trap 'echo; echo "stopping..."; exit 130' INT
trap 'exit 143' TERM

# The demo accounts point at the emulator's port.
sed "s/127\.0\.0\.1:9090/127.0.0.1:${EMULATOR_PORT}/g" "$ROOT/etc/demo.yaml" > "$WORK/demo.yaml"
ADMIN_KEY="$(sed -n 's/^admin_key: *//p' "$WORK/demo.yaml" | head -n 1)"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$WORK"  # anything the servers write (sqlite, dropin caches aside) stays in the temp dir

"$PYTHON" -m twisted --log-format=text relay-emulator \
    --config "$ROOT/etc/emulator.yaml" --port "$EMULATOR_PORT" \
    > "$WORK/emulator.log" 2>&1 &
echo $! > "$WORK/emulator.pid"

"$PYTHON" -m twisted relay \
    --config "$WORK/demo.yaml" --listen "tcp:${RELAY_PORT}:interface=127.0.0.1" --log-format text \
    > "$WORK/relay.log" 2>&1 &
echo $! > "$WORK/relay.pid"

# waitFor NAME URL PIDFILE LOG: poll URL until it answers 200 (20 s at most).
waitFor() {
    local name="$1" url="$2" pid log="$4"
    pid="$(cat "$3")"
    for _ in $(seq 200); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "demo.sh: the $name exited during start-up; its log:" >&2
            cat "$log" >&2
            return 1
        fi
        if curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    echo "demo.sh: the $name did not answer $url within 20 s; its log:" >&2
    cat "$log" >&2
    return 1
}

waitFor emulator "$EMULATOR_URL/_emulator/stats" "$WORK/emulator.pid" "$WORK/emulator.log"
waitFor relay "$RELAY_URL/healthz" "$WORK/relay.pid" "$WORK/relay.log"
echo "emulator: $EMULATOR_URL  (pid $(cat "$WORK/emulator.pid"), log $WORK/emulator.log)"
echo "relay:    $RELAY_URL  (pid $(cat "$WORK/relay.pid"), log $WORK/relay.log)"
if [[ -n "$ADMIN_KEY" ]]; then
    echo "status:   $RELAY_URL/admin/#key=$ADMIN_KEY  (the status page, signed in with the demo admin key)"
fi

# json EXPR: read one value from the JSON on stdin (EXPR is Python, the document is `d`).
json() { "$PYTHON" -c "import json, sys; d = json.load(sys.stdin); print($1)"; }

# admin METHOD PATH [BODY]: one admin API call with the demo admin key.
admin() {
    curl -sS --max-time 10 -X "$1" "$RELAY_URL/admin/$2" -H "Authorization: Bearer $ADMIN_KEY" \
        -H "Content-Type: application/json" ${3:+-d "$3"}
}

# deviceLogin: a device-code ChatGPT login of a new account, demo-login, against the
# emulator (issue 21). Prints each step; returns non-zero if the login did not complete.
deviceLogin() {
    local started id code url status
    echo "--- device-code login: POST /admin/logins {\"flow\": \"device\", \"account\": {\"id\": \"demo-login\", ...}}"
    started="$(admin POST logins "{\"flow\": \"device\", \"account\": {\"id\": \"demo-login\", \"label\": \"logged in by demo.sh\", \"priority\": 40, \"base_url\": \"$EMULATOR_URL/backend-api/codex\"}}")" || return 1
    id="$(echo "$started" | json 'd["login"]["id"]' 2>/dev/null)" || { echo "$started" >&2; return 1; }
    code="$(echo "$started" | json 'd["login"]["user_code"]')"
    url="$(echo "$started" | json 'd["login"]["verification_url"]')"
    echo "relay says: open $url and enter the code $code"
    echo "(approving it as the emulator login demo-login, as a person would on that page)"
    curl -sS --max-time 5 -o /dev/null -X POST "$EMULATOR_URL/_emulator/oauth/device/approve" \
        -H "Content-Type: application/json" \
        -d "{\"user_code\": \"$code\", \"account\": \"demo-login\"}" || return 1
    for _ in $(seq 100); do
        status="$(admin GET "logins/$id" | json 'd["login"]["status"]')"
        [[ "$status" == pending || "$status" == exchanging ]] || break
        sleep 0.2
    done
    if [[ "$status" != completed ]]; then
        echo "device-code login ended $status: $(admin GET "logins/$id")" >&2
        return 1
    fi
    echo "ok: login completed; $(admin GET accounts/demo-login | json '"account " + d["account"]["id"] + " (" + d["account"]["source"] + ", ChatGPT " + d["account"]["chatgpt_account_id"] + ", plan " + str(d["account"].get("login", {}).get("plan")) + ") is in force"')"
}

if (( CHECK )); then
    failed=0

    echo "--- check 1: streaming POST /v1/responses"
    if curl -sS -N --max-time 20 --fail-with-body "$RELAY_URL/v1/responses" \
            -H "Authorization: Bearer $RELAY_KEY" -H "Content-Type: application/json" \
            -d '{"model":"gpt-5.5","input":"Say hi","stream":true}' > "$WORK/stream.out"; then
        if grep -q '^event: response.completed' "$WORK/stream.out"; then
            echo "ok: $(grep -c '^event: ' "$WORK/stream.out") SSE events, ending with response.completed"
        else
            echo "FAILED: no response.completed event in:" >&2; cat "$WORK/stream.out" >&2; failed=1
        fi
    else
        echo "FAILED: streaming request:" >&2; cat "$WORK/stream.out" >&2; echo >&2; failed=1
    fi

    echo "--- check 2: non-streaming POST /v1/responses"
    if curl -sS --max-time 20 --fail-with-body "$RELAY_URL/v1/responses" \
            -H "Authorization: Bearer $RELAY_KEY" -H "Content-Type: application/json" \
            -d '{"model":"gpt-5.5","input":"Say hi"}' > "$WORK/json.out"; then
        if "$PYTHON" -c '
import json, sys
body = json.load(open(sys.argv[1]))
assert body.get("object") == "response" and body.get("status") == "completed", body
print("ok: response", body["id"], "status", body["status"],
      "output types", [item.get("type") for item in body.get("output", [])])
' "$WORK/json.out"; then :; else
            echo "FAILED: unexpected body:" >&2; cat "$WORK/json.out" >&2; echo >&2; failed=1
        fi
    else
        echo "FAILED: non-streaming request:" >&2; cat "$WORK/json.out" >&2; echo >&2; failed=1
    fi

    echo "--- check 3: a device-code ChatGPT login, then a turn served by the new account"
    if deviceLogin; then
        # a1 and a3 paused for one turn (a2 answers 503): the turn fails over to demo-login.
        admin POST accounts/a1/disable '{"reason": "demo"}' >/dev/null
        admin POST accounts/a3/disable '{"reason": "demo"}' >/dev/null
        if curl -sS --max-time 20 --fail-with-body "$RELAY_URL/v1/responses" \
                -H "Authorization: Bearer $RELAY_KEY" -H "Content-Type: application/json" \
                -d '{"model":"gpt-5.5","input":"Say hi"}' > "$WORK/login.out" \
                && [[ "$(admin GET accounts | json '[a["turns"] for a in d["accounts"] if a["id"] == "demo-login"][0]')" == 1 ]]; then
            echo "ok: with a1 and a3 paused, the turn was served by account demo-login"
        else
            echo "FAILED: the turn was not served by demo-login:" >&2; cat "$WORK/login.out" >&2
            failed=1
        fi
        admin POST accounts/a1/enable >/dev/null
        admin POST accounts/a3/enable >/dev/null
    else
        echo "FAILED: the device-code login" >&2; failed=1
    fi

    if (( failed )); then
        echo "--- relay log" >&2; cat "$WORK/relay.log" >&2
        echo "demo check FAILED" >&2
        exit 1
    fi
    echo "demo check passed"
    exit 0
fi

deviceLogin || echo "(the device-code login did not complete; see $WORK/relay.log)"

cat <<EOF

Accounts are managed live from the status page above (add, edit, pause, log in) or the
admin API; see docs/accounts.md. A browser login signs in at the emulator's page:
start one there with the kind "ChatGPT login" and the flow "browser".

Try it (a2 is preferred but the emulator answers it 503, so you will see a failover):

  curl -N $RELAY_URL/v1/responses \\
    -H "Authorization: Bearer $RELAY_KEY" -H "Content-Type: application/json" \\
    -d '{"model":"gpt-5.5","input":"Say hi","stream":true}'

  curl $EMULATOR_URL/_emulator/requests     # what the upstream saw, per account

EOF
codexInstructions
cat <<EOF

Logs: tail -f $WORK/relay.log $WORK/emulator.log
Press Ctrl-C to stop both.
EOF

# Run until Ctrl-C, or until either server exits.
set +e
wait -n "$(cat "$WORK/emulator.pid")" "$(cat "$WORK/relay.pid")"
echo "demo.sh: a server exited; see the logs above" >&2
tail -n 20 "$WORK/relay.log" "$WORK/emulator.log" >&2
exit 1
