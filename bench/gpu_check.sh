#!/usr/bin/env bash
# The GPU checks in one run, on a machine with one NVIDIA GPU, python3 with torch and nvidia-ml-py (and kvwatt's
# runtime dependencies: aiohttp, prometheus-client, pyyaml, requests), from the repository root:
#
#     bench/gpu_check.sh OUT_DIR
#
# 1. bench/gpu_energy_path.py: kvwatt's NVML source on the GPU (read cost, the counter against the integrated
#    power over idle, loaded and idle seconds), while 2. a real `kvwatt run` (NVML on, one server whose engine is
#    absent) watches the same GPU: its /metrics GPU and NVML lines before and after are kept.
# 3. bench/phase_energy_gpu.py: the per-phase estimate (kvwatt's regression) against directly measured prefill
#    and decode costs on a decoder-only transformer of 24 layers x 2048 (random weights).
# Each writes its own file under OUT_DIR; a failing step does not stop the others; the exit status is the
# first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$out"
status=0
step() { local name=$1; shift; echo "=== $name: $*"; "$@" > "$out/$name.json" 2> "$out/$name.err"; local c=$?
         echo "=== $name: exit $c"; tail -3 "$out/$name.err"; [ $status -ne 0 ] || status=$c; }

{ nvidia-smi -L; python3 --version; python3 -c "import torch, pynvml; print('torch', torch.__version__)"; } \
  > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

cfg=$(mktemp -d)
printf 'listen: 127.0.0.1:18492\ninterval: 250ms\nwindows: [10s]\nstate_dir: %s/state\nservers:\n' "$cfg" > "$cfg/k.yaml"
printf '  - {name: gpu0, url: "http://127.0.0.1:1", gpus: ["0"]}\n' >> "$cfg/k.yaml"
python3 -m exporter run --config "$cfg/k.yaml" > "$out/daemon.log" 2>&1 &
daemon=$!
scrape() { python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:18492/metrics').read().decode())" \
  2>&1 | grep -E '^kvwatt_(gpu|source_(up|info)|sample_duration)' | grep -E 'gpu|nvml' > "$out/metrics-$1.txt"; }
sleep 4; scrape before

step energy_path python3 bench/gpu_energy_path.py --idle-seconds 8 --load-seconds 15
scrape after
kill "$daemon"; wait "$daemon" 2>/dev/null

step phase_energy python3 bench/phase_energy_gpu.py --idle-seconds 8 --phase-seconds 15 --windows 30 \
  --window-seconds 5
exit $status
