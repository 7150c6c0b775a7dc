#!/usr/bin/env bash
# The one install step for kvwatt, shared by the test suite (scripts/install-deps.sh) and the Dockerfile
# (tests/test_deploy*.py checks that both call it). Usage: install-kvwatt.sh PIP TARGET [extra pip args...]
set -euo pipefail
pip=$1; target=$2; shift 2
"$pip" install --no-cache-dir -q "$@" "$target"
