#!/usr/bin/env bash
# The test command (README): unit tests under trial first, then everything
# (unit + integration + end-to-end) under pytest with pytest-twisted
# (style.md 9(e): trial runs as its own step, before pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.local/codex/bin:$PATH"
python -m twisted.trial tests
python -m pytest "$@"
