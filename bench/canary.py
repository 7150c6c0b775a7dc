"""Child process for the benchmarks: a host-contention canary. Sleeps 10 ms in a loop for SECONDS and prints
one JSON list of the overshoots (ms). A stall that the canary sees too came from the machine (another
process holding the CPUs), not from the process being measured.

    python bench/canary.py SECONDS
"""

import json
import sys
import time

if __name__ == "__main__":
    end = time.perf_counter() + float(sys.argv[1])
    out = []
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.010)
        out.append(round((time.perf_counter() - t - 0.010) * 1e3, 3))
    print(json.dumps(out))
