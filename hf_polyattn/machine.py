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
