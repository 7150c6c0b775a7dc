"""The protocol (methods.md s2), run by run: start the server, wait for /health, settle, idle baseline,
warm-up, measurement, cool-down, stop. The load is one closed-loop replay spanning warm-up and
measurement, so the measurement window opens on a warm, steady engine; it is stopped (requests in flight
cancelled) once the window has closed. A watcher ends the run with RunFailed the moment the server process
exits or stops answering, whatever the phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp

from exporter.config import redacted_url
from exporter.runtime import atomic
from kvwatt_lab import cpu_engine
from kvwatt_lab.experiment import report
from kvwatt_lab.experiment.measure import RunSampler, interval_rows, window_figures
from kvwatt_lab.experiment.plan import Condition, Plan, RunSpec, Tiered, template_values
from kvwatt_lab.experiment.power_double import PowerDouble
from kvwatt_lab.experiment.server import (
    RunFailed,
    ServerProcess,
    describe_exit,
    ensure_nothing_listening,
    first_model,
    free_port,
)
from kvwatt_lab.experiment.state import ExperimentState
from kvwatt_lab.experiment.template import render_argv, substitute
from kvwatt_lab.replay.client import CompletionClient
from kvwatt_lab.replay.records import RecordSink
from kvwatt_lab.replay.runner import Replay
from kvwatt_lab.replay.tokens import TokenSource
from kvwatt_lab.replay.traces import load_sessions, scale_session

Say = Callable[[str], None]
WATCH_SECONDS = 0.2


@dataclass
class Phase:
    name: str


@dataclass(frozen=True)
class Launch:
    """What one run executes: argv, environment and URL after substitution."""

    argv: list[str]
    env: dict[str, str]
    url: str
    engine_id: str | None = None     # a tiered condition's engine: names its CPU tier's shared-memory file
    disk_dir: str | None = None      # a tiered condition's disk tier: the run's own directory


def launch_for(plan: Plan, condition: Condition, run: RunSpec, port: int, run_dir: str) -> Launch:
    values = template_values(plan, condition, run, port, run_dir)
    index = plan.conditions.index(condition)
    argv = (render_argv(plan.server.command, values, "server.command")
            + render_argv(condition.args, values, f"conditions[{index}].args"))
    env = {k: substitute(v, values, f"server.env.{k}") for k, v in plan.server.env.items()}
    env.update({k: substitute(v, values, f"conditions[{index}].env.{k}") for k, v in condition.env.items()})
    engine_id = disk_dir = None
    if condition.tiered is not None:
        argv, env, engine_id, disk_dir = _tiered_launch(condition.tiered, run, argv, env)
    return Launch(plan_relative_program(argv, plan.plan_dir), env,
                  substitute(plan.server.url, values, "server.url").rstrip("/"), engine_id, disk_dir)


def _tiered_launch(tiered: Tiered, run: RunSpec, argv: list[str], env: dict[str, str]):
    """The tiered engine's --kv-transfer-config (kvwatt_lab.cpu_engine.tiered_args) with an engine id of the run's
    own, and lab/ on the engine's PYTHONPATH (vLLM imports the spec in its three processes)."""
    engine_id = cpu_engine.new_engine_id()
    disk_dir = None if tiered.disk_dir is None else os.path.join(tiered.disk_dir, run.run_id)
    extra = cpu_engine.tiered_args(tiered.cpu_mib, disk_dir, tiered.disk, engine_id=engine_id, link=tiered.link,
                                   io_threads=tiered.io_threads, check_version=False)
    return argv + extra, {**env, **cpu_engine.offload_env(env)}, engine_id, disk_dir


