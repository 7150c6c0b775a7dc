#!/usr/bin/env bash
# The whole test suite: installs what it needs (each step skipped when nothing changed: scripts/install-deps.sh),
# and runs every tier but the engine in parallel workers and the engine tier in two shards side by side, one
# core each, with the slowest tests and one closing line for all (scripts/run_tiers.py). Extra arguments go to
# pytest, e.g. scripts/test.sh -k parser, scripts/test.sh --lf (the failures of the last run).
set -euo pipefail
cd "$(dirname "$0")/.."
# the fast tier needs only the Python environment: the Debian packages and vLLM (a minute or more of one core
# unpacking on a fresh machine) install beside it (run_tiers.py --install-rest)
scripts/install-python.sh
exec .venv/bin/python scripts/run_tiers.py all --install-rest "$@"
