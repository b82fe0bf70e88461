"""What the OS tells about a CPU node: this process's CPU use and memory, the host's, and the
package energy from RAPL (`/sys/class/powercap`) where the kernel exposes it."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")


@dataclass
class HostReading:
    cpu_pct: float | None = None
    """This process's CPU use since the previous reading, in percent of one core (200: two cores)."""
    host_cpu_pct: float | None = None
    """The whole host's CPU use since the previous reading, in percent of all its cores."""
    cpu_seconds: float = 0.0
    """This process's CPU time (user + system) so far."""
    rss_bytes: int | None = None
    memory_available_bytes: int | None = None
    memory_total_bytes_host: int | None = None
    energy_j: float | None = None
    """RAPL package energy (all sockets, every process on the host) since this backend started;
    None where RAPL is absent (containers, VMs, non-Intel/AMD hosts)."""
    errors: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class HostBackend:
    """Readings from /proc and RAPL; every read is guarded (a missing file leaves a field None)."""

    kind = "host"

    def __init__(self, powercap: Path = POWERCAP):
        self.cores = os.cpu_count() or 1
        self.root = powercap
        self.rapl = _rapl_domains(powercap)
        self._last = (time.monotonic(), _process_cpu_s(), _host_cpu())
        self._energy_last = {d: _read_int(d / "energy_uj") for d in self.rapl}
        self._energy_j = 0.0

    @property
    def has_rapl(self) -> bool:
        return bool(self.rapl)

    def describe(self) -> str:
        if self.rapl:
            return f"RAPL package energy from {len(self.rapl)} domain(s) under {self.root}"
        return f"no RAPL ({self.root} is absent or unreadable): CPU energy is estimated from CPU time"

    def read(self) -> HostReading:
        now, cpu_s, host = time.monotonic(), _process_cpu_s(), _host_cpu()
        t0, cpu0, host0 = self._last
        self._last = (now, cpu_s, host)
        r = HostReading(cpu_seconds=cpu_s)
        if now > t0:
            r.cpu_pct = 100.0 * (cpu_s - cpu0) / (now - t0)
        if host and host0 and host[1] > host0[1]:
            r.host_cpu_pct = 100.0 * (host[0] - host0[0]) / (host[1] - host0[1])
        mem = _meminfo()
        r.memory_available_bytes = mem.get("MemAvailable")
        r.memory_total_bytes_host = mem.get("MemTotal")
        r.rss_bytes = _rss()
        if self.rapl:
            r.energy_j = self._rapl_energy(r)
        return r

    def _rapl_energy(self, r: HostReading) -> float:
        for d, last in self._energy_last.items():
            now = _read_int(d / "energy_uj")
            if now is None or last is None:
                r.errors[f"rapl:{d.name}"] = "unreadable"
                continue
            if now < last:  # the counter wrapped at max_energy_range_uj
                now += _read_int(d / "max_energy_range_uj") or 0
            self._energy_j += (now - last) / 1e6
            self._energy_last[d] = now % (_read_int(d / "max_energy_range_uj") or now + 1)
        return self._energy_j


def _rapl_domains(root: Path) -> list[Path]:
    """Package-level RAPL domains (intel-rapl:N; their subzones core/uncore/dram are parts of it)."""
    try:
        return sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1
                      and _read_int(p / "energy_uj") is not None)
    except OSError:
        return []


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _process_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _host_cpu() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _rss() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None