def _clean_tiers(launch: Launch) -> dict:
    """After a tiered run, whatever its end: the CPU tier's shared-memory file (a hard kill before the engine's
    first transfer leaves it) and the run's disk-tier directory with its block files, and how much it held."""
    out: dict = {}
    if launch.engine_id is not None:
        out["shm_left"] = cpu_engine.remove_shared_region(launch.engine_id)
    if launch.disk_dir is not None and os.path.isdir(launch.disk_dir):
        files = [os.path.join(d, f) for d, _, names in os.walk(launch.disk_dir) for f in names]
        out["disk_files"] = len(files)
        out["disk_bytes"] = sum(os.path.getsize(f) for f in files if os.path.exists(f))
        shutil.rmtree(launch.disk_dir, ignore_errors=True)
    return out


def plan_relative_program(argv: list[str], plan_dir: str) -> list[str]:
    """A relative program path (``../.venv-vllm/bin/python``) and a ``--model`` given as ``./`` or ``../`` path
    are the plan file's, like every path in a plan (docs/experiment.md "Paths"), never the working directory's;
    a bare program name (``vllm``) is looked up on PATH, a bare model name (``org/model``) is the engine's."""
    base = os.path.abspath(plan_dir)
    out = list(argv)
    if out and "/" in out[0] and not os.path.isabs(out[0]):
        out[0] = os.path.normpath(os.path.join(base, out[0]))
    for i in range(1, len(out) - 1):
        if out[i] == "--model" and out[i + 1].startswith(("./", "../")):
            out[i + 1] = os.path.normpath(os.path.join(base, out[i + 1]))
    return out


# ------------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------------
async def execute_run(plan: Plan, run: RunSpec, run_dir: str, say: Say,
                      on_start: Callable[[int], None] = lambda pid: None) -> dict:
    condition = plan.condition(run.condition)
    launch = launch_for(plan, condition, run, plan.server.port or free_port(), run_dir)
    server = ServerProcess(launch.argv, launch.env, os.path.join(run_dir, "server.log"))
    result = {"run": run.run_id, "condition": run.condition, "repeat": run.repeat, "params": dict(condition.params),
              "argv": launch.argv,
              "url": redacted_url(launch.url), "started_unix": time.time()}
    try:
        await ensure_nothing_listening(launch.url)
        server.start()
        on_start(server.proc.pid)
        say(f"{run.run_id}: server starting ({redacted_url(launch.url)})")
        estimate = plan.server.startup_estimate_seconds
        async with heartbeat(say, estimate, lambda s: f"{run.run_id}: server starting: {s:.0f} s so far (estimate "
                             f"{estimate:g} s, timeout {plan.server.startup_timeout_seconds:g} s)"):
            result["startup_seconds"] = await server.wait_healthy(launch.url, plan.server.startup_timeout_seconds)
        say(f"{run.run_id}: healthy after {result['startup_seconds']:.1f} s")
        with _energy_root(plan, launch.url, run_dir) as powercap_root:
            result.update(await _measure(plan, condition, run, run_dir, launch.url, server, say, powercap_root))
    except RunFailed as e:
        tail = "".join(f"\n    | {line}" for line in server.log_tail().splitlines())
        raise RunFailed(f"{e} (server log: {server.log_path}){tail}") from None
    finally:
        server.stop(plan.server.stop_timeout_seconds)
        if condition.tiered is not None:
            result["tiered"] = {"engine_id": launch.engine_id, "disk_dir": launch.disk_dir, **_clean_tiers(launch)}
    result["finished_unix"] = time.time()
    return result


@contextlib.contextmanager
def _energy_root(plan: Plan, url: str, run_dir: str):
    """The powercap root the run reads: the plan's, or the tree of the run's own power double (from /health to
    the end of the cool-down, so its idle baseline and its window are the double's)."""
    model = plan.energy.power_double
    if model is None:
        yield None
        return
    with PowerDouble(model, url, os.path.join(run_dir, "power-double")) as root:
        yield root


