#!/usr/bin/env bash
# Codex canary: run relay's Codex end-to-end tests against the pinned Codex
# CLI (.ci/run) and the newest @openai/codex on npm, and print a table per
# version (test -> pass/fail). Each new Codex release changes what it sends;
# run this before moving the pin and whenever a Codex release is announced
# (docs/clients.md, "Codex").
#
#   scripts/codex-canary.sh              # the pinned version and the newest
#   scripts/codex-canary.sh 0.172.0 ...  # these versions
#   CANARY_FRESH=1 scripts/codex-canary.sh   # install the pinned one afresh too
#
# A version other than an installed pinned one is installed into a temporary
# npm prefix (removed afterwards); the tests take the binary from
# CODEX_BINARY (tests/integration/codex.py). Exit status: 0 when every test
# passed on every version, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

PINNED=$(sed -n 's/.*@openai\/codex@\([0-9][0-9.]*\).*/\1/p' .ci/run | head -1)
PINNED_BIN="$HOME/.local/codex/bin/codex"

TESTS=(
    "tests/integration/test_codex_http.py::test_codex_http_tool_turn"
    "tests/integration/test_codex_ws.py::test_codex_tool_call_over_websocket"
    "tests/integration/test_codex_compaction.py::test_codex_remote_compaction_through_relay"
    "tests/integration/test_codex_http_failover.py::test_codex_http_one_account_503"
    "tests/integration/test_codex_ws.py::test_codex_with_a_refusing_account"
    "tests/integration/test_codex_keylimits.py::test_budget_exhausted_over_http"
    "tests/integration/test_codex_status.py::test_status_shows_the_keys_own_daily_limit"
)

if [ "$#" -gt 0 ]; then
    VERSIONS=("$@")
else
    NEWEST=$(npm view @openai/codex version 2>/dev/null || true)
    VERSIONS=("$PINNED")
    if [ -n "$NEWEST" ] && [ "$NEWEST" != "$PINNED" ]; then
        VERSIONS+=("$NEWEST")
    elif [ -z "$NEWEST" ]; then
        echo "codex-canary: npm view @openai/codex version failed; testing the pinned $PINNED only" >&2
    else
        echo "codex-canary: the newest Codex on npm is the pinned $PINNED" >&2
    fi
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/codex-canary.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
status=0

for version in "${VERSIONS[@]}"; do
    label="$version"
    [ "$version" = "$PINNED" ] && label="$version (pinned)"
    bin=""
    if [ -z "${CANARY_FRESH:-}" ] && [ "$version" = "$PINNED" ] && [ -x "$PINNED_BIN" ] \
        && "$PINNED_BIN" --version 2>/dev/null | grep -qx "codex-cli $version"; then
        bin="$PINNED_BIN"
    else
        prefix="$TMP/codex-$version"
        if npm install -g --silent --no-fund --no-audit --prefix "$prefix" \
            "@openai/codex@$version" >"$TMP/npm-$version.log" 2>&1; then
            bin="$prefix/bin/codex"
        fi
    fi
    echo
    echo "== Codex $label"
    if [ -z "$bin" ] || ! "$bin" --version >/dev/null 2>&1; then
        echo "   could not install @openai/codex@$version (see npm's log below)"
        tail -5 "$TMP/npm-$version.log" 2>/dev/null | sed 's/^/   /'
        status=1
        continue
    fi
    echo "   binary: $bin ($("$bin" --version))"
    log="$TMP/pytest-$version.log"
    CODEX_BINARY="$bin" python -m pytest "${TESTS[@]}" -q -rA -p no:cacheprovider \
        >"$log" 2>&1 || true
    printf '   %-90s %s\n' "test" "result"
    results=$(grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ' "$log" || true)
    if [ -z "$results" ]; then
        echo "   (no results; pytest's output follows)"
        tail -20 "$log" | sed 's/^/   /'
        status=1
        continue
    fi
    while read -r outcome id rest; do
        case "$outcome" in
            PASSED) word=pass ;;
            SKIPPED) word="skip ${rest}" ;;
            *) word=fail; status=1 ;;
        esac
        printf '   %-90s %s\n' "${id#tests/integration/}" "$word"
    done <<<"$results"
    tail -1 "$log" | sed 's/^/   /'
done

exit "$status"
