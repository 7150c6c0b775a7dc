"""Trace loading (both formats), validation with line numbers, and length scaling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvwatt_lab.replay.traces import Session, Turn, load_sessions, scale_session, scale_tokens

from exporter.config import ConfigError

SAMPLE = Path(__file__).parent / "data" / "office_work_8k.sample.jsonl"

AC = {"num_turns": 2, "input_prompt_length": 900, "assistant_response_length": [10, 20],
      "tool_call_output_length": [300, 40], "tool_call_latency": [0.5, 1.25],
      "final_assistant_response_length": 70}


def _write(tmp_path, *lines) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_applied_compute_trace_becomes_num_turns_plus_one_requests(tmp_path):
    [session] = load_sessions(_write(tmp_path, AC))
    assert session.session_id == "trace-1"
    assert session.turns == (Turn(900, 10, 0.5), Turn(300, 20, 1.25), Turn(40, 70, 0.0))
    assert session.system_prompt_tokens is None


def test_sample_file_loads_every_trace():
    sessions = load_sessions(SAMPLE)
    raw = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert len(sessions) == len(raw) == 170
    for session, trace in zip(sessions, raw):
        assert len(session.turns) == trace["num_turns"] + 1
        assert session.turns[0].input_tokens == trace["input_prompt_length"]
        assert session.turns[-1].output_tokens == trace["final_assistant_response_length"]
        assert [t.input_tokens for t in session.turns[1:]] == trace["tool_call_output_length"]
        assert [t.tool_latency_seconds for t in session.turns[:-1]] == trace["tool_call_latency"]


def test_sessions_format_with_defaults_and_override(tmp_path):
    line = {"session": "a", "system_prompt_tokens": 64,
            "turns": [{"input_tokens": 5, "output_tokens": 3, "tool_latency_seconds": 0.2},
                      {"input_tokens": 0, "output_tokens": 1}]}
    [s] = load_sessions(_write(tmp_path, line, "", {"session": 7, "turns": [{"input_tokens": 1, "output_tokens": 2}]}),
                        "sessions")[:1]
    assert s == Session("a", (Turn(5, 3, 0.2), Turn(0, 1, 0.0)), 64)
    both = load_sessions(_write(tmp_path, line, AC))  # auto: per line
    assert [x.session_id for x in both] == ["a", "trace-2"]


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ({"foo": 1}, "line 2: neither an Applied Compute trace"),
    ({**AC, "num_turns": 3}, "line 2: assistant_response_length: has 2 entries, num_turns is 3"),
    ({k: v for k, v in AC.items() if k != "tool_call_latency"}, "line 2: missing tool_call_latency"),
    ({**AC, "assistant_response_length": [10, 0]}, "assistant_response_length[1]: expected an integer >= 1"),
    ({**AC, "tool_call_latency": [0.5, -1]}, "tool_call_latency[1]: expected seconds >= 0"),
    ({**AC, "input_prompt_length": 12.5}, "input_prompt_length: expected an integer"),
    ({**AC, "num_turns": True}, "num_turns: expected an integer"),
    ({"session": "x", "turns": []}, "line 2: turns: expected a non-empty list"),
    ({"session": "", "turns": [{"input_tokens": 1, "output_tokens": 1}]}, "session: expected a non-empty"),
    ({"session": "x", "turns": [{"input_tokens": 1}]}, "turns[0]: missing output_tokens"),
    ({"session": "x", "turns": [{"input_tokens": 1, "output_tokens": 1, "latency": 2}]}, "unknown key 'latency'"),
    ({"session": "trace-1", "turns": [{"input_tokens": 1, "output_tokens": 1}]}, "session 'trace-1' appears twice"),
])
def test_bad_lines_name_the_line(tmp_path, bad, message):
    path = _write(tmp_path, AC, bad)
    with pytest.raises(ConfigError) as info:
        load_sessions(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_explicit_format_rejects_the_other_one(tmp_path):
    with pytest.raises(ConfigError, match=r"line 1: session: expected"):
        load_sessions(_write(tmp_path, AC), "sessions")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_sessions(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no sessions"):
        load_sessions(tmp_path / "empty.jsonl")


def test_scale_tokens_keeps_nonzero_lengths_nonzero():
    assert scale_tokens(8749, 0.1) == 875
    assert scale_tokens(3, 0.1) == 1  # would round to 0
    assert scale_tokens(0, 0.1) == 0
    assert scale_tokens(0, 0.1, minimum=1) == 1
    assert scale_tokens(10, 2.5) == 25


def test_scale_tokens_rounds_halves_up_as_the_docs_say():
    # 9 x 0.5 = 4.5 and 5 x 0.5 = 2.5 exactly: halves go up (round-half-to-even would give 4 and 2)
    assert scale_tokens(9, 0.5) == 5
    assert scale_tokens(5, 0.5) == 3
    assert scale_tokens(7, 0.5) == 4  # 3.5: the same either way
    assert scale_tokens(11, 0.1) == 1  # 1.1: down to the nearest


def test_scale_session_scales_lengths_not_latencies():
    s = Session("a", (Turn(900, 10, 0.5), Turn(0, 3, 2.0)), 1024)
    scaled = scale_session(s, 0.1)
    assert scaled.turns == (Turn(90, 1, 0.5), Turn(0, 1, 2.0))
    assert scaled.system_prompt_tokens == 102
    assert scale_session(s, 1.0) is s
