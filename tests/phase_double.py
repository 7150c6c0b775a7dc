"""A power double with known per-phase costs (tests/test_phase_energy.py, bench/phase_energy_gpu.py --dry-run).

Windows of an agentic mix replayed from the shared traces (/work/shared/traces, office_work_8k): each window
serves a random handful of turns; a turn's new prompt tokens (the first prompt, then each tool output and the
previous answer) are computed, its earlier context is a prefix-cache hit, except a share ``pressure`` (drawn per
window: KV pressure varies) that is recomputed or, with offloading on, reloaded. The window's marginal energy
is the known costs x tokens, with multiplicative noise (power varies with batch shape) and additive noise
(the P_idle uncertainty over the window).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from exporter.derive.phase_energy import PhaseWindow

TRACES = Path("/work/shared/traces/office_work_8k.sample.jsonl")
FALLBACK_TRACE = {"input_prompt_length": 8000, "assistant_response_length": [150, 20, 90, 30, 400],
                  "tool_call_output_length": [50, 1100, 10, 3000, 200]}


def turns() -> list[tuple[int, int, int]]:
    """(new prompt tokens, cached context tokens, generated tokens) of every turn of every trace."""
    traces = [json.loads(line) for line in TRACES.read_text().splitlines() if line.strip()] \
        if TRACES.exists() else [FALLBACK_TRACE]
    out = []
    for tr in traces:
        context, new = 0, tr["input_prompt_length"]
        for answer, tool in zip(tr["assistant_response_length"], tr["tool_call_output_length"]):
            out.append((new, context, answer))
            context += new + answer
            new = tool
    return out


def windows(n: int, costs: tuple[float, float, float], seed: int = 0, offload: bool = False,
            turns_per_window: int = 12, rel_noise: float = 0.05, abs_noise_j: float = 150.0,
            constant_mix: bool = False) -> list[PhaseWindow]:
    """``n`` windows with marginal J = c_p*computed + c_g*generated + c_r*reloaded (+ noise). ``constant_mix``:
    every window serves the same turns in proportion (only the load varies), which no regression can split."""
    rng = random.Random(seed)
    pool = turns()
    c_p, c_g, c_r = costs
    out = []
    fixed = rng.sample(pool, turns_per_window)
    for _ in range(n):
        if constant_mix:
            scale = rng.uniform(0.5, 1.5)
            computed = scale * sum(t[0] + 0.2 * t[1] for t in fixed)
            generated, reloaded = scale * sum(t[2] for t in fixed), 0.0
        else:
            chosen = rng.sample(pool, rng.randint(turns_per_window // 2, turns_per_window * 2))
            pressure = rng.uniform(0.0, 0.6)
            new = sum(t[0] for t in chosen)
            cached = sum(t[1] for t in chosen)
            generated = float(sum(t[2] for t in chosen))
            lost = pressure * cached
            computed = new + (0.0 if offload else lost)
            reloaded = lost if offload else 0.0
        clean = c_p * computed + c_g * generated + c_r * reloaded
        joules = clean * (1 + rng.gauss(0, rel_noise)) + rng.gauss(0, abs_noise_j)
        out.append(PhaseWindow(joules, computed, generated, reloaded))
    return out
