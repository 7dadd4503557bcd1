"""What the attention benchmark (``hf_polyattn.bench``) and the whole-model benchmark (``hf_polyattn.bench_model``)
share: the machine a run states, argparse types, atomic result files, the partial-run fields and SIGTERM handling.

``bench`` runs ``bench_model`` for ``--model`` and so imports it; ``bench_model`` takes these from here rather than
from ``bench``, so that the import arrows point one way (tests/test_import_cycles.py). ``bench`` re-exports them
under their old names (``bench.write_atomic``, ``bench.machine``, ...), which the CLI and the recipes use.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import signal
import subprocess
import threading
from pathlib import Path

# Rows measured with another library's kernel (not a PolyAttnConfig): name -> module it needs.
EXTERNAL = {"fla-linear-elu": "fla"}


def is_oom(err: BaseException) -> bool:
    """An out-of-memory error of torch on either device (CUDA OutOfMemoryError, CPU allocator, MemoryError)."""
    import torch

    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    msg = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def machine_info(args) -> dict:
    """What the numbers were measured on: recorded in the JSON (and, summarised, in the Markdown)."""
    import torch

    info = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "threads": args.threads}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu=torch.cuda.get_device_name(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    for name, module in EXTERNAL.items():
        if importlib.util.find_spec(module) is not None:
            try:
                from importlib.metadata import version

                info[f"{name} version"] = version("fla-core")
            except Exception:  # noqa: BLE001 - fla installed some other way
                info[f"{name} version"] = "installed (version unknown)"
    return info


def machine(args, info: dict | None = None) -> str:
    if args.device == "cuda":
        info = info or machine_info(args)
        return (f"{info['gpu']} ({info['gpu_memory_gib']} GiB), torch {info['torch']}, CUDA {info['cuda']}, "
                f"driver {info.get('driver') or 'unknown'} ({args.dtype})")
    from .machine import cpu_name

    return (f"CPU {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads ({args.dtype}); load average at start "
            f"{os.getloadavg()[0]:.1f}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
            f"{allocator_settings()}")


def allocator_settings() -> str:
    """The process's memory allocator settings as a run states them: glibc's ``MALLOC_*`` variables and an
    ``LD_PRELOAD``-ed allocator (jemalloc, tcmalloc), or 'allocator: default'. They change CPU times: glibc maps
    every allocation above its mmap threshold (at most 32 MiB) fresh from the kernel and unmaps it when freed, so
    each large temporary pays its page faults again (docs/numerics_and_backends.md: the batch-8 prefill)."""
    found = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k == "LD_PRELOAD"]
    return "allocator: " + (", ".join(found) if found else "default")


def int_at_least(minimum: int):
    """argparse ``type=``: an int >= ``minimum`` (shared by the CLI and the speed recipes)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


def int_items(minimum: int):
    """argparse ``type=`` of an ``nargs='+'`` option that also takes comma lists: 'N' or 'N,N,...' (ints >=
    ``minimum``) gives a list per item; ``flat`` joins them."""
    one = int_at_least(minimum)

    def parse(text: str) -> list[int]:
        items = text.split(",")
        if len(items) > 1 and not all(x.strip() for x in items):
            raise argparse.ArgumentTypeError(f"expected N or N,N,... (integers >= {minimum}), got {text!r}")
        return [one(x.strip()) for x in items]  # the message names the bad item

    parse.__name__ = f"int>={minimum}"
    return parse


def flat(items: list[list[int]] | None) -> list[int] | None:
    """The values of an ``int_items`` option in order, each once (None stays None)."""
    return None if items is None else list(dict.fromkeys(v for item in items for v in item))


def replace_atomically(path: Path, write) -> None:
    """``path`` holds what ``write(temporary_path)`` wrote, or what it held before, never a part: the temporary file
    sits in the same folder (same file system) and is ``os.replace``d onto ``path``; it is removed if ``write`` is
    interrupted (a KeyboardInterrupt, SIGTERM's SystemExit: ``sigterm_exits``) or fails."""
    # named by the process rather than by tempfile.mkstemp, whose file is private (0600) and would make the result
    # files so: written by ``write``, it gets the permissions any new file gets here
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:  # noqa: BLE001 - re-raised: only the temporary file is cleaned up
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: Path, text: str) -> None:
    """``text`` at ``path``, replaced atomically (``replace_atomically``)."""
    replace_atomically(path, lambda tmp: Path(tmp).write_text(text))


def save_figure(fig, path: Path) -> None:
    """A matplotlib figure as a PNG at ``path``, replaced atomically (``replace_atomically``)."""
    replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def completion(done: int, planned: int) -> tuple[dict, str | None]:
    """The JSON fields that say how much of a run's grid its files hold (``complete``, ``cells_done``,
    ``cells_planned``) and, while cells remain, the Markdown line that says so (None once complete)."""
    fields = {"complete": done >= planned, "cells_done": done, "cells_planned": planned}
    note = None if done >= planned else (
        f"Partial: {done} of {planned} cells done; the run did not finish (stopped, or still running): the cells "
        "below are all it measured, and the plot is drawn only when the run finishes.")
    return fields, note


@contextlib.contextmanager
def sigterm_exits():
    """While the block runs, SIGTERM (what ``timeout`` and job schedulers send) raises SystemExit(143) in the main
    thread instead of killing the process outright, so it unwinds as Ctrl-C does: ``run_worker`` kills the
    running cell's worker (else it would run on, holding the GPU), an interrupted file write removes its temporary
    file, and the process still exits non-zero (143 = 128 + SIGTERM, as a shell reports a killed process). The
    previous handler is restored after; outside the main thread nothing changes (signals go to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def kept(done: int, planned: int, path: Path) -> str:
    """The line a stopped run prints: what its files hold."""
    return f"stopped after {done} of {planned} cells: {path.with_suffix('')}.md and .json keep them"
