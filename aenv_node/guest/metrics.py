"""Guest metrics for ``GET /metrics``, in the fields E2B's envd reports.

Read from /proc and statfs (no psutil in the guest). CPU use is measured
between two calls, as gopsutil's ``cpu.Percent(0, ...)`` does; the first call
measures since boot.
"""

from __future__ import annotations

import os
import time
from typing import Any


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat", "rb") as f:
        fields = f.readline().split()[1:]
    values = [float(v) for v in fields]
    # user nice system idle iowait irq softirq steal (guest, guest_nice are in user/nice)
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)
    total = sum(values[:8])
    return total, idle


def _meminfo() -> dict[str, int]:
    info: dict[str, int] = {}
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            parts = rest.split()
            if parts:
                info[key.decode()] = int(parts[0]) * 1024
    return info


class Metrics:
    def __init__(self, disk_path: str = "/") -> None:
        self.disk_path = disk_path
        self._last_cpu = _cpu_times()

    def sample(self) -> dict[str, Any]:
        total, idle = _cpu_times()
        last_total, last_idle = self._last_cpu
        self._last_cpu = (total, idle)
        busy_delta = (total - idle) - (last_total - last_idle)
        total_delta = total - last_total
        if total_delta <= 0:
            total_delta, busy_delta = total, total - idle
        cpu_pct = round(max(0.0, min(100.0, 100.0 * busy_delta / total_delta)), 2) if total_delta > 0 else 0.0
        mem = _meminfo()
        mem_total = mem.get("MemTotal", 0)
        cached = mem.get("Cached", 0) + mem.get("SReclaimable", 0)
        mem_used = max(0, mem_total - mem.get("MemFree", 0) - mem.get("Buffers", 0) - cached)
        st = os.statvfs(self.disk_path)
        disk_total = st.f_blocks * st.f_frsize
        disk_used = disk_total - st.f_bavail * st.f_frsize
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": cpu_pct,
            "mem_total_mib": mem_total // (1024 * 1024),
            "mem_used_mib": mem_used // (1024 * 1024),
            "mem_total": mem_total,
            "mem_used": mem_used,
            "mem_cache": cached,
            "disk_used": disk_used,
            "disk_total": disk_total,
        }
