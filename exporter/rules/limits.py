"""Sizes that input may ask for, and their ceilings. Each number in a trace, a plan or a flag that makes kvwatt
allocate (token ids, tasks, runs) is checked against one of these before anything is allocated, so a typo such as
a 1e12-token turn is one error line (exit 2), not a process the kernel kills. Documented in docs/replay.md
("Limits") and docs/experiment.md.
"""

from __future__ import annotations

# A configuration file, experiment plan, model config.json or profile: read whole, then parsed (YAML takes
# ~10x the text in memory). 40,000 servers are 2.5 MB.
MAX_FILE_BYTES = 64 * 2**20

# Tokens one replayed session may hold: system prompt + every input and output it plays. The largest context
# window any model served by vLLM offers (Llama 4 Scout) is 10M tokens; a 10M-token prompt costs the replay
# about 0.6 GB (the ids as Python ints, one copy per request and its JSON body).
MAX_CONTEXT_TOKENS = 10_000_000

# Turns held in memory from one trace file (all sessions together): ~100 bytes each, so about 1 GB.
MAX_TRACE_TURNS = 10_000_000

# Sessions replayed at once in the closed loop (one asyncio task and one conversation each).
MAX_CONCURRENCY = 10_000

# Runs in one experiment (repeats x conditions): each run is minutes of a server; 10,000 is months.
MAX_RUNS = 10_000

# Token ids sent in prompts: vLLM holds them as 32-bit integers.
MAX_TOKEN_ID = 2**31 - 1