async def _measure(plan: Plan, condition: Condition, run: RunSpec, run_dir: str, url: str,
                   server: ServerProcess, say: Say, powercap_root: str | None = None) -> dict:
    sampler = RunSampler(plan, url, os.path.join(run_dir, "state"), powercap_root)
    sampler.start()
    phase = Phase("settle")
    try:
        measured = await _guarded(_phases(plan, condition, run, run_dir, url, sampler, phase, say),
                                  _watch(server, sampler, phase, plan.server.unresponsive_timeout_seconds))
    finally:
        sampler.close()
        atomic.write_text(os.path.join(run_dir, "intervals.jsonl"),
                          "".join(json.dumps(r) + "\n" for r in interval_rows(sampler.intervals())))
    measured["server"] = sampler.server_facts()
    return measured


async def _phases(plan: Plan, condition: Condition, run: RunSpec, run_dir: str, url: str, sampler: RunSampler,
                  phase: Phase, say: Say) -> dict:
    p = plan.phases
    marks: dict[str, list[float]] = {}
    await _phase(phase, "settle", p.settle_seconds, marks)
    sampler.begin_idle()
    await _phase(phase, "idle", p.idle_seconds, marks)
    idle = sampler.end_idle()
    say(f"{run.run_id}: idle baseline " + (", ".join(f"{d} {w:.2f} W" for d, w in idle["watts"].items())
                                           or "not measured (no energy source)"))
    phase.name = "warm-up"
    replay = await _replay(plan, condition, run, run_dir, url, sampler, phase, marks, say)
    window = sampler.intervals_between(*marks["measure"])
    await _phase(phase, "cool-down", p.cooldown_seconds, marks)
    return {"phases": marks, "idle": idle, "window": window_figures(window, plan.energy.min_load_seconds),
            "replay": replay}


async def _phase(phase: Phase, name: str, seconds: float, marks: dict) -> None:
    phase.name = name
    start = time.monotonic()
    await asyncio.sleep(seconds)
    marks[name] = [start, time.monotonic()]


async def _replay(plan: Plan, condition: Condition, run: RunSpec, run_dir: str, url: str, sampler: RunSampler,
                  phase: Phase, marks: dict, say: Say) -> dict:
    """Warm-up and measurement under one replay; the measurement window is [warm-up end, + measure]."""
    w, p = condition.workload, plan.phases
    model = plan.server.model or await first_model(url)
    sessions = [scale_session(s, w.length_scale) for s in load_sessions(w.trace, w.format)]
    records = os.path.join(run_dir, "turns.jsonl")
    sink = RecordSink(records)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        client = CompletionClient(http, url, model, w.request_timeout_seconds)
        # the replay is stopped once the window has closed; its own duration is only a backstop
        bound_seconds = p.warmup_seconds + p.measure_seconds + 10 * plan.sample_interval_seconds + 30
        replay = Replay(sessions, w.replay_options(bound_seconds), client, sink, TokenSource(w.seed),
                        say=lambda message: say(f"{run.run_id}: {message}"))
        start = time.monotonic()
        task = asyncio.create_task(replay.run())
        try:
            await _until(task, start + p.warmup_seconds)
            phase.name = "measurement"
            t0 = time.monotonic()
            say(f"{run.run_id}: measuring for {p.measure_seconds:g} s")
            stats = sink.stats
            async with heartbeat(say, p.measure_seconds, lambda s: (
                    f"{run.run_id}: measuring: {min(s, p.measure_seconds):.0f} of {p.measure_seconds:g} s, "
                    f"{stats.ok} requests answered, {stats.failed} failed, {stats.output_tokens} tokens generated")):
                await _until(task, t0 + p.measure_seconds)
            t1 = time.monotonic()
            marks["warmup"], marks["measure"] = [start, t0], [t0, t1]
            await sampler.wait_tick_after(t1, 5 * plan.sample_interval_seconds + 5)
        finally:
            replay.request_stop(interrupt=True)
            summary = (await asyncio.gather(task, return_exceptions=True))[0]
            sink.close()
    if isinstance(summary, BaseException):
        raise RunFailed(f"the replay failed: {type(summary).__name__}: {summary}")
    summary["window_turns"] = window_turns(records, t0 - start, t1 - start)
    return summary


HEARTBEAT_MAX_SECONDS = 15.0  # a long wait says where it is at least this often


