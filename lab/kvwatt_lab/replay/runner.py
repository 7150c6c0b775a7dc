"""The replay loop: sessions from a shuffled circular queue, replayed turn by turn.

Closed loop: ``concurrency`` workers, each replaying one session at a time and taking the next when it ends,
so exactly that many sessions are live. Open loop: sessions arrive as a Poisson process of ``rate`` sessions/s
(seeded), however many are live. Stopping (duration reached, or ``request_stop``) ends every session before its
next turn; an interrupt also cancels requests in flight, which are recorded as ``cancelled``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from exporter.config import ConfigError, redacted_url
from exporter.rules.limits import MAX_CONTEXT_TOKENS
from kvwatt_lab.replay.client import CompletionClient, Outcome
from kvwatt_lab.replay.records import RecordSink, TurnRecord
from kvwatt_lab.replay.session import Conversation, context_needed, fits
from kvwatt_lab.replay.tokens import TokenSource
from kvwatt_lab.replay.traces import Session


@dataclass(frozen=True)
class ReplayOptions:
    concurrency: int | None = 1  # closed loop workers; None with a rate = open loop
    rate_sessions_per_second: float | None = None
    seed: int = 0
    system_prompt_tokens: int = 1024
    latency_scale: float = 1.0
    max_context_tokens: int | None = None
    duration_seconds: float | None = None
    max_sessions: int | None = None  # None: each session once, or unbounded when a duration is set
    retries: int = 2
    retry_backoff_seconds: float = 0.5


# While turns keep failing with transient errors (the server is down or restarting), a closed-loop worker
# waits before it starts its next session: 0.5 s after the first failed turn, doubling with every further one
# (all workers' failures count), at most 10 s. Without it a dead server made --duration write ~470 error
# records a second. The first successful turn ends the pause.
OUTAGE_BACKOFF_FIRST_SECONDS = 0.5
OUTAGE_BACKOFF_MAX_SECONDS = 10.0


class SessionQueue:
    """The sessions in a seeded shuffled order, taken round and round; ``take`` gives (session, iteration)."""

    def __init__(self, sessions: Sequence[Session], seed: int, max_sessions: int | None):
        self._order = list(sessions)
        random.Random(f"kvwatt-replay:{seed}:order").shuffle(self._order)
        self.max_sessions = max_sessions
        self.taken = 0

    def take(self) -> tuple[Session, int] | None:
        if self.max_sessions is not None and self.taken >= self.max_sessions:
            return None
        index, self.taken = self.taken, self.taken + 1
        return self._order[index % len(self._order)], index // len(self._order)


def poisson_arrival_offsets(rate_sessions_per_second: float, seed: int):
    """Arrival times (seconds from start) of a seeded Poisson process: cumulative exponential gaps."""
    rng = random.Random(f"kvwatt-replay:{seed}:arrivals")
    offset_seconds = 0.0
    while True:
        offset_seconds += rng.expovariate(rate_sessions_per_second)
        yield offset_seconds


def system_prompt_tokens(session: Session, options: ReplayOptions) -> int:
    if session.system_prompt_tokens is None:
        return options.system_prompt_tokens
    return session.system_prompt_tokens


class NothingFits(ConfigError):
    """No session's first turn fits the context cap."""


def playable_sessions(sessions: Sequence[Session], options: ReplayOptions,
                      cap_key: str = "--max-context") -> list[Session]:
    """The sessions whose first turn fits the context cap; NothingFits when none does. ConfigError, before any
    token id is drawn, when a session would hold more than MAX_CONTEXT_TOKENS (``cap_key`` names the cap)."""
    if options.system_prompt_tokens > MAX_CONTEXT_TOKENS:
        raise ConfigError(f"system prompt of {options.system_prompt_tokens} tokens (after the length scale) is "
                          f"more than the limit of {MAX_CONTEXT_TOKENS}")
    playable = []
    for s in sessions:
        needed = context_needed(system_prompt_tokens(s, options), s.turns, options.max_context_tokens)
        if needed > MAX_CONTEXT_TOKENS:
            raise ConfigError(f"trace session {s.session_id!r} needs {needed} tokens of context (after the length "
                              f"scale), more than the limit of {MAX_CONTEXT_TOKENS}; set {cap_key} to the "
                              "server's context length")
        if needed:
            playable.append(s)
    if not playable:
        raise NothingFits(f"{cap_key}: no session's first turn fits in {options.max_context_tokens} tokens")
    return playable


