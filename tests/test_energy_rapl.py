"""Host (RAPL) source on powercap trees written in the kernel's layout (tests/support/powercap.py)."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from exporter.sources.rapl import RaplSource, step_joules
from tests.support.powercap import AMD_MAX_ENERGY_RANGE_UJ, PowercapTree, amd, intel_two_socket

REPO = Path(__file__).resolve().parents[1]


def by_device(readings):
    return {r.device: r for r in readings}


def test_intel_two_socket_reads_package_and_dram_only(tmp_path):
    tree = intel_two_socket(tmp_path)  # also has core subzones, a top-level psys and an mmio duplicate
    src = RaplSource(tree.root)
    status, readings = src.read(0.0)
    assert status.up and status.state == "ok"
    assert sorted(by_device(readings)) == ["rapl:package-0:dram", "rapl:package-0:package",
                                           "rapl:package-1:dram", "rapl:package-1:package"]
    r = by_device(readings)["rapl:package-1:dram"]
    assert r.labels == {"zone": "package-1", "domain": "dram"} and r.kind == "host" and r.method == "rapl"
    assert r.joules_total == 0.0 and not r.continuous  # first sight: no step yet

    tree.advance("intel-rapl:0", 55.5)
    tree.advance("intel-rapl:0:1", 7.25)  # package-0's dram
    tree.advance("intel-rapl:2", 1000.0)  # psys moves too, and must not count
    tree.advance("intel-rapl-mmio:0", 55.5)
    _, readings = src.read(1.0)
    got = by_device(readings)
    assert got["rapl:package-0:package"].joules_total == pytest.approx(55.5)
    assert got["rapl:package-0:package"].continuous
    assert got["rapl:package-0:dram"].joules_total == pytest.approx(7.25)
    assert got["rapl:package-1:package"].joules_total == 0.0 and got["rapl:package-1:package"].continuous


def test_zones_found_by_name_not_directory_number(tmp_path):
    tree = PowercapTree(tmp_path)
    tree.add_zone("package-1", zone_id="0")  # directory numbers need not follow sockets
    second = tree.add_zone("package-0", zone_id="a")  # and are hexadecimal
    tree.add_zone("dram", parent=second, zone_id="b")
    tree.add_zone("package-2-die-1", zone_id="1f")
    _, readings = RaplSource(tree.root).read(0.0)
    assert sorted(by_device(readings)) == ["rapl:package-0:dram", "rapl:package-0:package",
                                           "rapl:package-1:package", "rapl:package-2-die-1:package"]
    tree.advance("intel-rapl:a:b", 3.0)
    _, readings = RaplSource(tree.root).read(0.0)
    assert by_device(readings)["rapl:package-0:dram"].labels == {"zone": "package-0", "domain": "dram"}


def test_root_at_devices_tree_finds_the_same_zones(tmp_path):
    tree = intel_two_socket(tmp_path)
    _, readings = RaplSource(str(tree.devices)).read(0.0)  # /sys/devices/virtual/powercap layout
    assert len(readings) == 4


def test_amd_layout_package_only(tmp_path):
    tree = amd(tmp_path, sockets=2)
    src = RaplSource(tree.root)
    _, readings = src.read(0.0)
    assert sorted(by_device(readings)) == ["rapl:package-0:package", "rapl:package-1:package"]
    tree.set_energy("intel-rapl:0", AMD_MAX_ENERGY_RANGE_UJ - 2_000_000)  # 2 J before the wrap
    src = RaplSource(tree.root)
    src.read(0.0)
    tree.advance("intel-rapl:0", 120.0)  # 120 J in 1 s wraps the AMD counter
    assert tree.energy_uj("intel-rapl:0") < 2_000_000 + 120_000_000
    _, readings = src.read(1.0)
    assert by_device(readings)["rapl:package-0:package"].joules_total == pytest.approx(120.0)


def test_wrap_between_samples_is_added_back(tmp_path):
    tree = PowercapTree(tmp_path)
    z = tree.add_zone("package-0", energy_uj=10_000, max_energy_range_uj=262_143_328_850)
    src = RaplSource(tree.root)
    tree.set_energy(z, 262_143_328_850 - 40_000_000)  # 40 J before the end of the range
    src.read(0.0)
    tree.advance(z, 95.0)
    assert tree.energy_uj(z) == 55_000_000  # it did wrap
    _, readings = src.read(1.0)
    r = readings[0]
    assert r.continuous and r.joules_total == pytest.approx(95.0)


def test_two_wraps_are_dropped_and_rebased(tmp_path):
    tree = PowercapTree(tmp_path)
    rng = 65_712_999_613  # ~65.7 kJ: at 1 kW plausible, one wrap every 66 s
    z = tree.add_zone("package-0", energy_uj=1_000_000, max_energy_range_uj=rng)
    src = RaplSource(tree.root)
    src.read(0.0)
    tree.advance(z, 10.0)
    src.read(1.0)
    # the daemon stalls 300 s at 250 W: 75 kJ, more than one range; the counter alone cannot tell how many
    tree.advance(z, 75_000.0)
    _, readings = src.read(301.0)
    assert not readings[0].continuous
    assert readings[0].joules_total == pytest.approx(10.0)  # the ambiguous step is not added
    tree.advance(z, 20.0)
    _, readings = src.read(302.0)  # re-based on the last value: the next step counts again
    assert readings[0].continuous and readings[0].joules_total == pytest.approx(30.0)


def test_implausible_power_step_is_dropped(tmp_path):
    tree = PowercapTree(tmp_path)
    z = tree.add_zone("package-0", energy_uj=5_000_000)
    src = RaplSource(tree.root)
    src.read(0.0)
    tree.advance(z, 53_000.0)  # 53 kW for one second (the Scaphandre bug)
    _, readings = src.read(1.0)
    assert not readings[0].continuous and readings[0].joules_total == 0.0


def test_step_rule_unit():
    rng = 262_143_328_850
    assert step_joules(100, 300, rng, 1.0) == pytest.approx(200e-6)
    assert step_joules(rng - 1_000_000, 2_000_000, rng, 1.0) == pytest.approx(3.0)  # one wrap
    assert step_joules(rng - 1_000_000, 2_000_000, 0, 1.0) is None  # decrease with no known range
    assert step_joules(0, 10_000_000, rng, 400.0) is None  # 262 kJ + 10 J over 400 s fits under 1 kW too


def test_unreadable_directory_in_place_of_file(tmp_path):
    tree = intel_two_socket(tmp_path, mmio=False, psys=False)
    tree.make_unreadable("intel-rapl:1", how="directory")  # fails for root too
    status, readings = RaplSource(tree.root).read(0.0)
    got = by_device(readings)
    assert got["rapl:package-1:package"].joules_total is None  # unknown, not 0 J
    assert got["rapl:package-0:package"].joules_total == 0.0
    assert status.up and status.state == "degraded"
    assert status.reason == "unreadable: rapl:package-1:package (Is a directory)"


def test_permission_denied_gives_reason_not_zero(tmp_path, monkeypatch):
    tree = intel_two_socket(tmp_path, dram=False, mmio=False, psys=False)
    src = RaplSource(tree.root)
    src.read(0.0)
    tree.advance("intel-rapl:0", 30.0)
    real_open = builtins.open

    def denying_open(path, *a, **kw):  # what a non-root reader gets since CVE-2020-8694
        if str(path).endswith("energy_uj"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", denying_open)
    status, readings = src.read(1.0)
    assert not status.up and status.state == "down"
    assert status.reason.startswith("permission") and "CVE-2020-8694" in status.reason
    assert all(r.joules_total is None and not r.continuous for r in readings)
    monkeypatch.setattr(builtins, "open", real_open)
    tree.advance("intel-rapl:0", 30.0)
    status, readings = src.read(2.0)
    r = by_device(readings)["rapl:package-0:package"]
    # readable again: the counter kept counting, so the total is right, but the step spans the gap and
    # must not be used as one interval's energy
    assert status.up and r.joules_total == pytest.approx(60.0) and not r.continuous


def test_chmod_000_for_a_non_root_reader():
    """chmod 000 bites only non-root; as root, the read runs in a child process dropped to 'nobody'."""
    base = tempfile.mkdtemp(prefix="kvwatt-rapl-")
    try:
        os.chmod(base, 0o755)
        tree = intel_two_socket(base, dram=False, mmio=False, psys=False)
        for d, _, _ in os.walk(base):
            os.chmod(d, 0o755)
        tree.make_unreadable("intel-rapl:0", how="chmod")
        code = ("import sys; sys.path.insert(0, %r); from exporter.sources.rapl import RaplSource;"
                "s, r = RaplSource(%r).read(0.0); print(s.up, s.reason)") % (str(REPO), tree.root)
        kw = {}
        if os.geteuid() == 0:
            kw["user"] = "nobody"
        out = None
        for python in (sys.executable, "/usr/bin/python3"):  # the venv's base may sit under root-only /root
            try:
                out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, **kw)
                break
            except OSError as e:
                why = e
        if out is None:
            pytest.skip(f"no python runnable as nobody here: {why}")
        assert out.returncode == 0, out.stderr
        # package-1 reads fine
        assert out.stdout.startswith("True permission: rapl:package-0:package (energy_uj is root-only")
    finally:
        subprocess.run(["rm", "-rf", base])


def test_masked_and_absent(tmp_path):
    tree = intel_two_socket(tmp_path / "a")
    tree.mask()  # the container runtime's empty tmpfs over /sys/devices/virtual/powercap
    status, readings = RaplSource(tree.root).read(0.0)
    assert not status.up and status.reason.startswith("masked") and readings == []

    status, readings = RaplSource(str(tmp_path / "nowhere")).read(0.0)
    assert not status.up and status.reason.startswith("absent") and readings == []

    tree = intel_two_socket(tmp_path / "b", dram=False, mmio=False, psys=False)
    tree.make_unreadable("intel-rapl:0", how="empty")  # /dev/null bind-mounted over the file
    tree.make_unreadable("intel-rapl:1", how="missing")
    status, readings = RaplSource(tree.root).read(0.0)
    assert "masked" in status.reason and "absent" in status.reason
    assert [r.joules_total for r in readings] == [None, None]


def test_zone_appearing_later_is_picked_up(tmp_path):
    tree = PowercapTree(tmp_path)
    tree.add_zone("package-0")
    src = RaplSource(tree.root, rescan_seconds=30.0)
    _, readings = src.read(0.0)
    assert len(readings) == 1
    tree.add_zone("package-1")
    _, readings = src.read(10.0)
    assert len(readings) == 1  # not rescanned yet (rescans are periodic, reads stay cheap)
    _, readings = src.read(30.0)
    assert sorted(by_device(readings)) == ["rapl:package-0:package", "rapl:package-1:package"]
    tree.advance("intel-rapl:1", 4.0)
    tree.advance("intel-rapl:0", 4.0)
    _, readings = src.read(31.0)
    assert [r.joules_total for r in readings] == [pytest.approx(4.0), pytest.approx(4.0)]


def test_no_zone_at_first_then_access_granted(tmp_path):
    tree = PowercapTree(tmp_path)
    src = RaplSource(tree.root, rescan_seconds=5.0)
    status, readings = src.read(0.0)
    assert not status.up and status.reason.startswith("absent")
    tree.add_zone("package-0")
    status, readings = src.read(5.0)
    assert status.up and len(readings) == 1


def test_reads_from_several_threads_never_count_a_step_twice(tmp_path):
    """The sampler reads RAPL in a worker thread; a late read may overlap the next one."""
    import threading
    import time

    tree = intel_two_socket(tmp_path)
    src = RaplSource(tree.root, rescan_seconds=1e9)
    src.read(time.monotonic())
    time.sleep(0.05)
    tree.advance("intel-rapl:0", 10.0)
    barrier = threading.Barrier(8)

    def reader():
        barrier.wait()
        for _ in range(20):
            src.read(time.monotonic())

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, readings = src.read(time.monotonic())
    assert by_device(readings)["rapl:package-0:package"].joules_total == pytest.approx(10.0)
