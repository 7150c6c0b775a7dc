"""Per-phase GPU energy measured directly against kvwatt's regression estimate (methods.md s12), on one GPU.

    python bench/phase_energy_gpu.py                 # a GPU machine: torch + pynvml (nvidia-ml-py) + exporter/
    python bench/phase_energy_gpu.py --dry-run       # anywhere torch runs (CPU): tiny model, a power double

A real decoder-only transformer in PyTorch (random weights; size by --layers/--hidden; the compute pattern,
not the weights, sets the energy) is driven in three parts, each on NVML's total-energy counter:

1. idle: P_idle over --idle-seconds with the model loaded and nothing running.
2. direct: a prefill-only phase (batches of fresh prompts: computed prompt tokens only) and a decode-only
   phase (a batch stepping one token at a time over a KV cache of --context tokens: generated tokens only),
   each --phase-seconds long. J per computed prompt token = (E - P_idle dt) / prompt tokens; J per generated
   token likewise. These are the independent measurements.
3. mixed: --windows windows of --window-seconds, each spending a random share of its time on prefill and the
   rest on decode (the agentic mix: the share varies per window). Each window's energy and token counts
   become an exporter Interval and go through kvwatt's own path: store.buckets_of -> phase_energy.observations
   -> phase_energy.estimate (the daemon's regression, rules' thresholds).

The run passes (exit 0) when each estimated cost agrees with the direct one within max(3.5 SE, --tolerance
relative): the direct phases carry their own noise and the mixed windows add prefill/decode interference the
direct phases do not have, so a bias of a few per cent is expected. Prints one JSON document. Exit 1: they
disagree; exit 2: bad arguments or no GPU/NVML (one line, no traceback).

--dry-run: on CPU with a tiny model; the energy is a power double (P_idle + a marginal power per phase times
the time spent in it, plus noise), so the direct costs are known to the double and the check proves the
harness (timing, token counting, the windows through kvwatt's estimator), not a CPU's energy.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from exporter import rules  # noqa: E402
from exporter.derive import phase_energy  # noqa: E402
from exporter.samples import Interval  # noqa: E402
from exporter.store import buckets_of  # noqa: E402

DRY_COSTS = {"prefill": 0.03, "decode": 0.4}  # --dry-run: the double's J per computed / generated token


class Fail(Exception):
    """Bad input or missing hardware: one line, exit 2."""


# --- the model --------------------------------------------------------------------------------------------
def build_model(torch, layers: int, hidden: int, heads: int, vocab: int, device: str, dtype):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
            self.out = nn.Linear(hidden, hidden, bias=False)
            self.up = nn.Linear(hidden, 4 * hidden, bias=False)
            self.down = nn.Linear(4 * hidden, hidden, bias=False)

        def forward(self, x, cache):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
            if cache is not None:  # decode: attend to the cached keys and values, then extend them
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, hidden))
            return x + self.down(F.gelu(self.up(self.ln2(x)))), (k, v)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids, caches=None):
            x = self.emb(ids)
            new = []
            for i, blk in enumerate(self.blocks):
                x, kv = blk(x, None if caches is None else caches[i])
                new.append(kv)
            return self.head(x[:, -1:]), new

    return Model().to(device=device, dtype=dtype).eval()


class Work:
    """Prefill and decode steps of the model, counting the tokens each processed."""

    def __init__(self, torch, model, args, device):
        self.torch, self.model, self.args, self.device = torch, model, args, device
        self.caches = None

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def prefill(self) -> float:
        """One batch of fresh prompts: returns the computed prompt tokens."""
        a = self.args
        ids = self.torch.randint(0, a.vocab, (a.prefill_batch, a.prompt), device=self.device)
        with self.torch.no_grad():
            self.model(ids)
        self.sync()
        return float(a.prefill_batch * a.prompt)

    def decode(self) -> float:
        """One decode step of the batch over its cache (rebuilt by a prefill not counted, off the clock of the
        phases: ``reset_cache`` is called between phases); returns the generated tokens."""
        a = self.args
        if self.caches is None or self.caches[0][0].shape[2] >= a.context + a.max_new:
            self.reset_cache()
        ids = self.torch.randint(0, a.vocab, (a.decode_batch, 1), device=self.device)
        with self.torch.no_grad():
            _, self.caches = self.model(ids, self.caches)
        self.sync()
        return float(a.decode_batch)

    def reset_cache(self):
        a = self.args
        ids = self.torch.randint(0, a.vocab, (a.decode_batch, a.context), device=self.device)
        with self.torch.no_grad():
            _, self.caches = self.model(ids)
        self.sync()


# --- energy -----------------------------------------------------------------------------------------------
class NvmlEnergy:
    """Joules from NVML's total-energy counter (Volta+), mJ resolution."""

    def __init__(self, index: int):
        try:
            import pynvml
        except ImportError as e:
            raise Fail(f"pynvml (nvidia-ml-py) is not installed: {e}")
        try:
            pynvml.nvmlInit()
            self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
            self.joules()
        except Exception as e:  # NVMLError: no GPU, no counter
            raise Fail(f"NVML energy counter unavailable on GPU {index}: {e}")

    def joules(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.h) / 1000.0

    def note(self, phase: str, seconds: float, tokens: float) -> None:
        pass  # the counter measures


