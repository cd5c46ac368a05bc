"""`interlace bench --cpu-per-rank`: one control group per rank with its CPU quota, in either
cgroup layout (checked on fake hierarchies), and, where this machine lets root use a real cpu
controller, a busy process held to its budget."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from interlace.bench.cpu_quota import PERIOD_US, CpuQuota, _controller
from interlace.errors import ConfigError


def _v1(tmp_path: Path) -> Path:
    root = tmp_path / "cpu"
    root.mkdir()
    (root / "cpu.cfs_quota_us").write_text("-1")
    return root


def _v2(tmp_path: Path) -> Path:
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.subtree_control").write_text("cpuset cpu io memory\n")
    return root


def test_v1_groups_get_period_and_quota(tmp_path):
    root = _v1(tmp_path)
    with CpuQuota(2, 0.5, roots=(tmp_path / "absent", root)) as quota:
        assert quota.version == "v1"
        for group in quota.groups:
            assert (group / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
            assert (group / "cpu.cfs_quota_us").read_text() == str(PERIOD_US // 2)
        quota.attach(1, 4242)
        assert (quota.groups[1] / "cgroup.procs").read_text() == "4242"
        # a real kernel removes the files with the directory; here the test does
        for group in quota.groups:
            for f in group.iterdir():
                f.unlink()
        for f in quota.base.iterdir():
            if f.is_file():
                f.unlink()
    assert [p.name for p in root.iterdir()] == ["cpu.cfs_quota_us"]


def test_v2_groups_enable_the_controller_and_write_cpu_max(tmp_path):
    root = _v2(tmp_path)
    quota = CpuQuota(3, 1.5, roots=(root,))
    assert quota.version == "v2"
    assert (quota.base / "cgroup.subtree_control").read_text() == "+cpu"
    assert [(g / "cpu.max").read_text() for g in quota.groups] == [
        f"{3 * PERIOD_US // 2} {PERIOD_US}"
    ] * 3


def test_a_hierarchy_without_the_cpu_controller_is_not_used(tmp_path):
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.subtree_control").write_text("memory pids\n")  # cpu not delegated
    assert _controller((root,)) is None
    with pytest.raises(ConfigError, match="needs root and a cpu cgroup controller"):
        CpuQuota(2, 0.5, roots=(root,))


def test_bad_core_counts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="must be > 0"):
        CpuQuota(2, 0.0, roots=(_v1(tmp_path),))


def _real_controller() -> str | None:
    """Why a real quota cannot be set up here, or None."""
    try:
        CpuQuota(1, 0.2).close()
    except (ConfigError, OSError) as exc:
        return str(exc)
    return None


_WHY_NOT = _real_controller()


@pytest.mark.skipif(_WHY_NOT is not None, reason=f"no cpu cgroup to use here: {_WHY_NOT}")
def test_a_busy_process_is_held_to_its_budget():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with CpuQuota(1, 0.2) as quota:
            quota.attach(0, busy.pid)
            stat = Path(f"/proc/{busy.pid}/stat")

            def cpu_seconds() -> float:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in ticks

            start, begun = cpu_seconds(), time.monotonic()
            time.sleep(1.5)
            used = (cpu_seconds() - start) / (time.monotonic() - begun)
            busy.kill()
            busy.wait()
        assert 0.1 < used < 0.3, f"used {used:.2f} cores against a budget of 0.2"
    finally:
        if busy.poll() is None:
            busy.kill()
