"""The bounds fuzzer's long run: >= 10,000 generated engine sequences (tests/support/fuzz_engine.py) through the
real vLLM adapter and the real Model, every family of every tick held to its declared bound
(exporter/catalog/bounds.py).

    .venv/bin/python bench/fuzz_bounds.py [--sequences 10000] [--seed 20261127] [--workers 1]

Prints the count of violations (a served figure outside its bound: target 0) and the raw figures the one check
rejected, by family, bound kind and cause: the implausible inputs seen so far that explain a rejection of that kind
(tests/support/fuzz_engine.EXPLAINS): "identity" (a start time that moved forward or into the future, a second
process behind the URL: counted whole by store/identity.py today; tokens/s and its dependents), "jump" (a counter
up by 1e7, or the generation counter by 3e8, in one read; tokens/s and the figures computed from the same counts,
bound "dependent"), "stale_idle" (the GPU drew less than its configured P_idle: J/token < 0 and what it prices),
"over_limit" (the GPU drew more than its enforced power limit: the limit relations), "pending:<relation>" (a
declared relation today's derivations break, fixed on another branch: fuzz_engine.PENDING_RELATIONS), or "-"
(nothing explains it: a figure kvwatt derived wrongly, a defect to fix; target 0). A violation is a served figure
outside its bound, a served figure that breaks a declared relation, a served figure computed from counts shown
implausible, or an implausible window in the per-phase history. Then the families served with a value at some tick,
and those never served: the vLLM tiering families (fuzz_engine.TIER_FAMILIES) must all be among the served.
Hypothesis generates the sequences from the seed (generation only, no shrinking: tests/test_fuzz_bounds.py
shrinks); with --workers K, worker k uses seed + k and its share of the sequences. Exit status 1 on a violation
or an own rejection.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from tests.support import fuzz_engine  # noqa: E402


def work(args: tuple[int, int]) -> dict:
    n, worker_seed = args
    logging.disable(logging.CRITICAL)  # the model logs each change once; 10,000 sequences of changes
    total = {"sequences": 0, "ticks": 0, "violations": [], "rejected": {}, "covered": set()}

    @seed(worker_seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz_engine.sequences)
    def one(seq):
        with tempfile.TemporaryDirectory(prefix="kvwatt-fuzz-") as tmp:
            out = fuzz_engine.run(seq, Path(tmp))
        total["sequences"] += 1
        total["ticks"] += out.ticks
        total["violations"] += out.served
        total["covered"] |= out.covered
        for key, v in out.rejected.items():
            total["rejected"][key] = total["rejected"].get(key, 0) + v

    one()
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=20261127)
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    started = time.monotonic()
    shares = [(a.sequences // a.workers + (k < a.sequences % a.workers), a.seed + k) for k in range(a.workers)]
    if a.workers == 1:
        results = [work(shares[0])]
    else:
        with ProcessPoolExecutor(a.workers) as pool:
            results = list(pool.map(work, shares))
    seqs = sum(r["sequences"] for r in results)
    ticks = sum(r["ticks"] for r in results)
    violations = [v for r in results for v in r["violations"]]
    rejected: dict = {}
    for r in results:
        for key, v in r["rejected"].items():
            rejected[key] = rejected.get(key, 0) + v
    own = {k: v for k, v in rejected.items() if not k[2]}
    covered = set().union(*(r["covered"] for r in results))
    never = sorted(m.name for m in fuzz_engine.catalog.METRICS if m.name not in covered)
    print(f"sequences {seqs}, ticks {ticks}, seed {a.seed}"
          f" (workers {a.workers}: seeds {a.seed}..{a.seed + a.workers - 1}),"
          f" {time.monotonic() - started:.0f} s")
    print(f"violations (a served figure outside its bound): {len(violations)}")
    for v in violations[:20]:
        print("  ", v)
    print(f"rejected by the check, no cause in the sequence (kvwatt's own defects): {sum(own.values())}")
    print("rejected by the check, by family, bound and cause:")
    for (fig, kind, cause), v in sorted(rejected.items(), key=lambda kv: -kv[1]):
        print(f"  {v:8d}  {fig} [{kind}] cause={cause or '-'}")
    print(f"families served with a value: {len(covered)} of {len(fuzz_engine.catalog.METRICS)}; never served "
          f"({len(never)}): {', '.join(never)}")
    missed = fuzz_engine.TIER_FAMILIES - covered
    print(f"tier families served: {len(fuzz_engine.TIER_FAMILIES) - len(missed)} of {len(fuzz_engine.TIER_FAMILIES)}"
          + (f"; never: {', '.join(sorted(missed))}" if missed else ""))
    return 1 if violations or own or missed else 0


if __name__ == "__main__":
    sys.exit(main())
