"""What the recipes record about the machine they ran on (the CPU's name from hf_polyattn.machine).

``machine()``: the speed recipes' record (e2e_speed, paper_tables); ``basics()``: the keys the training grids store
in their settings (thesis_reversal, sketch_accuracy); ``describe()``: the one-line form printed above a table
(benchmark_decode).
"""

import os
import platform
import subprocess
import time

import torch

from hf_polyattn.machine import cpu_name


def uptime() -> str:
    """`uptime`'s line: the load average says how shared the machine was while timing."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine(device: str = "cpu") -> dict:
    return {"cpu": cpu_name(), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else False,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "uptime": uptime(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def basics() -> dict:
    """torch version, architecture and CPU count (the keys the recorded settings have always used)."""
    return {"torch": torch.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count()}


def describe() -> str:
    """'<cpu>, <n> CPUs, torch <version>, <threads> threads'."""
    return f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"
