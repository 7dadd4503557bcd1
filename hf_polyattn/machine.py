"""The machine a measurement ran on: the one place in the package that names it.

Used by the kernel benchmark (``bench.py``), the training records (``training/pipeline.py``)
and the recipes (``recipes/_machine.py``), so every results file names its machine the same way.
"""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (e.g. 'AMD EPYC ...'), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """The first CUDA device's name, or None without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def summary() -> str:
    """'<n>-core CPU (<arch>), <CUDA name | no GPU>, torch <version>, <threads> threads' (training records)."""
    import torch

    gpu = gpu_name()
    dev = f"CUDA {gpu}" if gpu else "no GPU"
    return (f"{os.cpu_count()}-core CPU ({platform.machine()}), {dev}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def cpu_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command name, user + system CPU clock ticks so far) of every process readable in /proc ({} without
    /proc): two snapshots say what else ran between them (``busy_others``)."""
    found = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
        except OSError:  # gone, or not ours to read
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, the fields after it do not
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        found[pid] = (name, int(rest[11]) + int(rest[12]))  # fields 14 and 15: utime, stime
    return found


def busy_others(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], top: int = 5
                ) -> tuple[float, list[tuple[str, float]]]:
    """(CPU seconds every other process used between two ``cpu_ticks`` snapshots, the ``top`` busiest command names
    with their seconds, summed by name). This process is left out; processes that started in between count from 0."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    me = os.getpid()
    by_name: dict[str, float] = {}
    for pid, (name, ticks) in after.items():
        if pid == me:
            continue
        old = before.get(pid)
        used = ticks - (old[1] if old and old[0] == name else 0)
        if used > 0:
            by_name[name] = by_name.get(name, 0.0) + used / hz
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
    return sum(by_name.values()), ranked[:top]
