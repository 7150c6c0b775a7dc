"""How a conversation's prompt grows, as pure arithmetic and as token ids.

Turn k's prompt = system prompt + turn 0 input + (response j + turn j+1 input for every j < k), so with exact
output lengths its length is ``system + sum(input[0..k]) + sum(output[0..k-1])``. The context cap ends a session
before the first turn whose prompt + requested output would exceed it (no truncation: every prompt stays an
extension of the previous one, which is what prefix caching and offloading act on).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwatt_lab.replay.tokens import TokenSource
from kvwatt_lab.replay.traces import Session, Turn


def planned_prompt_tokens(system_prompt_tokens: int, turns: Sequence[Turn]) -> list[int]:
    """Prompt length of every turn, assuming each response has exactly the requested length."""
    lengths, context = [], system_prompt_tokens
    for turn in turns:
        context += turn.input_tokens
        lengths.append(context)
        context += turn.output_tokens
    return lengths


def turns_within_context(system_prompt_tokens: int, turns: Sequence[Turn], max_context_tokens: int | None) -> int:
    """How many leading turns fit: prompt + requested output <= ``max_context_tokens`` (None: all)."""
    if max_context_tokens is None:
        return len(turns)
    for index, (prompt, turn) in enumerate(zip(planned_prompt_tokens(system_prompt_tokens, turns), turns)):
        if prompt + turn.output_tokens > max_context_tokens:
            return index
    return len(turns)


def context_needed(system_prompt_tokens: int, turns: Sequence[Turn], max_context_tokens: int | None) -> int:
    """Tokens the conversation holds at its end: the last turn that fits, its prompt plus its output (0 when
    even the first turn does not fit)."""
    played = turns_within_context(system_prompt_tokens, turns, max_context_tokens)
    if played == 0:
        return 0
    return planned_prompt_tokens(system_prompt_tokens, turns[:played])[-1] + turns[played - 1].output_tokens


def fits(prompt_tokens: int, output_tokens: int, max_context_tokens: int | None) -> bool:
    return max_context_tokens is None or prompt_tokens + output_tokens <= max_context_tokens


class Conversation:
    """The token ids of one replay of one session: ``prompt_for(k)`` then ``add_response(ids)``, turn by turn."""

    def __init__(self, session: Session, iteration: int, system_ids: Sequence[int], tokens: TokenSource):
        self.session = session
        self.iteration = iteration
        self._tokens = tokens
        self._context: list[int] = list(system_ids)
        self._next_turn = 0

    @property
    def context_tokens(self) -> int:
        return len(self._context)

    def prompt_for(self, turn_index: int) -> list[int]:
        """The full prompt of turn ``turn_index``: the context so far plus this turn's new input."""
        if turn_index != self._next_turn:
            raise ValueError(f"turn {turn_index} requested, expected turn {self._next_turn}")
        turn = self.session.turns[turn_index]
        self._context += self._tokens.turn_input(self.session.session_id, self.iteration, turn_index,
                                                 turn.input_tokens)
        self._next_turn += 1
        return list(self._context)

    def add_response(self, response_ids: Sequence[int]) -> None:
        """Append the model's actual response, so the next prompt carries it."""
        self._context += list(response_ids)
