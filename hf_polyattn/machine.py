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
