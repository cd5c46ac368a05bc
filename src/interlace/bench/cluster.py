"""An emulated cluster on one machine: N ranks in N network namespaces, each joined to a bridge
by its own veth link shaped to a fixed bandwidth.

    rank i:  netns interlace-r<i>, interface eth0 = 10.77.0.<i+1>/24
             egress shaped by `tc tbf` on eth0, ingress by `tc tbf` on its bridge port
    hub:     netns interlace-hub holding the bridge br0 (the host's own network is untouched)

Loopback traffic on one machine is CPU-bound and hides nothing; a shaped link is bandwidth-bound
like a real network, so overlap and bytes-on-the-wire become measurable. Only bandwidth is
emulated: `netem` (latency, loss) is not available here, so links have veth latency (~µs).

Without root or iproute2 the cluster says why and falls back to loopback; every result is then
marked "loopback (not bandwidth-shaped)". Namespaces are always removed on exit, also after a
failure or Ctrl-C, and leftovers of a crashed run are removed on the next start.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from interlace.errors import ConfigError

PREFIX = "interlace-"
HUB = f"{PREFIX}hub"
SUBNET = "10.77.0"
LOOPBACK = "loopback (not bandwidth-shaped)"
_LOCK = Path("/tmp/interlace-cluster.lock")


def shaping_unavailable() -> str | None:
    """Why namespaces cannot be used here (None if they can): needs root and iproute2."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def leftover_namespaces() -> list[str]:
    """Names of namespaces from earlier runs that still exist."""
    listing = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX)]


def remove_namespaces(names: Sequence[str]) -> None:
    """Delete namespaces (their veth ends go with them), killing processes left inside."""
    for name in names:
        pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            _run("kill", "-9", pid, check=False)
        _run("ip", "netns", "delete", name, check=False)


@dataclass
class Cluster:
    """N ranks on a shaped network (or loopback). Use as a context manager.

    `rank_command(i, argv)` wraps a command so it runs as rank i; `master_addr` and `ifname`
    are what gloo needs (MASTER_ADDR, GLOO_SOCKET_IFNAME).
    """

    ranks: int
    rate_bps: float | None  # None = loopback requested
    network: str = field(init=False, default=LOOPBACK)
    fallback_reason: str | None = field(init=False, default=None)
    _lock: object = field(init=False, default=None, repr=False)

    @property
    def shaped(self) -> bool:
        """True when ranks talk over shaped veth links."""
        return self.network != LOOPBACK

    @property
    def master_addr(self) -> str:
        """Address of rank 0 as the other ranks reach it."""
        return f"{SUBNET}.1" if self.shaped else "127.0.0.1"

    @property
    def ifname(self) -> str:
        """The interface each rank's gloo uses."""
        return "eth0" if self.shaped else "lo"

    def rank_command(self, rank: int, argv: list[str]) -> list[str]:
        """`argv` as run by rank `rank`: inside its namespace when shaped."""
        return ["ip", "netns", "exec", f"{PREFIX}r{rank}", *argv] if self.shaped else argv

    def __enter__(self) -> Cluster:
        if self.ranks < 1:
            raise ConfigError(f"ranks={self.ranks} must be >= 1")
        if self.rate_bps is None:
            self.fallback_reason = "loopback requested"
            return self
        self.fallback_reason = shaping_unavailable()
        if self.fallback_reason:
            return self
        self._lock = _LOCK.open("w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                "another emulated cluster is running on this machine; wait for it to finish"
            ) from None
        remove_namespaces(leftover_namespaces())
        try:
            self._create()
        except BaseException:
            self._destroy()
            raise
        self.network = f"shaped veth {_fmt_rate(self.rate_bps)} per link (tc tbf, no latency)"
        return self

    def __exit__(self, *exc: object) -> None:
        self._destroy()

    def _create(self) -> None:
        rate = f"{int(self.rate_bps)}bit"
        # token bucket: 1 ms of traffic, at least 64 KiB. Smaller buckets starve TCP's ACKs
        # under two-way traffic (all_reduce fell from 95% to 63% of the link at 32 KiB);
        # messages below the bucket size pass faster than the rate.
        burst = max(64 * 1024, int(self.rate_bps / 8 / 1000))
        _run("ip", "netns", "add", HUB)
        _run("ip", "-n", HUB, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", HUB, "link", "set", "br0", "up")
        for i in range(self.ranks):
            ns, port = f"{PREFIX}r{i}", f"p{i}"
            _run("ip", "netns", "add", ns)
            _run(
                "ip",
                "-n",
                HUB,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _run("ip", "-n", HUB, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            for where, dev in ((ns, "eth0"), (HUB, port)):
                _run(
                    "tc",
                    "-n",
                    where,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                )

    def _destroy(self) -> None:
        if self._lock is None:
            return
        remove_namespaces([f"{PREFIX}r{i}" for i in range(self.ranks)] + [HUB])
        self._lock.close()
        self._lock = None


def _fmt_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"
