#!/usr/bin/env bash
# The test suite's Python environment, no root: .venv with kvwatt and its test extras (scripts/install-kvwatt.sh,
# the same step the Dockerfile runs), then the lab (lab/: replay, experiment, reports, matplotlib) beside it.
# Skipped when nothing it installs from changed: a stamp in .venv holds the hash of the files that decide what
# is installed (both pyproject.toml files, the install scripts, the interpreter's version); the installs are
# editable, so a change to the code itself needs no reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.kvwatt-test-env
want=$( { cat pyproject.toml lab/pyproject.toml scripts/install-*.sh
          "$PY" --version; } | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
scripts/install-kvwatt.sh .venv/bin/pip '.[test]' -e
.venv/bin/pip install --no-cache-dir -q -e ./lab
echo "$want" > "$STAMP"
