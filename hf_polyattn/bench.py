"""Attention speed and memory: every kind's benchmark rows against SDPA, measured in the same run.

    hf-polyattn bench                  # = python recipes/benchmark_attention.py (CPU)
    hf-polyattn bench --quick          # the two shortest lengths, one repeat (a smoke run)
    hf-polyattn bench --device cuda    # the GPU grid below, against SDPA's flash path
    hf-polyattn bench --bidirectional  # encoder (non-causal) attention: the bidirectional kinds' rows
    hf-polyattn bench --model DIR [--base DIR]   # a whole retrofitted model against its softmax base: see
                                                 # hf_polyattn/bench_model.py and the options below

Defaults per device (every one can be overridden):

    cpu:  fp32, B=1, H=4,  d=64, n = 1k..32k,  best of 3,  2 threads -> cpu-fp32.{md,json,png}
    cuda: bf16, B=1, H=16, d=64, n = 2k..128k, best of 10          -> cuda-bf16.{md,json,png}

On CUDA the grid also has the row ``fla-linear-elu``: fla-core's Triton kernel
``fla.ops.linear_attn.chunk_linear_attn`` with elu+1 features (the same attention as the
``linear-elu`` row), when fla-core is installed (``pip install fla-core``); otherwise the row
says "not installed".

Each (kind, n) runs in its own subprocess so its peak memory can be read cleanly: on CPU the
peak resident set (ru_maxrss) minus the resident set just before the timed forward+backward,
on CUDA torch.cuda.max_memory_allocated minus the memory allocated before it. Time = best of
``--repeats`` causal forward+backward passes after one warm-up. Ratios (SDPA time / kind time,
kind memory / SDPA memory) are taken within this run only: machines are noisy, never compare
against numbers from another run. An out-of-memory error is recorded as OOM for its cell (larger
n of the same kind are then not run) and the run goes on.

Also printed (the roofline rows, in the table and the JSON): the achieved GFLOP/s of the polysketch and linear
paths, plain, with exact local blocks and with a window (an analytic count of their matmul flops, forward +
backward, divided by their time: ``causal_flops``) next to torch.mm's GFLOP/s on 2048^2 matrices measured in the
same run.

The files are written after every finished cell, each replaced atomically (a temporary file in the same folder,
then ``os.replace``), so a run stopped from outside (``timeout``, a job's time limit, Ctrl-C, SIGTERM) keeps every
cell it measured in a consistent .md and .json: while cells remain, the .md says "Partial: k of N cells done" and
the JSON has ``"complete": false``, ``cells_done`` and ``cells_planned``; the last write says ``"complete": true``.
The .png is drawn once, when the grid has finished (a partial run has none; a plot from an earlier run of the same
name is removed with its table). A SIGTERM stops the run as Ctrl-C does: the running cell's worker is killed, the
files keep the cells before it, and the process exits with status 143 (128 + SIGTERM).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import bench_model
from .bench_common import (  # noqa: F401  (re-exported: bench.machine, bench.write_atomic, ... as before the move)
    EXTERNAL,
    allocator_settings,
    completion,
    flat,
    int_at_least,
    int_items,
    is_oom,
    kept,
    machine,
    machine_info,
    replace_atomically,
    save_figure,
    sigterm_exits,
    write_atomic,
)


def kind_rows(direction: str = "causal") -> dict[str, dict | None]:
    """The benchmark rows: ``sdpa`` and every registered kind's ``KindSpec.bench`` rows (name -> PolyAttnConfig
    kwargs) that serve ``direction`` ('causal' or 'bidirectional')."""
    from .registry import all_kinds

    rows: dict[str, dict | None] = {"sdpa": None}
    for spec in all_kinds():
        if getattr(spec, direction):
            rows.update({name: dict(cfg) for name, cfg in spec.bench.items()})
    return rows


# per-token cumsum stores n x F x (d+1) for autograd, the exact polynomial is O(n^2): cap them
MAX_LEN = {"polysketch-cumsum": 4096, "polynomial-exact": 8192}

DEFAULTS = {
    "cpu": {"lengths": [1024, 2048, 4096, 8192, 16384, 32768], "heads": 4, "dtype": "fp32", "repeats": 3,
            "external": False},
    "cuda": {"lengths": [2048, 4096, 8192, 16384, 32768, 65536, 131072], "heads": 16, "dtype": "bf16",
             "repeats": 10, "external": True},
}
DEFAULT_OUT = Path("recipes/results/benchmark_attention")
HEAD_DIM, TIMEOUT = 64, 900


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def causal_flops(row: dict, n: int, heads: int, d: int) -> float | None:
    """Matmul flops of one causal forward + backward of a benchmark row's path (``kind_rows``' PolyAttnConfig
    fields), or None where the path is not counted: polysketch (degree 4, gaussian sketch) and linear with elu + 1
    features, on the block algorithm, plain, with exact local blocks or with a window.

    Per token and head, F features, e = d + 1 value columns (the normaliser's), b the block, w the window, p the
    kernel's input width (``feature_proj``, else d); every product counts 2 flops per multiply-add, and backward
    two products per forward one (three passes):

    - the kernel state (``ops/causal.py``): forward = state update + query read (2 x 2Fe), backward = state
      recompute + dA + suffix + dB + dC (5 x 2Fe);
    - the diagonal blocks read through the features (plain, and a window's far part): phi(A) phi(B)^T (2bF) and its
      lower triangle times the values (2be), three passes; with exact local blocks instead: scores (2bd) and
      weights x values (2be), three passes;
    - a window (``ops/window.py``): tiles of w queries against 2w candidate keys, scores (2 x 2wd) and weights x
      values (2 x 2we), three passes; its E sink slots (``sinks`` + ``learned_sinks``) the same with E keys:
      3 x (2Ed + 2Ee);
    - polysketch's features: F = r(r+1)/2, the degree-2 sketch's two p x r factors for q and for k (2 x 2 x 2pr),
      three passes; elu + 1: F = p, elementwise (none counted);
    - ``feature_proj``: q and k times a d x p matrix (2 x 2dp), three passes.

    Elementwise work (the features' tensor square, exp, masks, decay factors, q/k LayerNorms, window_mix) is not
    counted, nor the projection a backward pass recomputes: a lower bound of the work done, so the achieved GFLOP/s
    are too. Where a layer runs other kernels (backend 'fla', asked for by name) the same count over their time is
    an effective rate. Not counted (None): a short convolution, the cumsum algorithm, other kinds and feature maps.
    """
    from .config import PolyAttnConfig

    cfg = PolyAttnConfig(**row)
    if cfg.causal_algorithm != "block" or cfg.short_conv:
        return None
    width = cfg.feature_proj or d
    if cfg.kind == "polysketch" and cfg.degree == 4 and cfg.sketch == "gaussian":
        feats = cfg.sketch_size * (cfg.sketch_size + 1) // 2
        per_token = 3 * 2 * 2 * 2 * width * cfg.sketch_size
    elif cfg.kind == "linear" and cfg.feature_map == "elu":
        feats, per_token = width, 0
    else:
        return None
    e, b, w = d + 1, cfg.block_size, cfg.window
    per_token += 7 * 2 * feats * e
    if cfg.feature_proj:
        per_token += 3 * 2 * 2 * d * width
    if w:
        slots = cfg.sinks + cfg.learned_sinks
        per_token += 3 * (2 * 2 * w * d + 2 * 2 * w * e) + 3 * (2 * slots * d + 2 * slots * e)
        per_token += 3 * (2 * b * feats + 2 * b * e)
    elif cfg.local_exact:
        per_token += 3 * (2 * b * d + 2 * b * e)
    else:
        per_token += 3 * (2 * b * feats + 2 * b * e)
    return float(per_token * n * heads)




def _fla_step(q, k, v):
    """fla-core's chunked linear attention with elu+1 features on (B, T, H, D) tensors, forward + backward."""
    import inspect

    import torch.nn.functional as F
    from fla.ops.linear_attn import chunk_linear_attn

    params = inspect.signature(chunk_linear_attn).parameters
    kw = {"scale": 1.0}  # normalised output: the scale cancels
    if "normalize" in params:
        kw["normalize"] = True
    if "head_first" in params:  # older fla versions default to (B, H, T, D)
        kw["head_first"] = False

    def step():
        out = chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v, **kw)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    return step


def worker(kind: str, n: int, args) -> dict:
    """Time and peak memory of one (kind, n) cell; an out-of-memory error gives an OOM row instead."""
    try:
        return _measure(kind, n, args)
    except Exception as err:  # noqa: BLE001 - only OOM is turned into a row, the rest is re-raised
        if is_oom(err):
            return {"kind": kind, "n": n, "oom": True, "error": f"OOM: {str(err).splitlines()[0][:160]}"}
        raise


def _measure(kind: str, n: int, args) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, args.heads, n, args.head_dim)
    if kind in EXTERNAL:
        if dev.type != "cuda":
            raise RuntimeError(f"{kind} needs a CUDA device (fla's kernels are Triton kernels)")
        shape = (1, n, args.heads, args.head_dim)  # fla's layout
    q, k, v = (torch.randn(shape, generator=gen).to(dev, dtype).requires_grad_() for _ in range(3))
    causal = direction(args) == "causal"
    if kind == "sdpa":
        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
    elif kind == "fla-linear-elu":
        step = _fla_step(q, k, v)
    else:
        from hf_polyattn import PolyAttnConfig

        cfg = PolyAttnConfig(**kind_rows(direction(args))[kind])
        # in the dtype of the inputs, as in a model of that dtype (a bf16 model holds bf16 sketches)
        mod = cfg.spec.module_class()(cfg, args.heads, args.head_dim).to(dev, dtype)

        def step():
            mod(q, k, v, causal=causal).sum().backward()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up (also allocator warm-up)
    q.grad = k.grad = v.grad = None
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        q.grad = k.grad = v.grad = None
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"kind": kind, "n": n, "seconds": min(times), "all_seconds": times, "peak_bytes": max(peak, 0)}


