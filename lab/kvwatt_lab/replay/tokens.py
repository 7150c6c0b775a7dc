"""Deterministic synthetic token ids: the same seed gives the same content, byte for byte, on every run.

String seeds go through SHA-512 in ``random.Random``, so the ids do not depend on PYTHONHASHSEED or platform."""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_TOKEN_ID_RANGE = (1000, 2000)  # ordinary tokens in any vocabulary of >= 2000 ids, clear of low specials


@dataclass(frozen=True)
class TokenSource:
    seed: int
    low_id: int = DEFAULT_TOKEN_ID_RANGE[0]
    high_id: int = DEFAULT_TOKEN_ID_RANGE[1]  # exclusive

    def _ids(self, key: str, count_tokens: int) -> list[int]:
        rng = random.Random(f"kvwatt-replay:{self.seed}:{key}")
        return rng.choices(range(self.low_id, self.high_id), k=count_tokens)

    def system_prompt(self, count_tokens: int) -> list[int]:
        """The shared system prompt. A shorter one is a prefix of a longer one (same seed)."""
        return self._ids("system", count_tokens)

    def turn_input(self, session_id: str, iteration: int, turn: int, count_tokens: int) -> list[int]:
        """New tokens a turn appends before its request: the user prompt (turn 0) or the tool output.

        ``iteration`` counts replays of the same trace, so a trace replayed again is a new conversation."""
        return self._ids(f"input:{session_id}:{iteration}:{turn}", count_tokens)

    def response_filler(self, session_id: str, iteration: int, turn: int, count_tokens: int) -> list[int]:
        """Stand-in response ids for servers that do not return token ids (not vLLM)."""
        return self._ids(f"response:{session_id}:{iteration}:{turn}", count_tokens)