class DoubleEnergy:
    """--dry-run: P_idle x wall time plus a known marginal cost per token of each phase (5 % noise per step).
    Per token, not per second: a shared CPU's step times vary with other load, which would make the double's
    costs move; fixed per-token costs make the check exact about the harness (token counting, windows,
    kvwatt's estimator) and nothing else."""

    def __init__(self, idle_watts: float, joules_per_token: dict[str, float], seed: int):
        self.idle, self.cost, self.rng = idle_watts, joules_per_token, random.Random(seed)
        self.t0, self.busy = time.perf_counter(), 0.0

    def note(self, phase: str, seconds: float, tokens: float) -> None:
        self.busy += self.cost[phase] * tokens * (1 + self.rng.gauss(0, 0.05))

    def joules(self) -> float:
        return self.idle * (time.perf_counter() - self.t0) + self.busy


def run_for(work: Work, energy, phase: str, seconds: float) -> tuple[float, float, float, float]:
    """Run ``phase`` (prefill | decode) for ``seconds``: (joules, seconds, computed prompt, generated tokens)."""
    step = work.prefill if phase == "prefill" else work.decode
    e0, t0 = energy.joules(), time.perf_counter()
    tokens = 0.0
    while time.perf_counter() - t0 < seconds:
        s = time.perf_counter()
        n = step()
        tokens += n
        energy.note(phase, time.perf_counter() - s, n)
    e1, t1 = energy.joules(), time.perf_counter()
    return e1 - e0, t1 - t0, tokens if phase == "prefill" else 0.0, tokens if phase == "decode" else 0.0


def idle_watts(energy, seconds: float) -> float:
    e0, t0 = energy.joules(), time.perf_counter()
    time.sleep(seconds)
    return (energy.joules() - e0) / (time.perf_counter() - t0)


def direct(work, energy, p_idle: float, seconds: float) -> dict:
    out = {}
    for phase in ("prefill", "decode"):
        work.reset_cache()
        j, dt, computed, generated = run_for(work, energy, phase, seconds)
        tokens = computed or generated
        out[phase] = {"joules": j, "seconds": dt, "tokens": tokens,
                      "marginal_joules_per_token": (j - p_idle * dt) / tokens if tokens else None}
    return out