@contextlib.asynccontextmanager
async def heartbeat(say: Say, expected_seconds: float, line: Callable[[float], str]):
    """While the body runs: ``line(seconds so far)`` every quarter of ``expected_seconds`` (1 to 15 s), so an
    engine's start or a measurement is never silent."""
    every = min(HEARTBEAT_MAX_SECONDS, max(1.0, expected_seconds / 4))

    async def beat() -> None:
        start = time.monotonic()
        while True:
            await asyncio.sleep(every)
            say(line(time.monotonic() - start))

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _until(task: asyncio.Task, when_monotonic: float) -> None:
    """Sleep until ``when_monotonic``; RunFailed if the replay ends first (it cannot with a duration set)."""
    await asyncio.wait({task}, timeout=max(when_monotonic - time.monotonic(), 0))
    if task.done():
        error = task.exception()
        raise RunFailed(f"the replay ended before the measurement did ({error or 'no sessions left'})")


def window_turns(records_path: str, lo_seconds: float, hi_seconds: float) -> dict:
    """Turns that started inside the measurement window, by status."""
    counts = {"requests": 0, "ok": 0, "retried": 0, "error": 0, "cancelled": 0}
    with open(records_path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if lo_seconds <= r["start_offset_seconds"] < hi_seconds:
                counts["requests"] += 1
                counts[r["status"]] = counts.get(r["status"], 0) + 1
    return counts


async def _guarded(work, watch):
    """Run ``work`` while ``watch`` looks for trouble; RunFailed with the watcher's message if it finds some."""
    work_task, watch_task = asyncio.create_task(work), asyncio.create_task(watch)
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work_task, watch_task):
            if not t.done():
                t.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if watch_task.done() and not watch_task.cancelled() and watch_task.exception() is None:
        raise RunFailed(watch_task.result())
    return work_task.result()


async def _watch(server: ServerProcess, sampler: RunSampler, phase: Phase, unresponsive_seconds: float) -> str:
    while True:
        await asyncio.sleep(WATCH_SECONDS)
        rc = server.poll()
        if rc is not None:
            return f"server {describe_exit(rc)} during the {phase.name} phase"
        silent = sampler.seconds_without_reading(time.monotonic())
        if silent > unresponsive_seconds:
            return f"server stopped answering /metrics for {silent:.0f} s during the {phase.name} phase"


# ------------------------------------------------------------------------------------------------------
# the experiment
# ------------------------------------------------------------------------------------------------------
def prepare_run_dir(out_dir: str, run: RunSpec) -> str:
    """A clean directory for the run; an earlier interrupted or failed attempt is kept beside it."""
    run_dir = os.path.join(out_dir, "runs", run.run_id)
    if os.path.exists(run_dir):
        k = 1
        while os.path.exists(f"{run_dir}.aborted-{k}"):
            k += 1
        os.rename(run_dir, f"{run_dir}.aborted-{k}")
    os.makedirs(run_dir)
    return run_dir


async def run_experiment(plan: Plan, state: ExperimentState, say: Say) -> int:
    """Every pending run in order; 0 when all finished, 1 when one failed (the finished ones are kept)."""
    order = state.order
    for index, run in enumerate(order, start=1):
        if run.run_id in state.finished:
            continue
        say(f"[{index}/{len(order)}] {run.run_id}")
        run_dir = prepare_run_dir(state.out_dir, run)
        state.start(run)
        try:
            result = await execute_run(plan, run, run_dir, say, state.note_server)
        except RunFailed as e:
            state.fail(run, str(e))
            report.write_safely(state.out_dir, state.data, say)
            say(f"run {run.run_id} failed: {e}")
            return 1
        atomic.write_json(os.path.join(run_dir, "result.json"), result)
        state.finish(run, result)
        say(f"{run.run_id}: {report.run_line(result, plan.energy.scope, plan.energy.basis)}")
        report.write_safely(state.out_dir, state.data, say)
    return 0
