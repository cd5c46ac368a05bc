"""A fixed CPU budget per benchmark rank (`interlace bench --cpu-per-rank C`), through Linux
control groups: each rank may use C cores' worth of time per scheduling period and no more.

Ranks that share a machine's cores otherwise lend each other their idle time: a rank with
little work leaves its core to a busy one, so load imbalance (Mixture-of-Experts routing,
pipeline bubbles) costs less than on accelerators, where each device computes at its own fixed
rate. With a budget every rank is such a device.

Both cgroup layouts are handled: v2 (`cpu.max` in the unified hierarchy) and v1 (the `cpu`
controller's `cpu.cfs_quota_us` / `cpu.cfs_period_us`). It needs root. Written by hand: no
library in the dependencies sets a process's CPU quota.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from interlace.errors import ConfigError

PERIOD_US = 100_000
ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/cpu"))
"""Where a cpu controller may be mounted: v2 at the top or beside v1, or v1's `cpu`."""


def _controller(roots: tuple[Path, ...]) -> tuple[Path, str] | None:
    """(directory, "v1" | "v2") of the first writable cpu controller among `roots`."""
    for root in roots:
        if (root / "cpu.cfs_quota_us").exists() and os.access(root, os.W_OK):
            return root, "v1"
        delegated = root / "cgroup.subtree_control"  # what the groups below may use
        if (
            delegated.exists()
            and "cpu" in delegated.read_text().split()
            and os.access(root, os.W_OK)
        ):
            return root, "v2"
    return None


class CpuQuota:
    """One control group per rank, each limited to `cores` cores' time; `attach(rank, pid)`
    moves a process into its rank's group; `close()` removes the groups (after the processes
    have exited)."""

    def __init__(self, ranks: int, cores: float, roots: tuple[Path, ...] = ROOTS):
        if not cores > 0:
            raise ConfigError(f"--cpu-per-rank {cores} must be > 0 (cores per rank, e.g. 0.5)")
        found = _controller(roots)
        if found is None:
            raise ConfigError(
                "--cpu-per-rank needs root and a cpu cgroup controller (v1 'cpu' or v2 "
                f"'cpu.max') under {', '.join(map(str, roots))}; none is writable here"
            )
        root, self.version = found
        self.base = root / f"interlace-bench-{os.getpid()}"
        self.groups: list[Path] = []
        try:
            self._create(ranks, max(1000, round(cores * PERIOD_US)))
        except OSError as exc:
            self.close()
            raise ConfigError(
                f"--cpu-per-rank: cannot set up cgroups under {root}: {exc}"
            ) from None

    def _create(self, ranks: int, quota: int) -> None:
        self.base.mkdir(exist_ok=True)
        if self.version == "v2":
            (self.base / "cgroup.subtree_control").write_text("+cpu")
        for rank in range(ranks):
            group = self.base / f"rank{rank}"
            group.mkdir(exist_ok=True)
            self.groups.append(group)
            if self.version == "v2":
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))

    def attach(self, rank: int, pid: int) -> None:
        """Put process `pid` (and the threads it starts from now on) in rank `rank`'s group."""
        (self.groups[rank] / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Remove the groups; they must be empty (their processes exited)."""
        for group in [*self.groups, self.base]:
            with contextlib.suppress(FileNotFoundError):
                group.rmdir()

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
