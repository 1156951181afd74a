"""CPU threads for torch on a shared CPU: one per free core, and a note when other processes compete.

torch's default is one thread per core, and its OpenMP threads spin while they wait for work: the
fastest choice on an idle machine, and ~10x slower than `--threads 1` when another busy process holds
one of two cores (README, "CPU threads"). So the CLI measures what the cores are doing instead:
`CpuWatch` reads /proc/stat (the CPUs this process may run on, `os.sched_getaffinity`) and this
process's own CPU time over an interval; the difference is the other processes' load, in cores.
`default_threads` is the cores left free (at least 1), measured while the model loads.

Invariants: nothing here changes what is computed, only how many threads compute it; `--threads`
and OMP_NUM_THREADS always win; where /proc/stat cannot be read (not Linux) nothing is measured and
torch keeps its default.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

CONTENDED = 0.5  # cores used by other processes, on average, from which the stats line says so


def _cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _busy_and_total(cpus: set[int]) -> tuple[float, float] | None:
    """Busy and total jiffies of `cpus` since boot (/proc/stat), or None when unreadable."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    busy = total = 0.0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            v = [float(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(v)
            busy += sum(v) - v[3] - v[4]
    return (busy, total) if total else None


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system  # every thread of this process


@dataclass
class CpuLoad:
    cores: int  # CPUs this process may use
    others: float  # cores the other processes kept busy, on average

    @property
    def free(self) -> float:
        return max(0.0, self.cores - self.others)

    @property
    def contended(self) -> bool:
        return self.others >= CONTENDED


class CpuWatch:
    """`w = CpuWatch()` ... `w.load()`: the other processes' CPU load since the watch started."""

    def __init__(self):
        self.cpus = _cpus()
        self.t0, self.own0, self.stat0 = time.monotonic(), _own_seconds(), _busy_and_total(self.cpus)

    def load(self, min_seconds: float = 0.1) -> CpuLoad | None:
        """None where /proc/stat is unreadable. Waits until `min_seconds` have passed since the start (a
        shorter interval is mostly rounding: /proc/stat counts in 10 ms ticks)."""
        if self.stat0 is None:
            return None
        time.sleep(max(0.0, min_seconds - (time.monotonic() - self.t0)))
        stat1, own1 = _busy_and_total(self.cpus), _own_seconds()
        if stat1 is None or stat1[1] <= self.stat0[1]:
            return None
        busy, total = stat1[0] - self.stat0[0], stat1[1] - self.stat0[1]
        cores = len(self.cpus)
        wall = total / cores / (os.sysconf("SC_CLK_TCK") or 100)  # seconds the interval lasted, by the ticks
        others = max(0.0, busy / total * cores - (own1 - self.own0) / max(wall, 1e-6))
        return CpuLoad(cores, round(min(others, cores), 2))


def set_threads(n: int) -> None:
    """`--threads N`: torch's CPU threads, with a note on stderr when N is more than the CPUs this process may use
    (each thread past them waits for a core: `--threads 999` on two cores ran 40x slower)."""
    import sys

    import torch

    cores = len(_cpus())
    if n > cores:
        print(f"note: --threads {n} is more than the {cores} CPU{'s' if cores != 1 else ''} this process may use; the "
              f"extra threads only wait for them (--threads {cores} or fewer is faster)", file=sys.stderr)
    torch.set_num_threads(n)


def default_threads(load: CpuLoad | None) -> int | None:
    """One thread per free core (at least 1); None (torch's default) when nothing was measured."""
    if load is None:
        return None
    return max(1, min(load.cores, round(load.free)))


def threads_note(load: CpuLoad | None, threads: int) -> str:
    """For the stats line: empty unless other processes competed for the CPU during the run."""
    if load is None or not load.contended:
        return ""
    return (f"CPU shared: other processes kept {load.others:.1f} of {load.cores} cores busy; "
            f"{threads} thread{'s' if threads != 1 else ''} (--threads N to choose)")