def mixed_windows(work, energy, p_idle: float, n: int, width: float, seed: int) -> list[Interval]:
    """Each window: a random share of its time on prefill, the rest on decode; one Interval per window on a
    grid of ``width`` seconds (kvwatt's repeat-window rule), idle energy = P_idle x its wall time."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        share = rng.uniform(0.05, 0.6)
        work.reset_cache()
        jp, dtp, computed, _ = run_for(work, energy, "prefill", share * width)
        jd, dtd, _, generated = run_for(work, energy, "decode", (1 - share) * width)
        dt = dtp + dtd
        out.append(Interval(t0=k * width, t1=(k + 1) * width,
                            deltas={"generation_tokens": generated, "prompt_local_compute": computed,
                                    "prompt_local_cache_hit": 0.0, "prompt_external_kv_transfer": 0.0},
                            gauges={}, energy_joules={"gpu": jp + jd}, idle_joules={"gpu": p_idle * dt}))
    return out


def compare(costs: phase_energy.PhaseCosts, direct_costs: dict, tolerance: float) -> dict:
    out, ok = {}, costs.state == "known"
    for phase, name in (("prompt_computed", "prefill"), ("generated", "decode")):
        want, got, se = direct_costs[name]["marginal_joules_per_token"], costs.joules(phase), costs.stderr(phase)
        agree = None
        if want is not None and got is not None:
            slack = max(3.5 * (se or 0.0), tolerance * abs(want))
            agree = abs(got - want) <= slack
        ok = ok and bool(agree)
        out[phase] = {"direct": want, "estimate": got, "stderr": se,
                      "relative_error": None if not want or got is None else (got - want) / want, "agree": agree}
    return {"ok": ok, "phases": out}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, a power double instead of NVML")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None, help="tokens per prefill prompt")
    p.add_argument("--prefill-batch", type=int, default=None)
    p.add_argument("--decode-batch", type=int, default=None)
    p.add_argument("--context", type=int, default=None, help="KV cache length decode steps attend over")
    p.add_argument("--max-new", type=int, default=256, help="decode steps before the cache is rebuilt")
    p.add_argument("--idle-seconds", type=float, default=None)
    p.add_argument("--phase-seconds", type=float, default=None)
    p.add_argument("--windows", type=int, default=None)
    p.add_argument("--window-seconds", type=float, default=None)
    p.add_argument("--tolerance", type=float, default=None,
                   help="relative agreement accepted besides 3.5 SE (default 0.15; --dry-run 0.05)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    small = a.dry_run
    defaults = {"vocab": (1000, 32000), "layers": (2, 24), "hidden": (128, 2048), "heads": (4, 16),
                "prompt": (64, 2048), "prefill_batch": (2, 8), "decode_batch": (4, 64), "context": (64, 2048),
                "idle_seconds": (0.5, 10.0), "phase_seconds": (1.0, 30.0), "windows": (30, 60),
                "window_seconds": (0.5, 10.0), "tolerance": (0.05, 0.15)}
    for k, (dry, gpu) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, dry if small else gpu)
    if a.hidden % a.heads or min(a.layers, a.hidden, a.prompt, a.prefill_batch, a.decode_batch, a.context,
                                 a.windows) <= 0 or a.window_seconds <= 0 or a.phase_seconds <= 0:
        raise Fail("sizes must be positive and --hidden a multiple of --heads")
    if a.windows < rules.PHASE_MIN_WINDOWS.default:
        raise Fail(f"--windows {a.windows}: the estimate needs >= {rules.PHASE_MIN_WINDOWS.default}"
                   " (phase_min_windows)")
    return a


def main(argv=None) -> int:
    try:
        a = parse(argv)
        try:
            import torch
        except ImportError as e:
            raise Fail(f"torch is not installed: {e}")
        torch.manual_seed(a.seed)
        if a.dry_run:
            device, dtype = "cpu", torch.float32
            torch.set_num_threads(1)  # a shared CPU: one thread keeps step times steady
            energy = DoubleEnergy(50.0, DRY_COSTS, a.seed)
        else:
            if not torch.cuda.is_available():
                raise Fail("no CUDA device (use --dry-run to check the harness on CPU)")
            device, dtype = "cuda", torch.bfloat16
            torch.cuda.set_device(a.gpu)
            energy = NvmlEnergy(a.gpu)
    except Fail as e:
        print(f"phase_energy_gpu: {e}", file=sys.stderr)
        return 2
    model = build_model(torch, a.layers, a.hidden, a.heads, a.vocab, device, dtype)
    work = Work(torch, model, a, device)
    work.prefill(), work.reset_cache(), work.decode()  # warm-up (kernels, allocator) off the clock
    p_idle = idle_watts(energy, a.idle_seconds)
    d = direct(work, energy, p_idle, a.phase_seconds)
    ivs = mixed_windows(work, energy, p_idle, a.windows, a.window_seconds, a.seed)
    obs = phase_energy.observations(buckets_of(ivs, a.window_seconds), a.window_seconds, "gpu")
    costs = phase_energy.estimate(obs, "gpu", rules.PHASE_MIN_WINDOWS.default, rules.PHASE_MAX_CONDITION.default,
                                  rules.LOAD_TO_COMPUTE_COST_RATIO.default)
    result = compare(costs, d, a.tolerance)
    report = {"device": "cpu (power double)" if a.dry_run else torch.cuda.get_device_name(a.gpu),
              "model": {"layers": a.layers, "hidden": a.hidden, "parameters":
                        sum(p.numel() for p in model.parameters())},
              "idle_watts": p_idle, "direct": d,
              "estimate": {"state": costs.state, "reason": costs.reason, "windows": costs.windows,
                           "condition": None if costs.condition is None or math.isinf(costs.condition)
                           else costs.condition},
              **result}
    if a.dry_run:
        report["double"] = {"joules_per_token": DRY_COSTS,
                            "note": "energy is a power double: the check proves the harness, not a CPU's energy"}
    print(json.dumps(report, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
