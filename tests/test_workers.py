"""A process per group of servers (exporter/runtime/workers.py, the setting ``processes``): the groups, the merge
of the workers' expositions, and a real `kvwatt run --processes 2` against `--processes 1` over the same
simulated servers on loopback (slow)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from exporter.config import Config, ConfigError, ServerConfig
from exporter.config.values import parse_processes
from exporter.model.energy import EnergyLedger
from exporter.runtime.workers import GroupGpus, Supervisor, down_text, groups, merge_status, merge_texts, processes_for
from exporter.samples import Tick
from tests.support import vllm_sim as sim
from tests.support.daemon import KvwattDaemon, parse_exposition
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import FakeVllm


def _servers(n: int, pairs: dict[int, int] | None = None) -> tuple[ServerConfig, ...]:
    pairs = pairs or {}
    return tuple(ServerConfig(f"s{i}", f"http://127.0.0.1:{9000 + i}",
                              pair_off_server=f"s{pairs[i]}" if i in pairs else None) for i in range(n))


def _names(gs) -> list[list[str]]:
    return [[s.name for s in g] for g in gs]


def test_groups_balance_by_count_in_configured_order():
    assert _names(groups(_servers(64), 2)) == [[f"s{i}" for i in range(32)], [f"s{i}" for i in range(32, 64)]]
    assert [len(g) for g in groups(_servers(10), 3)] == [3, 4, 3]


def test_a_pair_stays_in_one_group_whichever_way_it_points():
    gs = groups(_servers(4, {2: 1}), 2)  # s2 (ON) pairs with s1 (OFF): the cut would fall between them
    assert any({"s1", "s2"} <= set(g) for g in _names(gs))
    assert sorted(n for g in _names(gs) for n in g) == ["s0", "s1", "s2", "s3"]
    gs = groups(_servers(4, {0: 3}), 2)  # a pair across the list: one group holds both
    assert any({"s0", "s3"} <= set(g) for g in _names(gs))


def test_processes_auto_is_one_up_to_the_rule_then_one_per_group():
    assert processes_for(Config(servers=_servers(32))) == 1
    assert processes_for(Config(servers=_servers(33))) == 2
    assert processes_for(Config(servers=_servers(64))) == 2
    assert processes_for(Config(servers=_servers(3), processes=8)) == 3  # never more than one per server


def test_processes_setting_parses_auto_or_a_positive_integer():
    assert parse_processes("auto", "processes") == "auto"
    assert parse_processes("4", "--processes") == 4
    for bad in (0, -1, "two", True, 1.5):
        with pytest.raises(ConfigError, match="expected auto or a positive integer"):
            parse_processes(bad, "processes")


A = ('# HELP kvwatt_figures_rejected_total r\n# TYPE kvwatt_figures_rejected_total counter\n'
     'kvwatt_figures_rejected_total{figure="x",reason="r"} 1.0\n'
     '# HELP kvwatt_source_up u\n# TYPE kvwatt_source_up gauge\n'
     'kvwatt_source_up{server="a",source="vllm"} 1.0\nkvwatt_source_up{server="",source="rapl"} 1.0\n')
B = ('# HELP kvwatt_figures_rejected_total r\n# TYPE kvwatt_figures_rejected_total counter\n'
     'kvwatt_figures_rejected_total{figure="x",reason="r"} 2.0\n'
     '# HELP kvwatt_source_up u\n# TYPE kvwatt_source_up gauge\n'
     'kvwatt_source_up{server="b",source="vllm"} 1.0\nkvwatt_source_up{server="",source="rapl"} 0.0\n'
     '# HELP only_b o\n# TYPE only_b gauge\nonly_b 7.0\n')


def test_merge_sums_counters_takes_host_gauges_from_group_0_and_keeps_every_family_once():
    text = merge_texts([A, B])
    got = parse_exposition(text)  # fails on a duplicate sample
    assert got[("kvwatt_figures_rejected_total", frozenset({"figure": "x", "reason": "r"}.items()))] == 3.0
    assert got[("kvwatt_source_up", frozenset({"server": "", "source": "rapl"}.items()))] == 1.0  # group 0's
    assert got[("kvwatt_source_up", frozenset({"server": "b", "source": "vllm"}.items()))] == 1.0
    assert got[("only_b", frozenset())] == 7.0
    assert text.count("# TYPE kvwatt_source_up") == 1


def test_a_dead_workers_servers_read_down_with_a_reason_never_its_last_figures():
    text = merge_texts([A, down_text(["b"], "worker process 2 exited")])
    got = parse_exposition(text)
    assert got[("kvwatt_source_up", frozenset({"server": "b", "source": "vllm"}.items()))] == 0.0
    info = {dict(lab)["reason"] for (n, lab), v in got.items() if n.startswith("kvwatt_source_info")}
    assert info == {"worker_down"}
    status = merge_status([{"servers": [{"server": "a"}], "sources": ["rapl"]}, None],
                          [None, [{"server": "b", "up": False, "reason": "gone"}]], ["b", "a"])
    assert [s["server"] for s in status["servers"]] == ["b", "a"] and status["sources"] == ["rapl"]



def _until(ok, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not ok() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ok()


class _Published:
    def __init__(self, text: str) -> None:
        self.rendered = type("R", (), {"text": text.encode()})()


class _OwnGroup:
    """The parent's own group's daemon as the supervisor reads it: a snapshot for /api/status (none yet)."""

    snapshot = None


def test_the_parents_own_group_hands_over_in_process_and_reads_down_when_it_stalls():
    """With ``in_process`` group 0 is derived by the parent (no worker process for it, one interpreter fewer: issue
    39's memory): its ticks are merged as a worker's are; stalled, its servers read down with the reason, and its
    next tick brings them back; nothing is restarted."""
    sup = Supervisor(Config(servers=_servers(2)), 2, _silent_worker, stall_seconds=1.0, in_process=True)
    own = sup.local
    assert own is sup.workers[0] and own.process is None and not sup.workers[1].local
    hand = sup.local_hand_over(_OwnGroup())
    hand(_Published(A))
    _until(lambda: sup.published is not None)  # taken by its own thread, off the tick's
    got = parse_exposition(sup.published.rendered.text.decode())
    assert got[("kvwatt_source_up", frozenset({"server": "a", "source": "vllm"}.items()))] == 1.0
    assert sup.statuses(timeout_seconds=0.1)[0][0]["servers"] == []  # its own status_json, asked in-process
    own.last_at -= 2.0
    sup.check(own)
    got = parse_exposition(sup.published.rendered.text.decode())
    assert got[("kvwatt_source_up", frozenset({"server": "s0", "source": "vllm"}.items()))] == 0.0
    assert "this process" in own.down_reason and "handed over no tick" in own.down_reason
    assert sup.restarts == 0 and own.process is None
    hand(_Published(A))
    _until(lambda: own.down_reason == "")
    sup.stop()
    assert own.down_reason == "" and ("kvwatt_source_up", frozenset({"server": "a", "source": "vllm"}.items())) in \
        parse_exposition(sup.published.rendered.text.decode())

# --- a real `kvwatt run` --------------------------------------------------------------------------------

RUNTIME = ("process_", "python_")  # the process' own families: per process by nature


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


def _families(metrics) -> dict[str, set]:
    out: dict[str, set] = {}
    for name, labels in metrics:
        if not name.startswith(RUNTIME):
            out.setdefault(name, set()).add(labels)
    return out


def _run(urls, processes: int, tmp, tag: str, env: dict) -> KvwattDaemon:
    gpus = {"s0": ["0"], "s3": ["1"]}  # GPU 2 is no server's: read by group 0 only
    config = {"servers": [{"name": n, "url": u, **({"pair_off_server": "s1"} if n == "s2" else {}),
                           **({"gpus": gpus[n]} if n in gpus else {})} for n, u in urls.items()],
              "windows": ["30s"], "state_dir": str(tmp / f"state-{tag}"), "powercap_root": str(tmp / "no-powercap")}
    return KvwattDaemon(config=config, args=("--processes", str(processes)), env=env)


def _all_up(d: KvwattDaemon, names) -> bool:
    return all(d.value("kvwatt_source_up", source="vllm", server=n) == 1.0 for n in names)


@pytest.mark.slow
def test_two_processes_serve_what_one_does_and_a_killed_worker_comes_back(tmp_path):
    names = ["s0", "s1", "s2", "s3"]
    fakes = [FakeVllm(sim.stable_high_pressure_on(seed=i)) for i in range(4)]
    gpus = FakeGpus(tmp_path / "gpus.json")
    for f in fakes:
        f.start()
    fakes[0].attach_gpu(gpus, "GPU-w-0")
    fakes[3].attach_gpu(gpus, "GPU-w-1")
    gpus.add("GPU-w-2")
    try:
        urls = {n: f.url for n, f in zip(names, fakes)}
        with _run(urls, 1, tmp_path, "one", gpus.env()) as one, _run(urls, 2, tmp_path, "two", gpus.env()) as two:
            for d in (one, two):
                d.wait_for(lambda d: _all_up(d, names), timeout=40, what="every server up")
            time.sleep(2.5)
            m1, m2 = one.metrics(), two.metrics()
            assert _families(m1) == _families(m2)  # the same families, the same label sets
            uuids = {dict(lab).get("uuid") for _, lab in m2} - {None}
            assert uuids == {"GPU-w-0", "GPU-w-1", "GPU-w-2"}  # every GPU once (parse_exposition: no duplicate)
            for key in m1:
                if key[0] in ("kvwatt_source_up", "kvwatt_figures_rejected_total", "kvwatt_build_info"):
                    assert m2[key] == m1[key], key  # summed over the workers: equal to the one process'
            s1, s2 = one.status(), two.status()
            assert [s["server"] for s in s2["servers"]] == names == [s["server"] for s in s1["servers"]]
            assert set(s2) == set(s1) and s2["sources"] == s1["sources"]
            assert set(s2["servers"][2]) == set(s1["servers"][2])
            # the pair s1-s2 in one group; group 0 derived by the parent itself, group 1 by one worker process
            assert "2 processes: worker 1 (this process): s0, s1, s2; worker 2: s3" in two.log()
            workers = [p for p in _children(two.proc.pid) if "spawn_main" in _cmdline(p)]
            assert len(workers) == 1, [_cmdline(p) for p in _children(two.proc.pid)]
            om = two.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
            assert om.status_code == 200 and om.text.endswith("# EOF\n") and 'server="s3"' in om.text
            assert two.get("/healthz").status_code == 200 and 's3' in two.get("/").text

            pid = int(re.search(r"worker 2 started \(pid (\d+)\): s3", two.log()).group(1))
            log_before = len(two.log())
            os.kill(pid, signal.SIGKILL)
            two.wait_for(lambda d: d.value("kvwatt_source_up", source="vllm", server="s3") == 0.0,
                         timeout=15, interval=0.2, what="the killed worker's server down")
            got = two.metrics()
            reasons = {dict(lab).get("reason") for (n, lab), v in got.items()
                       if n.startswith("kvwatt_source_info") and dict(lab).get("server") == "s3"}
            assert reasons == {"worker_down"}
            assert not [k for k in got if k[0].startswith("kvwatt_") and dict(k[1]).get("server") == "s3"
                        and not k[0].startswith("kvwatt_source_")]  # never a frozen copy of its figures
            assert _all_up(two, ["s0", "s1", "s2"])  # the other worker's servers go on
            two.wait_for(lambda d: _all_up(d, names), timeout=40, what="the worker started again")
            log = two.log()[log_before:]
            assert log.count("exited (killed by signal 9)") == 1, log
            assert "is back" in log
            children = _children(two.proc.pid)
            assert len(children) >= 1
            assert two.stop() == 0
            cmdlines = {p: _cmdline(p) for p in children}
            deadline = time.monotonic() + 5  # multiprocessing's resource tracker ends on its pipe's EOF
            while [p for p in children if _alive(p)] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [cmdlines[p] for p in children if _alive(p)], "a child outlived kvwatt"
    finally:
        for f in fakes:
            f.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _silent_worker(spec, conn) -> None:
    """A worker that starts and never hands over a tick (a stalled one)."""
    time.sleep(120)


@pytest.mark.slow
def test_a_stalled_worker_reads_down_with_a_reason_and_is_started_again():
    sup = Supervisor(Config(servers=_servers(2)), 2, _silent_worker, stall_seconds=1.0)
    sup.start()
    first = [w.process for w in sup.workers]
    try:
        deadline = time.monotonic() + 20
        while sup.restarts < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sup.restarts >= 2
        got = parse_exposition(sup.published.rendered.text.decode())
        assert got[("kvwatt_source_up", frozenset({"server": "s1", "source": "vllm"}.items()))] == 0.0
        status = sup.published.merged_status()
        assert [s["server"] for s in status["servers"]] == ["s0", "s1"]
        assert all("handed over no tick" in s["reason"] and not s["up"] for s in status["servers"])
        assert not sup.healthy()
        assert not any(p.is_alive() for p in first)  # a stalled worker is ended before its successor starts
    finally:
        sup.stop()
    assert not any(w.process.is_alive() for w in sup.workers)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class _Gpus:
    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, t: float, deadline_seconds: float | None = None):
        from exporter.samples import DeviceReading, SourceStatus

        return (SourceStatus(source="nvml", server="", up=True, reason="", duration_seconds=0.0, state="ok"),
                [DeviceReading(device=f"gpu:G{i}", kind="gpu", labels={"gpu": str(i), "uuid": f"G{i}"},
                               joules_total=1.0, continuous=True, power_watts=1.0, method="counter")
                 for i in range(self.n)])


def test_each_gpu_is_read_by_one_group_and_a_lone_server_without_a_list_gets_none_of_the_others(tmp_path):
    servers = (ServerConfig("a", "http://x"), ServerConfig("b", "http://y", gpus=("1",)))
    first = GroupGpus(_Gpus(3), servers, ["a"], shared=True)
    second = GroupGpus(_Gpus(3), servers, ["b"], shared=False)
    got = [sorted(r.device for r in g.read(0.0)[1]) for g in (first, second)]
    assert got == [["gpu:G0", "gpu:G2"], ["gpu:G1"]]  # no server lists G0, G2: group 0's, as shared devices
    # group 0's ledger: "a" alone in its group, without a list, would take every GPU it reads (one server); over
    # every server's lists (as service._worker sets it) it has none, G0 and G2 stay shared
    status, readings = first.read(0.0)
    for assign_servers, want in ((servers[:1], ("gpu:G0", "gpu:G2")), (servers, ())):
        ledger = EnergyLedger(Config(servers=servers[:1], state_dir=str(tmp_path)))
        ledger.assign_servers = assign_servers
        ledger.ingest(Tick(1.0, {}, (status,), tuple(readings)))
        assert ledger.assignment.by_server["a"] == want