class Replay:
    def __init__(self, sessions: Sequence[Session], options: ReplayOptions, client: CompletionClient,
                 sink: RecordSink, tokens: TokenSource | None = None, say: Callable[[str], None] | None = None):
        self.options = options
        self.say = say or (lambda message: None)  # told once when the server stops answering, once when it is back
        self.failing_turns = 0  # consecutive turns failed with a transient error (OUTAGE_BACKOFF_*)
        self.client = client
        self.sink = sink
        self.tokens = tokens or TokenSource(options.seed)
        playable = playable_sessions(sessions, options)
        max_sessions = options.max_sessions
        if max_sessions is None and options.duration_seconds is None:
            max_sessions = len(playable)
        self.queue = SessionQueue(playable, options.seed, max_sessions)
        self._system_ids = self.tokens.system_prompt(max([options.system_prompt_tokens] + [
            s.system_prompt_tokens or 0 for s in playable]))  # only sizes playable_sessions checked
        self.stopping = asyncio.Event()
        self.interrupted = False
        self._tasks: set[asyncio.Task] = set()
        self.started_monotonic = 0.0
        self.counts = dict(sessions_started=0, sessions_finished=0, sessions_completed=0,
                           sessions_cut_by_context=0, sessions_skipped_by_context=len(sessions) - len(playable),
                           max_in_flight_requests=0)
        self.in_flight_requests = 0

    def elapsed_seconds(self) -> float:
        return time.monotonic() - self.started_monotonic if self.started_monotonic else 0.0

    def _offset(self) -> float:
        return round(self.elapsed_seconds(), 6)

    def _past_duration(self) -> bool:
        """The duration is over (stopping from here on): its timer can fire late on a busy event loop, and no
        turn may start after the duration."""
        d = self.options.duration_seconds
        if d is not None and self.started_monotonic and self.elapsed_seconds() >= d:
            self.request_stop()
        return self.stopping.is_set()

    def request_stop(self, interrupt: bool = False) -> None:
        """Start no new turn; with ``interrupt`` also cancel the requests in flight."""
        self.stopping.set()
        if interrupt and not self.interrupted:
            self.interrupted = True
            for task in list(self._tasks):
                task.cancel()

    async def run(self) -> dict:
        """Replay until the queue is exhausted, the duration passes or a stop is requested; the summary."""
        self.started_monotonic = time.monotonic()
        timer = asyncio.create_task(self._stop_at_deadline())
        try:
            if self.options.rate_sessions_per_second:
                await self._open_loop()
            else:
                await self._closed_loop()
        finally:
            timer.cancel()
        return self.summary()

    def summary(self) -> dict:
        o = self.options
        mode = {"mode": "open", "rate_sessions_per_second": o.rate_sessions_per_second} if \
            o.rate_sessions_per_second else {"mode": "closed", "concurrency": o.concurrency}
        return self.sink.stats.summary(self.elapsed_seconds(), **mode, model=self.client.model, seed=o.seed,
                                       interrupted=self.interrupted, **self.counts)

    async def _stop_at_deadline(self) -> None:
        if self.options.duration_seconds is not None:
            await asyncio.sleep(self.options.duration_seconds)
            self.request_stop()

    async def _closed_loop(self) -> None:
        workers = [self._spawn(self._worker(i)) for i in range(self.options.concurrency or 1)]
        _raise_failures(await asyncio.gather(*workers, return_exceptions=True))

    async def _worker(self, worker: int) -> None:
        while not self._past_duration() and (item := self.queue.take()) is not None:
            if self.failing_turns and not await self._sleep_until(time.monotonic() + self.outage_backoff_seconds()):
                return
            await self._play(*item, worker=worker)

    def outage_backoff_seconds(self) -> float:
        """The pause before a new session while turns fail (OUTAGE_BACKOFF_*); 0 when the last turn succeeded."""
        if not self.failing_turns:
            return 0.0
        exponent = min(self.failing_turns - 1, 32)
        return min(OUTAGE_BACKOFF_FIRST_SECONDS * 2 ** exponent, OUTAGE_BACKOFF_MAX_SECONDS)

    def _note_outcome(self, outcome: Outcome) -> None:
        """Count consecutive transient failures; say so when the server stops answering and when it is back."""
        if outcome.completion is not None:
            if self.failing_turns:
                self.say(f"the server at {redacted_url(self.client.base_url)} answers again "
                         f"(after {self.failing_turns} failed turns)")
            self.failing_turns = 0
        elif outcome.transient:
            if not self.failing_turns:
                self.say(f"the server at {redacted_url(self.client.base_url)} is not answering ({outcome.error}); "
                         f"new sessions wait {OUTAGE_BACKOFF_FIRST_SECONDS:g} s, doubling up to "
                         f"{OUTAGE_BACKOFF_MAX_SECONDS:g} s, until a turn succeeds")
            self.failing_turns += 1

    async def _open_loop(self) -> None:
        arrivals = poisson_arrival_offsets(self.options.rate_sessions_per_second, self.options.seed)
        sessions: list[asyncio.Task] = []
        while not self._past_duration() and (item := self.queue.take()) is not None:
            if not await self._sleep_until(self.started_monotonic + next(arrivals)):
                break
            sessions.append(self._spawn(self._play(*item, worker=None)))
        _raise_failures(await asyncio.gather(*sessions, return_exceptions=True))

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self.interrupted:
            task.cancel()
        return task

    async def _sleep_until(self, when_monotonic: float) -> bool:
        """Sleep until ``when_monotonic`` unless stopping first; True when the time came."""
        delay = when_monotonic - time.monotonic()
        if delay > 0:
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
        return not self.stopping.is_set()

    async def _play(self, session: Session, iteration: int, worker: int | None) -> None:
        system_ids = self._system_ids[:system_prompt_tokens(session, self.options)]
        conversation = Conversation(session, iteration, system_ids, self.tokens)
        self.counts["sessions_started"] += 1
        try:
            await self._play_turns(conversation, worker)
        finally:
            self.counts["sessions_finished"] += 1

    async def _play_turns(self, conversation: Conversation, worker: int | None) -> None:
        session = conversation.session
        for index, turn in enumerate(session.turns):
            if self._past_duration():
                return
            if not fits(conversation.context_tokens + turn.input_tokens, turn.output_tokens,
                        self.options.max_context_tokens):
                self.counts["sessions_skipped_by_context" if index == 0 else "sessions_cut_by_context"] += 1
                return
            wait_seconds = await self._turn(conversation, index, worker)
            if wait_seconds is None:
                return
            if wait_seconds > 0 and not await self._sleep_until(time.monotonic() + wait_seconds):
                return
        self.counts["sessions_completed"] += 1

    def _tool_wait_seconds(self, conversation: Conversation, index: int) -> float:
        """The tool latency after turn ``index``, or 0 when no next turn will be sent: after the last turn, and
        after a turn whose successor the context cap cuts (the session ends now, and the next one starts at
        once, so N sessions stay live; measured from the context actually held, responses included)."""
        turns = conversation.session.turns
        if index + 1 >= len(turns):
            return 0.0
        following = turns[index + 1]
        if not fits(conversation.context_tokens + following.input_tokens, following.output_tokens,
                    self.options.max_context_tokens):
            return 0.0
        return turns[index].tool_latency_seconds * self.options.latency_scale

    async def _turn(self, conversation: Conversation, index: int, worker: int | None) -> float | None:
        """Send one turn and record it; the tool latency to wait before the next turn, None when the session
        cannot go on (the record of a failed turn carries the trace's latency, which is not waited)."""
        session, turn = conversation.session, conversation.session.turns[index]
        last = index + 1 >= len(session.turns)
        planned_wait = 0.0 if last else turn.tool_latency_seconds * self.options.latency_scale
        prompt = conversation.prompt_for(index)
        record = TurnRecord(session.session_id, conversation.iteration, index, "error", 0, len(prompt),
                            turn.output_tokens, start_unix_seconds=round(time.time(), 6),
                            start_offset_seconds=self._offset(), tool_latency_seconds=_round(planned_wait),
                            worker=worker)
        self._enter_request()
        outcome = Outcome()
        try:
            await self.client.complete_with_retries(prompt, turn.output_tokens, self.options.retries,
                                                    self.options.retry_backoff_seconds, outcome)
        except asyncio.CancelledError:
            record.status, record.error, record.attempts = "cancelled", "interrupted", outcome.attempts
            record.end_offset_seconds = self._offset()
            self.sink.write(record)
            raise
        finally:
            self.in_flight_requests -= 1
        record.end_offset_seconds = self._offset()
        self._fill(record, outcome)
        self._note_outcome(outcome)
        if outcome.completion is None:
            self.sink.write(record)
            return None
        conversation.add_response(self._response_ids(conversation, index, outcome))
        wait_seconds = self._tool_wait_seconds(conversation, index)
        record.tool_latency_seconds = _round(wait_seconds)
        self.sink.write(record)
        return wait_seconds

    def _enter_request(self) -> None:
        self.in_flight_requests += 1
        self.counts["max_in_flight_requests"] = max(self.counts["max_in_flight_requests"], self.in_flight_requests)

    @staticmethod
    def _fill(record: TurnRecord, outcome: Outcome) -> None:
        record.attempts, record.error = outcome.attempts, outcome.error
        c = outcome.completion
        if c is None:
            return
        record.status = "ok" if outcome.attempts == 1 else "retried"
        record.server_prompt_tokens, record.output_tokens = c.server_prompt_tokens, c.server_output_tokens
        record.ttft_seconds, record.latency_seconds = _round(c.ttft_seconds), _round(c.latency_seconds)

    def _response_ids(self, conversation: Conversation, index: int, outcome: Outcome) -> list[int]:
        c = outcome.completion
        if c.token_ids_returned:
            return c.token_ids
        return self.tokens.response_filler(conversation.session.session_id, conversation.iteration, index,
                                           c.server_output_tokens or 0)


def _raise_failures(results: list) -> None:
    """Cancellation is how an interrupt ends a session; anything else (a bug, a full disk) must surface."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
