"""The machine a measurement ran on: the one place in the package that names it.

Used by the kernel benchmark (``bench.py``), the training records (``training/pipeline.py``) and the benchmark and
study scripts under ``recipes/`` (``record``, ``basics``, ``describe``, ``uptime``), so every results file names its
machine the same way.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time


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


def uptime() -> str:
    """`uptime`'s line: the load average says how shared the machine was while timing."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def record(device: str = "cpu") -> dict:
    """What a speed measurement records (e2e_speed, paper_tables, the benchmark scripts): CPU, cores, the GPU when
    ``device`` is 'cuda', torch, threads, the load (``uptime``) and the date."""
    import torch

    return {"cpu": cpu_name(), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else False,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "uptime": uptime(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def basics() -> dict:
    """torch version, architecture and CPU count (the keys the training grids' recorded settings have always used)."""
    import torch

    return {"torch": torch.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count()}


def describe() -> str:
    """'<cpu>, <n> CPUs, torch <version>, <threads> threads' (the line printed above a benchmark table)."""
    import torch

    return f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"
def cpu_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command name, user + system CPU clock ticks so far) of every process readable in /proc ({} without
    /proc)."""
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


def _busy_seconds() -> float | None:
    """CPU seconds every CPU of the machine spent busy since boot (/proc/stat: all but idle and iowait), or None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_snapshot() -> dict:
    """What ``others_between`` compares: the machine's busy CPU seconds, this process's, and every visible
    process's ticks."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    return {"busy_s": _busy_seconds(), "own_s": own.ru_utime + own.ru_stime, "processes": cpu_ticks(),
            "time": time.time()}


def others_between(before: dict, after: dict, top: int = 5) -> dict:
    """What else used the CPUs between two ``cpu_snapshot``s: ``cpu_s``, the busy CPU seconds of the whole machine
    (/proc/stat: processes in other containers too) less this process's, or where /proc/stat is missing the sum over
    the processes visible here (``source`` says which); ``cores``: cpu_s per second of wall time; ``busiest``: the
    ``top`` busiest visible command names (summed by name, this process left out) with their CPU seconds."""
    hz = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    by_name: dict[str, float] = {}
    for pid, (name, ticks) in after["processes"].items():
        if pid == me:
            continue
        old = before["processes"].get(pid)
        used = ticks - (old[1] if old and old[0] == name else 0)  # a process started in between counts from 0
        if used > 0:
            by_name[name] = by_name.get(name, 0.0) + used / hz
    if before["busy_s"] is not None and after["busy_s"] is not None:
        cpu_s, source = after["busy_s"] - before["busy_s"] - (after["own_s"] - before["own_s"]), "/proc/stat"
    else:
        cpu_s, source = sum(by_name.values()), "visible processes"
    wall = max(after["time"] - before["time"], 1e-9)
    return {"cpu_s": max(cpu_s, 0.0), "cores": max(cpu_s, 0.0) / wall, "wall_s": wall, "source": source,
            "busiest": sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}
