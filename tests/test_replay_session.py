"""Pure parts of the replay: prompt-growth arithmetic, the context cap, seeded content, queue and arrivals."""

from __future__ import annotations

import itertools
import statistics

import pytest
from kvwatt_lab.replay.client import SseSplitter
from kvwatt_lab.replay.records import Stats, TurnRecord, _percentile
from kvwatt_lab.replay.runner import SessionQueue, poisson_arrival_offsets
from kvwatt_lab.replay.session import Conversation, planned_prompt_tokens, turns_within_context
from kvwatt_lab.replay.tokens import TokenSource
from kvwatt_lab.replay.traces import Session, Turn

TURNS = (Turn(900, 10, 0.5), Turn(300, 20, 1.0), Turn(40, 70, 0.0))


def test_planned_prompt_lengths_follow_the_trace():
    # turn k = system + inputs[0..k] + outputs[0..k-1]
    assert planned_prompt_tokens(1024, TURNS) == [1024 + 900, 1024 + 900 + 10 + 300, 1024 + 900 + 10 + 300 + 20 + 40]
    assert planned_prompt_tokens(0, ()) == []


def test_context_cap_counts_the_requested_output():
    prompts = planned_prompt_tokens(1024, TURNS)  # [1924, 2234, 2294]
    assert turns_within_context(1024, TURNS, None) == 3
    assert turns_within_context(1024, TURNS, prompts[2] + 70) == 3
    assert turns_within_context(1024, TURNS, prompts[2] + 69) == 2
    assert turns_within_context(1024, TURNS, prompts[1] + 20) == 2
    assert turns_within_context(1024, TURNS, 1933) == 0  # 1924 + 10 > 1933


def test_conversation_grows_by_actual_response_and_tool_output():
    tokens = TokenSource(seed=3)
    system = tokens.system_prompt(16)
    conv = Conversation(Session("s", TURNS), iteration=0, system_ids=system, tokens=tokens)
    p0 = conv.prompt_for(0)
    assert p0[:16] == system and len(p0) == 16 + 900
    response = [7] * 10
    conv.add_response(response)
    p1 = conv.prompt_for(1)
    assert p1[:len(p0)] == p0 and p1[len(p0):len(p0) + 10] == response
    assert p1[len(p0) + 10:] == tokens.turn_input("s", 0, 1, 300)
    assert len(p1) == planned_prompt_tokens(16, TURNS)[1]
    with pytest.raises(ValueError):
        conv.prompt_for(0)


def test_content_is_deterministic_from_the_seed():
    a, b, c = TokenSource(1), TokenSource(1), TokenSource(2)
    assert a.turn_input("s", 0, 0, 500) == b.turn_input("s", 0, 0, 500)
    assert a.turn_input("s", 0, 0, 500) != c.turn_input("s", 0, 0, 500)
    assert a.turn_input("s", 0, 0, 500) != a.turn_input("t", 0, 0, 500)  # sessions share only the system prompt
    assert a.turn_input("s", 0, 0, 500) != a.turn_input("s", 1, 0, 500)  # a replayed session is a new conversation
    assert a.system_prompt(1024)[:100] == a.system_prompt(100)  # one shared prompt, prefixes agree
    ids = a.turn_input("s", 0, 0, 5000)
    assert min(ids) >= 1000 and max(ids) < 2000 and len(set(ids)) > 900
    narrow = TokenSource(1, 4, 8).system_prompt(200)
    assert set(narrow) == {4, 5, 6, 7}


def test_queue_is_a_seeded_shuffle_taken_round_and_round():
    sessions = [Session(str(i), TURNS) for i in range(10)]
    q = SessionQueue(sessions, seed=5, max_sessions=25)
    taken = [q.take() for _ in range(26)]
    assert taken[-1] is None
    first_pass = [s.session_id for s, _ in taken[:10]]
    assert sorted(first_pass) == [str(i) for i in range(10)] and first_pass != sorted(first_pass)
    assert [s.session_id for s, _ in taken[10:20]] == first_pass
    assert [it for _, it in taken[:25]] == [0] * 10 + [1] * 10 + [2] * 5
    again = SessionQueue(sessions, seed=5, max_sessions=None)
    assert [again.take()[0].session_id for _ in range(10)] == first_pass
    other = SessionQueue(sessions, seed=6, max_sessions=None)
    assert [other.take()[0].session_id for _ in range(10)] != first_pass


def test_poisson_arrivals_are_seeded_with_the_right_rate():
    a = list(itertools.islice(poisson_arrival_offsets(4.0, seed=1), 4000))
    assert a == list(itertools.islice(poisson_arrival_offsets(4.0, seed=1), 4000))
    assert a != list(itertools.islice(poisson_arrival_offsets(4.0, seed=2), 4000))
    gaps = [y - x for x, y in zip([0.0] + a, a)]
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd == mean


def test_sse_splitter_handles_any_chunking():
    body = (b'data: {"choices":[{"token_ids":[1,2]}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":4}}\r\n\r\n'
            b'data: [DONE]\n\ndata: {"late":1}\n\n')
    for size in (1, 3, 7, len(body)):
        s = SseSplitter()
        got = [p for i in range(0, len(body), size) for p in s.feed(body[i:i + size])]
        assert got == ['{"choices":[{"token_ids":[1,2]}]}', '{"choices":[],"usage":{"prompt_tokens":4}}']
        assert s.done and s.finish() == []
    s = SseSplitter()
    assert s.feed(b'data: {"x":1}') == [] and s.finish() == ['{"x":1}']


def _record(status, ttft=None, output_tokens=None):
    return TurnRecord("s", 0, 0, status, 1, 100, 5, output_tokens=output_tokens, ttft_seconds=ttft,
                      latency_seconds=ttft)


def test_stats_count_every_status_and_percentiles():
    stats = Stats()
    for i in range(1, 21):
        stats.add(_record("ok", ttft=i / 100, output_tokens=5))
    stats.add(_record("retried", ttft=0.5, output_tokens=5))
    stats.add(_record("error"))
    stats.add(_record("cancelled"))
    s = stats.summary(10.0)
    assert (s["requests"], s["ok"], s["failed"], s["cancelled"], s["retried"]) == (23, 21, 1, 1, 1)
    assert s["prompt_tokens"] == 2100 and s["output_tokens"] == 105
    assert s["output_tokens_per_second"] == 10.5 and s["requests_per_second"] == 2.1
    assert s["ttft_p50_seconds"] == 0.11 and s["ttft_p95_seconds"] == 0.2
    assert _percentile([], 50) is None and _percentile([3.0], 95) == 3.0
