"""The multi-turn workload of vllm-metrics.md: N sessions, each starting with a prompt of ``start`` token
ids; every turn generates ``output`` tokens (ignore_eos) and appends them plus ``tool`` tool-output tokens
to the next turn's prompt. All sessions run concurrently (a small driver; `kvwatt replay` is the full one)."""

from __future__ import annotations

import asyncio
import random

import aiohttp


async def _session(http: aiohttp.ClientSession, url: str, sid: int, start: int, output: int, tool: int,
                   turns: int, tool_delay_seconds: float, vocab: int) -> list[dict]:
    rng = random.Random(sid)  # the session's id seeds its content: same id, same prompts (prefix-cache hits)
    prompt = [rng.randrange(4, vocab) for _ in range(start)]
    usages = []
    for _ in range(turns):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": output, "min_tokens": output,
                "ignore_eos": True, "temperature": 0.0, "return_token_ids": True}
        async with http.post(url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            data = await resp.json()
        choice = data["choices"][0]
        out_ids = choice.get("token_ids") or [rng.randrange(4, vocab) for _ in range(output)]
        usages.append(data["usage"])
        prompt = prompt + list(out_ids) + [rng.randrange(4, vocab) for _ in range(tool)]
        await asyncio.sleep(tool_delay_seconds)
    return usages


async def run_workload(url: str, sessions: int = 10, start: int = 300, output: int = 300, tool: int = 150,
                       turns: int = 4, tool_delay_seconds: float = 0.2, vocab: int = 2048,
                       first_session: int = 0) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=600)
    # a new connection per request: a pooled keep-alive connection that the server closes (uvicorn's 5 s
    # keep-alive) just as a session reuses it fails with ServerDisconnectedError, which a starved CI machine
    # made happen; this driver has no retries (kvwatt replay, the real client, retries)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        results = await asyncio.gather(*(_session(http, url, i, start, output, tool, turns, tool_delay_seconds,
                                                  vocab) for i in range(first_session, first_session + sessions)))
    return [u for r in results for u in r]


def drive(url: str, **kw) -> list[dict]:
    return asyncio.run(run_workload(url, **kw))
