#!/usr/bin/env bash
# The fast tier (make test-fast): every test but those marked engine, prom, browser or slow, in parallel workers.
# Installs only the Python environment it needs (scripts/install-python.sh: no apt, no vLLM, no root; skipped
# when nothing changed). Extra arguments go to pytest, e.g. scripts/test-fast.sh --lf
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-python.sh
exec .venv/bin/python scripts/run_tiers.py fast "$@"
