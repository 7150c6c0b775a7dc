"""Every state file (idle baselines, reference shares, evidence windows) is read through atomic.read_state_json:
a regular file only, opened without following a link or blocking on a FIFO, bounded in size and in nesting, its
header checked strictly. A file that is none of ours is ignored with a reason, never a crash or a hang at start."""

from __future__ import annotations

import json
import os
import time

import pytest

from exporter.idle import baseline
from exporter.model import evidence_book, reference_book
from exporter.runtime import atomic

PARSERS = {
    baseline.STATE_FILE: baseline.parse_file,
    reference_book.STATE_FILE: reference_book.parse_file,
    evidence_book.STATE_FILE: evidence_book.parse_file,
}
NOW = time.time()


def _read(path):
    return atomic.read_state_json(str(path), PARSERS[path.name], NOW)


@pytest.fixture(params=sorted(PARSERS))
def state_file(request, tmp_path):
    return tmp_path / request.param


def test_a_fifo_is_ignored_without_blocking(state_file):
    os.mkfifo(state_file)
    started = time.monotonic()
    good, problem = _read(state_file)
    # a blocking open of a FIFO with no writer never returns: the bound is the test runner's, not a speed target
    assert time.monotonic() - started < 5.0
    assert good is None and problem.startswith("ignored:") and "regular file" in problem


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom"])
def test_a_link_to_a_device_is_not_read(state_file, target):
    os.symlink(target, state_file)
    good, problem = _read(state_file)
    assert good is None and problem.startswith("ignored:")


def test_a_link_to_a_good_file_is_not_followed(state_file, tmp_path):
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"version": 1}))
    os.symlink(real, state_file)
    good, problem = _read(state_file)
    assert good is None and problem.startswith("ignored:")


def test_deep_nesting_is_refused(state_file):
    state_file.write_text("[" * 100_000 + "]" * 100_000)
    good, problem = _read(state_file)
    assert good is None and problem.startswith("ignored:")


def test_an_oversized_file_is_refused_before_parsing(state_file):
    with open(state_file, "w") as f:
        f.write('{"version": 1, "pad": "')
        f.write("x" * atomic.STATE_FILE_MAX_BYTES)
        f.write('"}')
    good, problem = _read(state_file)
    assert good is None and "limit" in problem


@pytest.mark.parametrize("version", [True, "1", 1.5, None])
def test_the_version_is_checked_strictly(state_file, version):
    state_file.write_text(json.dumps({"version": version}))
    good, problem = _read(state_file)
    assert good is None and "unknown version" in problem


def test_a_good_empty_file_reads(state_file):
    key = {baseline.STATE_FILE: "devices"}.get(state_file.name, "servers")
    version = evidence_book.FORMAT_VERSION if state_file.name == evidence_book.STATE_FILE else 1
    state_file.write_text(json.dumps({"version": version, key: {}}))
    assert _read(state_file) == ({}, "")
