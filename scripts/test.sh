#!/usr/bin/env bash
# The whole test suite: installs what it needs (each step skipped when nothing changed: scripts/install-deps.sh),
# then runs every tier but the engine in parallel workers and the engine tier in two shards side by side, one
# core each, with the slowest tests and one closing line for all (scripts/run_tiers.py). Extra arguments go to
# pytest, e.g. scripts/test.sh -k parser, scripts/test.sh --lf (the failures of the last run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
exec .venv/bin/python scripts/run_tiers.py all "$@"