def mm_gflops(args) -> float:
    import torch

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    x = torch.randn(2048, 2048, device=dev, dtype=dtype)
    torch.mm(x, x)
    best = float("inf")
    for _ in range(5):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(x, x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best / 1e9








# ----------------------------------------------------------------------------------------------- arguments


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written; ``(default: ...)`` appended to every option that has a default.

    Shared by ``hf-polyattn`` and this benchmark's own parser; it lives here because the CLI depends on bench,
    never the reverse (``hf_polyattn.cli`` imports this module).
    """

    def add_argument(self, action):
        super().add_argument(action)
        # argparse measures the command names at their parent's indent, one indent short: the longest one
        # ('score-heads') had its help wrapped onto the next line
        if isinstance(action, argparse._SubParsersAction) and action.help is not argparse.SUPPRESS:
            longest = max(len(self._format_action_invocation(a)) for a in action._get_subactions())
            self._action_max_length = max(self._action_max_length,
                                          longest + self._current_indent + self._indent_increment)

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
            return f"{text} (default: {shown})"
        return text




_positive_int = int_at_least(1)






def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``python recipes/benchmark_attention.py`` and ``hf-polyattn bench``)."""
    cpu, cuda = DEFAULTS["cpu"], DEFAULTS["cuda"]
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where to run; picks the defaults of --lengths, --heads, --dtype, --repeats, --kinds")
    p.add_argument("--lengths", type=int_items(1), nargs="+", metavar="N",
                   help=f"context lengths n, as N N ... or N,N,... (default: {cpu['lengths']} on CPU, "
                        f"{cuda['lengths']} on CUDA)")
    choices = [*kind_rows("causal"), *EXTERNAL, *kind_rows("bidirectional")]
    p.add_argument("--kinds", nargs="+", choices=list(dict.fromkeys(choices)), metavar="KIND",
                   help=f"rows besides sdpa (always run): the kinds' benchmark rows {list(dict.fromkeys(choices))} "
                        f"(default: every row that serves the direction, {list(EXTERNAL)} on CUDA only)")
    p.add_argument("--bidirectional", action="store_true",
                   help="non-causal forward+backward (encoder attention, SDPA with is_causal=False) instead of "
                        "causal; rows of causal-only kinds are left out")
    p.add_argument("--heads", type=_positive_int,
                   help=f"attention heads H (default: {cpu['heads']} on CPU, {cuda['heads']} on CUDA)")
    p.add_argument("--head-dim", type=_positive_int, help=f"head dimension d (default: {HEAD_DIM})")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help=f"q/k/v dtype (default: {cpu['dtype']} on CPU, {cuda['dtype']} on CUDA)")
    p.add_argument("--repeats", type=_positive_int,
                   help=f"timed passes per cell, the fastest counts (default: {cpu['repeats']} on CPU, "
                        f"{cuda['repeats']} on CUDA)")
    p.add_argument("--threads", type=_positive_int, default=2, help="torch CPU threads (OMP_NUM_THREADS)")
    p.add_argument("--timeout", type=_positive_int,
                   help=f"seconds one (kind, n) cell may take before it is recorded as a timeout (default: {TIMEOUT})")
    p.add_argument("--out", type=Path,
                   help=f"output folder of DEVICE-DTYPE.md, .json and .png (default: {DEFAULT_OUT}); with --model, "
                        f"of its table, JSON and plot (default there: {bench_model.DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="the two shortest default lengths, one repeat (a smoke run)")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    bench_model.add_arguments(p)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    add_arguments(p)
    return p


def resolve(args) -> argparse.Namespace:
    """Fill the device-dependent defaults in place (pure: no device is touched). Returns ``args``."""
    d = DEFAULTS[args.device]
    args.lengths = flat(args.lengths)
    given = args.lengths is not None
    args.head_dim = args.head_dim or HEAD_DIM
    args.timeout = args.timeout or TIMEOUT
    args.out = DEFAULT_OUT if args.out is None else args.out
    args.dtype = args.dtype or d["dtype"]
    args.heads = args.heads or d["heads"]
    args.repeats = args.repeats or d["repeats"]
    args.lengths = list(args.lengths or d["lengths"])
    rows = kind_rows(direction(args))
    if args.kinds:
        refused = [k for k in args.kinds if k not in rows and not (k in EXTERNAL and not args.bidirectional)]
        if refused:
            raise ValueError(f"--kinds {refused}: these rows do not serve {direction(args)} attention; allowed: "
                             f"{list(rows)}")
    args.kinds = list(args.kinds or [*rows, *(EXTERNAL if d["external"] and not args.bidirectional else [])])
    if args.quick:
        args.lengths, args.repeats = (args.lengths if given else d["lengths"])[:2], 1
    if "sdpa" not in args.kinds:
        args.kinds = ["sdpa", *args.kinds]
    args.kinds = list(dict.fromkeys(args.kinds))  # no duplicates, order kept
    return args


def direction(args) -> str:
    return "bidirectional" if getattr(args, "bidirectional", False) else "causal"


def output_tag(args) -> str:
    return (f"{args.device}-{args.dtype}" + ("-bidirectional" if direction(args) == "bidirectional" else "")
            + ("-quick" if args.quick else ""))


def plan(args) -> list[tuple[int, str]]:
    """The (n, kind) cells to run, in order; the capped kinds stop at their MAX_LEN."""
    return [(n, kind) for n in args.lengths for kind in args.kinds if n <= MAX_LEN.get(kind, n)]


# ----------------------------------------------------------------------------------------------- running


def run_cell(kind: str, n: int, args) -> dict:
    """One (kind, n) cell in a fresh subprocess; failures become rows ('oom', 'error'), never exceptions."""
    if kind in EXTERNAL and importlib.util.find_spec(EXTERNAL[kind]) is None:
        return {"kind": kind, "n": n, "error": "not installed (pip install fla-core)", "not_installed": True}
    if kind in EXTERNAL and args.device != "cuda":
        return {"kind": kind, "n": n, "error": "needs --device cuda (Triton kernels)"}
    common = ["--heads", str(args.heads), "--head-dim", str(args.head_dim), "--threads", str(args.threads),
              "--repeats", str(args.repeats), "--device", args.device, "--dtype", args.dtype,
              *(["--bidirectional"] if args.bidirectional else [])]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    try:
        res = run_worker([sys.executable, "-m", "hf_polyattn.bench", "--worker", kind, str(n), *common], env=env,
                         timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "n": n, "error": f"timeout (> {args.timeout} s)"}
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines() or [f"exit code {res.returncode}"]
        if res.returncode == -9:
            lines.append("killed by SIGKILL (out of host memory?)")
        row = {"kind": kind, "n": n, "error": lines[-1][:200]}
        if "out of memory" in res.stderr.lower() or "outofmemoryerror" in res.stderr.lower():
            row["oom"] = True
        return row
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_worker(argv: list[str], *, env: dict, timeout: float | None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)``, with Ctrl-C and SIGTERM held while the worker
    starts: arriving between Popen's fork and its return, either raised there, before anything owned the worker,
    which then ran on after the benchmark had stopped (seen once in the whole suite under load: a killed run's
    worker still alive). Held, it is raised once the worker is owned, and the worker is killed as on any stop."""
    held = _hold_stop_signals()
    try:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except BaseException:
        _release_stop_signals(held)
        raise
    with proc:
        try:
            _release_stop_signals(held)  # a stop that came while the worker started is raised here
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        except BaseException:
            proc.kill()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _hold_stop_signals():
    """(the previous handlers, the signals that arrive from now on) or None outside the main thread, which
    receives no signals."""
    if threading.current_thread() is not threading.main_thread():
        return None
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in _STOP_SIGNALS}
    return previous, pending


def _release_stop_signals(held) -> None:
    """The previous handlers back, then each held signal delivered to them (in the order it came)."""
    if held is None:
        return
    previous, pending = held
    for s, handler in previous.items():
        signal.signal(s, handler)
    for s in pending:
        signal.raise_signal(s)


def run_grid(args, cell=None, progress: bool = True, after_cell=None) -> list[dict]:
    """Every planned cell (``cell(kind, n, args)``, default ``run_cell``); after an OOM the larger n of that kind are
    recorded as not run. ``after_cell(rows, planned)``, when given, is called after every row with the rows so far
    (ratios added) and the number of planned cells: the run writes its partial files there."""
    cell = cell or run_cell
    jobs = plan(args)
    it = jobs
    if progress:
        try:
            from tqdm import tqdm

            it = tqdm(jobs, desc="benchmark", unit="run")
        except ImportError:  # pragma: no cover
            pass
    rows, oom_at = [], {}
    for n, kind in it:
        if kind in oom_at:
            rows.append({"kind": kind, "n": n, "oom": True, "skipped": True,
                         "error": f"not run: OOM at n={oom_at[kind]}"})
        else:
            row = cell(kind, n, args)
            if row.get("oom"):
                oom_at[kind] = n
            rows.append(row)
        if after_cell is not None:
            add_ratios(rows)
            after_cell(rows, len(jobs))
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """ms, SDPA time / time and memory / SDPA memory of every measured row, against SDPA at the same n."""
    sdpa = {r["n"]: r for r in rows if r["kind"] == "sdpa" and "seconds" in r}
    for r in rows:
        if "seconds" not in r:
            continue
        r["ms"] = r["seconds"] * 1e3
        base = sdpa.get(r["n"])
        r["sdpa_over_kind"] = base["seconds"] / r["seconds"] if base else None
        r["memory_over_sdpa"] = r["peak_bytes"] / max(base["peak_bytes"], 1) if base else None


def table(rows: list[dict], args, where: str, gflops_mm: float) -> str:
    ms = args.device == "cuda"
    unit = "time (ms)" if ms else "time (s)"
    lines = [f"Machine: {where}; B=1, H={args.heads}, d={args.head_dim}; {direction(args)} forward+backward; "
             f"best of {args.repeats}; torch.mm 2048^2: {gflops_mm:.1f} GFLOP/s", "",
             f"| kind | n | {unit} | SDPA time / time | peak memory (MiB) | memory / SDPA memory |",
             "|---|---|---|---|---|---|"]
    by = {(r["kind"], r["n"]): r for r in rows}
    for n in args.lengths:
        for kind in args.kinds:
            r = by.get((kind, n))
            if r is None:
                continue
            if "seconds" not in r:
                cell = ("OOM" + (f" ({r['error']})" if r.get("skipped") else "")) if r.get("oom") else r["error"]
                if not r.get("oom") and not r.get("not_installed"):
                    cell = f"error: {cell}"
                lines.append(f"| {kind} | {n} | {cell} | | | |")
                continue
            t = f"{r['ms']:.2f}" if ms else f"{r['seconds']:.3f}"
            speed = f"{r['sdpa_over_kind']:.2f}x" if r.get("sdpa_over_kind") is not None else "-"
            mem = f"{r['memory_over_sdpa']:.2f}" if r.get("memory_over_sdpa") is not None else "-"
            lines.append(f"| {kind} | {n} | {t} | {speed} | {r['peak_bytes'] / 2**20:.0f} | {mem} |")
    counted = [r for r in rows if r.get("gflops") is not None]
    if counted:
        lines += ["", f"Roofline: GFLOP/s achieved = the path's matmul flops (an analytic count, forward + backward: "
                      f"bench.causal_flops) / its time, against torch.mm 2048^2 in this run ({gflops_mm:.1f} GFLOP/s)",
                  "", "| kind | n | GFLOP | GFLOP/s achieved | share of torch.mm |", "|---|---|---|---|---|"]
        for n in args.lengths:
            for kind in args.kinds:
                r = by.get((kind, n))
                if r is not None and r.get("gflops") is not None:
                    lines.append(f"| {kind} | {n} | {r['gflop']:.2f} | {r['gflops']:.1f} | "
                                 f"{100 * r['mm_share']:.0f}% |")
    elif direction(args) == "causal":
        lines += ["", f"torch.mm 2048^2: {gflops_mm:.1f} GFLOP/s; no row here has a counted path (bench.causal_flops)"]
    return "\n".join(lines)


def add_roofline(rows: list[dict], args, gflops_mm: float) -> None:
    """gflop (analytic, ``causal_flops``), gflops (achieved) and mm_share (of torch.mm's GFLOP/s in the same run) of
    every timed causal row whose path is counted."""
    if direction(args) != "causal":
        return
    presets = kind_rows("causal")
    for r in rows:
        if "seconds" not in r or presets.get(r["kind"]) is None:
            continue
        flops = causal_flops(presets[r["kind"]], r["n"], args.heads, args.head_dim)
        if flops is not None:
            r["gflop"] = flops / 1e9
            r["gflops"] = flops / r["seconds"] / 1e9
            r["mm_share"] = r["gflops"] / gflops_mm












def write_outputs(rows: list[dict], args, *, where: str, info: dict, gflops_mm: float, command: str,
                  planned: int | None = None) -> Path:
    """DEVICE-DTYPE.md (the table), .json (machine, rows) and .png (time and memory vs n) in ``args.out``.

    ``planned``: the cells the run plans (``len(plan(args))``, default: as many as ``rows``). With fewer rows the
    write is a partial one, made after every cell: the .md and .json say so (``completion``), the table is not
    printed, and no plot is drawn: matplotlib takes 1-2 s a figure on the 2-core CPU, as long as a short cell's
    whole worker process, so it is drawn once at the end. Every file is replaced atomically (``write_atomic``).
    """
    planned = len(rows) if planned is None else planned
    fields, note = completion(len(rows), planned)
    add_roofline(rows, args, gflops_mm)
    text = table(rows, args, where, gflops_mm)
    if note is None:
        print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    tag = output_tag(args)
    head = f"Run {stamp}: `{command}`\n\n" + (f"{note}\n\n" if note else "")
    write_atomic(args.out / f"{tag}.md", f"{head}{text}\n")
    settings = {k: getattr(args, k) for k in ("device", "dtype", "heads", "head_dim", "repeats", "lengths", "kinds",
                                              "threads")}
    if args.bidirectional:
        settings["bidirectional"] = True
    rows_cfg = kind_rows(direction(args))
    settings["presets"] = {k: rows_cfg.get(k) for k in args.kinds if k in rows_cfg}  # PolyAttnConfig fields per row
    write_atomic(args.out / f"{tag}.json", json.dumps(
        {"machine": where, "machine_info": info, "date": stamp, "command": command, "settings": settings,
         "batch": 1, "mm_gflops": gflops_mm, **fields, "rows": rows}, indent=1))
    if note is not None:
        # a plot of an earlier run of this name would sit beside this run's table as if it were its own
        (args.out / f"{tag}.png").unlink(missing_ok=True)
        return args.out / f"{tag}.md"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        by = {(r["kind"], r["n"]): r for r in rows}
        scale, unit = (1e3, "ms") if args.device == "cuda" else (1.0, "s")
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for kind in args.kinds:
            pts = [(n, by[(kind, n)]) for n in args.lengths if "seconds" in by.get((kind, n), {})]
            if pts:
                axes[0].loglog([n for n, _ in pts], [r["seconds"] * scale for _, r in pts], "o-", label=kind)
                axes[1].loglog([n for n, _ in pts], [max(r["peak_bytes"], 1) / 2**20 for _, r in pts], "o-",
                               label=kind)
        axes[0].set(xlabel="context length n", ylabel=f"forward+backward ({unit})", title="time")
        axes[1].set(xlabel="context length n", ylabel="peak extra memory (MiB)", title="memory")
        axes[0].legend(fontsize=7)
        fig.suptitle(where, fontsize=8)
        fig.tight_layout()
        save_figure(fig, args.out / f"{tag}.png")
        plt.close(fig)
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"wrote {args.out}/{tag}.md, .json, .png")
    return args.out / f"{tag}.md"




def run(args, *, command: str) -> int:
    """The benchmark for parsed and resolved ``args``; ``command`` is recorded in the outputs, which are rewritten
    after every cell (module docstring)."""
    if args.model:
        return bench_model.run(args, command=command)
    where_info = machine_info(args)
    where = machine(args, where_info)  # read the load average before the runs add to it
    gflops_mm = mm_gflops(args)
    planned, written = len(plan(args)), [0]
    out = dict(where=where, info=where_info, gflops_mm=gflops_mm, command=command, planned=planned)

    def save(rows, planned):
        if len(rows) < planned:  # the last cell's write is the complete one below, with the plot
            write_outputs(rows, args, **out)
            written[0] = len(rows)

    try:
        with sigterm_exits():
            rows = run_grid(args, after_cell=save)
            write_outputs(rows, args, **out)
    except BaseException:  # noqa: BLE001 - Ctrl-C, SIGTERM, a failure: say what was kept, then re-raise
        if written[0]:
            print(kept(written[0], planned, args.out / f"{output_tag(args)}.md"), file=sys.stderr)
        raise
    return 0


def check_device(parser: argparse.ArgumentParser, args) -> None:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")


def prepare(parser: argparse.ArgumentParser, args) -> argparse.Namespace:
    """Resolve the defaults of parsed ``args`` and check the device (argparse errors, exit code 2); with --model
    the whole-model benchmark's (``bench_model.resolve``)."""
    args._parser = getattr(args, "_parser", None) or parser
    bench_model.resolve(parser, args)
    if not args.model:
        resolve(args)
    if not args.worker:
        check_device(parser, args)
    return args


def main(argv=None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = prepare(parser, parser.parse_args(argv))
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args)))
        return 0
    shown = prog or "python recipes/benchmark_attention.py"
    return run(args, command=f"{shown} {' '.join(argv if argv is not None else sys.argv[1:])}")


if __name__ == "__main__":
    raise SystemExit(main())
