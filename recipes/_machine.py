"""What the speed recipes record about the machine they ran on (shared by e2e_speed and paper_tables)."""

import os
import platform
import subprocess
import time

import torch


def uptime() -> str:
    """`uptime`'s line: the load average says how shared the machine was while timing."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine(device: str = "cpu") -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else False,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "uptime": uptime(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
