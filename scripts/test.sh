#!/usr/bin/env bash
# The whole test suite: installs what it needs, then runs pytest (real vLLM engine, Prometheus and
# Alertmanager included). Extra arguments go to pytest, e.g. scripts/test.sh -k parser
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
.venv/bin/python -m pytest -p no:cacheprovider "$@"
