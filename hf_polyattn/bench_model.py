"""The whole-model benchmark: a retrofitted (polyattn) checkpoint against the softmax checkpoint it came from.

    hf-polyattn bench --model DIR                  # DIR's weights with its polyattn attention vs the same weights
                                                   # with softmax (sdpa): the checkpoint's polyattn settings ignored
    hf-polyattn bench --model DIR --base BASE_DIR  # vs the checkpoint it came from
    hf-polyattn bench --model DIR --quick          # lengths 256 and 1024, batch 1, one repeat: a smoke run

What a user asks of a retrofit: is it faster than the model I started from, and how much memory does it save?
At each prompt length n and batch size b (``--lengths``, ``--batches``; cells with b x n > ``--max-tokens`` are
skipped and listed as such):

- prefill: one forward of the b x n prompt into an empty cache (``logits_to_keep=1``, as ``generate()`` does),
  best of ``--repeats``; its peak memory above what was held before it;
- decode: the median of ``--decode-steps`` single-token steps after ``--warmup`` untimed ones, from that prefill's
  cache; the cache's bytes right after the prefill (and, in the JSON, after the decoded tokens), each beside
  :func:`hf_polyattn.decode_memory`'s formula.

The retrofit decodes with its ``PolyAttnCache``, the base with transformers' ``DynamicCache``: what ``generate()``
gives each. Both models are loaded in this one process and run interleaved (their prefill repeats alternate, and
so do their decode steps, the first of each pair swapping every time), so both see the same background load: take
the ratios (base time / retrofit time, retrofit memory / base memory) from one run only, never across runs. The
output names the machine, threads, dtype, warm-up and repeats, the load average before and after, and the other
processes that used the CPU during the run.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; on a Linux CPU the
kernel's peak resident set (VmHWM, reset by writing 5 to /proc/self/clear_refs, freed heap handed back with
``malloc_trim`` first) minus the resident set before: what the process really took from the machine, allocator
included. Elsewhere it is not measured (said so in the output).

Writes DEVICE-DTYPE.md (tables), .json (every number) and .png (the plot) under ``--out``. ``compare(model, base,
...)`` is the same measurement on models already loaded: the retrofit recipe's ``--speed_lengths`` calls it at the
end of a run (``make demo`` prints its row at 4,096 tokens, into runs/demo/linear/speed.md).

The .md and .json are rewritten after every (batch, length) row, each replaced atomically (as the kernel benchmark
does: ``bench_common.write_atomic``), so a run stopped from outside (``timeout``, a job's time limit, Ctrl-C, SIGTERM)
keeps every row it measured: while rows remain the .md says "Partial: k of N cells done" and the JSON has
``"complete": false``, ``cells_done``, ``cells_planned``; the last write says ``"complete": true``. The .png is
drawn once, at the end (a partial run has none). A SIGTERM stops the run as Ctrl-C does and exits with status 143.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

from . import bench_common
from .bench_common import flat, int_at_least, int_items, is_oom, save_figure

DEFAULTS = {
    "cpu": {"lengths": [1024, 4096, 16384], "batches": [1, 8], "dtype": "fp32", "repeats": 2, "decode_steps": 16,
            "warmup": 3, "max_tokens": 32768},
    "cuda": {"lengths": [4096, 16384, 32768], "batches": [1, 8], "dtype": "bf16", "repeats": 3, "decode_steps": 32,
             "warmup": 5, "max_tokens": 262144},
}
QUICK = {"lengths": [256, 1024], "batches": [1], "repeats": 1, "decode_steps": 4, "warmup": 1}
DEFAULT_OUT = Path("bench_model")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# options of the kernel benchmark only (their defaults are None / False)
KERNEL_ONLY = ("kinds", "bidirectional", "heads", "head_dim", "timeout")
# options of the model benchmark only
MODEL_ONLY = ("base", "batches", "decode_steps", "warmup", "max_tokens", "compile_decode", "capture_decode")
# untimed decoding steps --capture-decode needs before the timed ones replay a graph: the first step turns the
# prefill's states into rings, the second makes them static (run eagerly), the third records the graph
GRAPH_WARMUP = 3
# tokens of the prompt each model prefills once (and decode steps it takes) before the first timed cell
WARMUP_TOKENS, WARMUP_STEPS = 64, 2
NAMES = ("base", "retrofit")


# ----------------------------------------------------------------------------------------------- measuring


class PeakMemory:
    """Peak memory of a block above what was held when it started (the module docstring says how)."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.peak: int | None = None
        if self.device.type == "cuda":
            self.method = "torch.cuda.max_memory_allocated after reset_peak_memory_stats"
            self.available = True
            return
        self.available = os.access("/proc/self/clear_refs", os.W_OK) and os.path.exists("/proc/self/status")
        self.method = ("peak resident set: VmHWM reset through /proc/self/clear_refs, minus VmRSS before"
                       if self.available else "not measured: /proc/self/clear_refs cannot be written here "
                       "(the peak resident set cannot be reset)")
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: freed heap stays counted in the resident set
            self._trim = None

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

    def __enter__(self):
        import torch

        self.peak = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif self.available:
            gc.collect()
            if self._trim is not None:
                self._trim(0)
            self._base = self._status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        return self

    def __exit__(self, *exc):
        import torch

        if exc[0] is not None:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self.available:
            self.peak = max(self._status("VmHWM") - self._base, 0)
        return False


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _forward_kwargs(model) -> tuple[str, bool]:
    """(the forward's name of the cache argument, whether it takes ``logits_to_keep``): transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (the old name warns), 5.23 has only the old one."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def _new_cache(name: str, model):
    """The cache ``generate()`` gives the model: a ``PolyAttnCache`` to the retrofit, a ``DynamicCache`` to the
    base."""
    from transformers import DynamicCache

    from .integration.cache import PolyAttnCache

    return PolyAttnCache(model) if name == "retrofit" else DynamicCache(config=model.config)


def _step(model, ids, cache):
    """One forward into ``cache``; the greedy next token of every row (B, 1)."""
    import torch

    arg, keep = _forward_kwargs(model)
    with torch.inference_mode():
        out = model(ids, use_cache=True, **{arg: cache}, **({"logits_to_keep": 1} if keep else {}))
    return out.logits[:, -1:].argmax(-1)


def _device_of(model):
    return next(model.parameters()).device


def prompt(batch: int, length: int, vocab: int, device) -> object:
    """Seeded token ids (batch, length) below ``vocab``: the same prompt for both models."""
    import torch

    gen = torch.Generator().manual_seed(1000 * batch + length)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


def _measure_cell(models: dict, batch: int, length: int, *, repeats: int, decode_steps: int, warmup: int,
                  vocab: int, meter: PeakMemory) -> dict:
    """One (batch, length) cell of both models: prefill times and peaks, cache bytes, decode times."""
    from .integration.cache import cache_nbytes, decode_memory

    device = _device_of(models["retrofit"])
    ids = prompt(batch, length, vocab, device)
    row = {"batch": batch, "length": length}
    for name in NAMES:
        row[name] = {"prefill_s": [], "peak_bytes_all": []}
    state = {}
    for r in range(repeats):
        for name in NAMES if r % 2 == 0 else NAMES[::-1]:  # alternate which model goes first
            state.pop(name, None)  # the previous repeat's cache is freed before this one is measured
            model = models[name]
            cache = _new_cache(name, model)
            with meter:
                t0 = time.perf_counter()
                token = _step(model, ids, cache)
                _sync(device)
                seconds = time.perf_counter() - t0
            row[name]["prefill_s"].append(seconds)
            row[name]["peak_bytes_all"].append(meter.peak)
            state[name] = (cache, token)
    for name in NAMES:
        r = row[name]
        r["prefill_best_s"] = min(r["prefill_s"])
        r["peak_bytes"] = None if None in r["peak_bytes_all"] else max(r["peak_bytes_all"])  # the largest repeat
        r["cache_bytes"] = cache_nbytes(state[name][0])
        r["cache_bytes_formula"] = decode_memory(models[name], (length,), batch=batch).total[0]
        r["decode_ms"] = []
    for step in range(warmup + decode_steps):
        for name in NAMES if step % 2 == 0 else NAMES[::-1]:
            cache, token = state[name]
            t0 = time.perf_counter()
            token = _step(models[name], token, cache)
            _sync(device)
            if step >= warmup:
                row[name]["decode_ms"].append(1e3 * (time.perf_counter() - t0))
            state[name] = (cache, token)
    for name in NAMES:
        r = row[name]
        r["decode_median_ms"] = statistics.median(r["decode_ms"])
        r["cache_bytes_decoding"] = cache_nbytes(state[name][0])  # after the decoded tokens
        # decoding from graphs (capture_decode) keeps the softmax heads' buffers at its max_length positions
        graphs = models[name].__dict__.get("forward")
        r["cache_bytes_decoding_formula"] = decode_memory(models[name], (length,), batch=batch,
                                                          decoded=warmup + decode_steps,
                                                          capacity=getattr(graphs, "max_length", None)).total[0]
    add_ratios(row)
    return row


def add_ratios(row: dict) -> None:
    """The ratios of one measured cell, from its own numbers: base time / retrofit time (prefill, decode: > 1 =
    the retrofit is faster), retrofit memory / base memory (prefill peak, cache after the prompt)."""
    base, retro = row["base"], row["retrofit"]

    def ratio(num, den):
        return None if num is None or not den else num / den

    row["prefill_speedup"] = ratio(base["prefill_best_s"], retro["prefill_best_s"])
    row["decode_speedup"] = ratio(base["decode_median_ms"], retro["decode_median_ms"])
    row["peak_memory_ratio"] = ratio(retro["peak_bytes"], base["peak_bytes"])
    row["cache_ratio"] = ratio(retro["cache_bytes"], base["cache_bytes"])


def check_pair(model, base) -> None:
    """``model`` runs a polyattn kind and ``base`` softmax, both causal LMs on one device: else a ValueError."""
    from .integration.settings import polyattn_kind

    if polyattn_kind(model.config) is None:
        raise ValueError(f"model: {type(model).__name__} runs {model.config._attn_implementation!r} attention, not a "
                         "polyattn kind: pass the retrofitted model (hf_polyattn.convert, or loaded after "
                         "`import hf_polyattn`)")
    if polyattn_kind(base.config) is not None:
        raise ValueError(f"base: runs the polyattn kind {base.config._attn_implementation!r}: pass the softmax "
                         "model (e.g. loaded with attn_implementation='sdpa')")
    if _device_of(model) != _device_of(base):
        raise ValueError(f"model is on {_device_of(model)}, base on {_device_of(base)}: put both on one device")


def position_limit(model) -> int | None:
    """The most positions ``model`` can run: its learned position table's size (GPT-2's ``n_positions``), None for a
    rotary model (RoPE runs past ``max_position_embeddings``, as the issue's 16k SmolLM2 figures did)."""
    if any("rotary" in type(m).__name__.lower() for m in model.modules()):
        return None
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def _warm_up(models: dict, vocab: int, tokens: int) -> None:
    """One short prefill and a few decode steps per model, untimed: first-call costs (allocator, lazy inits) out of
    the first cell."""
    device = _device_of(models["retrofit"])
    ids = prompt(1, tokens, vocab, device)
    for name, model in models.items():
        cache = _new_cache(name, model)
        token = _step(model, ids, cache)
        for _ in range(WARMUP_STEPS):
            token = _step(model, token, cache)
    _sync(device)


def compare(model, base, lengths=(1024, 4096), *, batches=(1,), decode_steps: int = 16, warmup: int = 3,
            repeats: int = 1, max_tokens: int | None = None, progress: bool = False, after_cell=None) -> list[dict]:
    """The whole-model benchmark on models already loaded: one row per (batch, length), batches outermost.

    ``model``: the retrofit (a polyattn kind), ``base``: its softmax checkpoint (sdpa), on one device, in eval mode.
    A measured row holds ``base`` / ``retrofit`` dicts (prefill seconds of every repeat and the best, peak bytes,
    cache bytes measured and by formula, decode ms of every step and the median) and the ratios (``add_ratios``).
    A row not measured has ``skipped`` (b x n over ``max_tokens``, a prompt and its decoded tokens past a learned
    position table, a larger n after an out-of-memory error) or ``error`` (the cell failed: its message). Torch's
    thread count is the caller's. ``after_cell(rows, planned)``, when given, is called after every row with the rows
    so far and the number of rows planned (``len(batches) x len(lengths)``).
    """
    check_pair(model, base)
    for name, values, low in (("lengths", lengths, 1), ("batches", batches, 1)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
            raise ValueError(f"{name} must be ints >= {low}, got {list(values)!r}")
    for name, value, low in (("decode_steps", decode_steps, 1), ("warmup", warmup, 0), ("repeats", repeats, 1),
                             ("max_tokens", 1 if max_tokens is None else max_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    models = {"base": base.eval(), "retrofit": model.eval()}
    vocab = min(m.get_input_embeddings().num_embeddings for m in models.values())
    meter = PeakMemory(_device_of(model))
    limits = [n for n in map(position_limit, models.values()) if n]
    limit = min(limits) if limits else None
    warm = min(WARMUP_TOKENS, min(lengths))
    _warm_up(models, vocab, warm if limit is None else min(warm, limit - WARMUP_STEPS))
    rows, planned = [], len(batches) * len(lengths)

    def add(row: dict) -> None:
        row["memory_method"] = meter.method
        rows.append(row)
        if after_cell is not None:
            after_cell(rows, planned)

    for batch in batches:
        oom_at = None
        for length in sorted(lengths):
            if max_tokens is not None and batch * length > max_tokens:
                add({"batch": batch, "length": length,
                     "skipped": f"{batch} x {length} = {batch * length} tokens > --max-tokens {max_tokens}"})
                continue
            if limit is not None and length + warmup + decode_steps > limit:
                add({"batch": batch, "length": length, "skipped": f"{length} + {warmup + decode_steps} "
                     f"decoded tokens > the model's {limit} positions"})
                continue
            if oom_at is not None:
                add({"batch": batch, "length": length, "skipped": f"out of memory at length {oom_at}"})
                continue
            if progress:
                print(f"batch {batch}, length {length} ...", flush=True)
            try:
                row = _measure_cell(models, batch, length, repeats=repeats, decode_steps=decode_steps,
                                    warmup=warmup, vocab=vocab, meter=meter)
            except Exception as err:  # noqa: BLE001 - a failed cell becomes a row, the grid goes on
                first = (str(err).splitlines() or [type(err).__name__])[0][:200]
                row = {"batch": batch, "length": length, "error": f"{type(err).__name__}: {first}"}
                if is_oom(err):
                    oom_at = length
            gc.collect()
            add(row)
    return rows


# ----------------------------------------------------------------------------------------------- reporting


def size(b) -> str:
    """Bytes for a reader: '512 B', '3.2 KiB', '41.0 MiB', '1.25 GiB' ('n/a' for None)."""
    if b is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{b} B"


def _x(r) -> str:
    return "-" if r is None else f"{r:.2f}x"


# the two tables of ``markdown``: (title, time column unit, time of a model's row, its formatting, the ratio of the
# times, the memory column, the memory of a model's row, the ratio of the memories)
TABLES = (
    ("Prefill (best of the repeats; peak memory above what was held before):", "s", "prefill_best_s", ".3f",
     "prefill_speedup", "peak", "peak_bytes", "peak_memory_ratio"),
    ("Decode after the prompt (median ms per step: one token of every row; cache bytes right after the prompt, "
     "measured):", "ms/step", "decode_median_ms", ".2f", "decode_speedup", "cache", "cache_bytes", "cache_ratio"),
)


def markdown(rows: list[dict]) -> str:
    """The prefill and decode tables of ``compare``'s rows, then the cells not measured."""
    done = [r for r in rows if "base" in r]
    lines = []
    for title, unit, time_key, fmt, speedup, memory, memory_key, ratio in TABLES:
        lines += ["" if lines else None, title, "",
                  f"| batch | length | base ({unit}) | retrofit ({unit}) | base / retrofit time | base {memory} | "
                  f"retrofit {memory} | retrofit / base {memory} |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in done:
            b, p = r["base"], r["retrofit"]
            lines.append(f"| {r['batch']} | {r['length']} | {b[time_key]:{fmt}} | {p[time_key]:{fmt}} | "
                         f"{_x(r[speedup])} | {size(b[memory_key])} | {size(p[memory_key])} | {_x(r[ratio])} |")
    lines = [line for line in lines if line is not None]
    off = [r for r in done if any(r[n][f"cache_bytes{when}"] != r[n][f"cache_bytes{when}_formula"]
                                  for n in NAMES for when in ("", "_decoding"))]
    if off:
        lines += ["", "Cache bytes differing from decode_memory's formula (a bug to report): " + ", ".join(
            f"batch {r['batch']} length {r['length']}" for r in off)]
    missing = [r for r in rows if "base" not in r]
    if missing:
        lines += ["", "Not measured:"] + [
            f"- batch {r['batch']}, length {r['length']}: "
            + (f"skipped ({r['skipped']})" if "skipped" in r else f"error ({r['error']})") for r in missing]
    return "\n".join(lines)


def memory_table(model, base, lengths=(4096, 16384, 32768)) -> tuple[str, dict]:
    """Decode memory as a user reads it (one sequence, from the configs: ``decode_memory``): bytes per token and the
    whole cache at ``lengths``, retrofit and base; (markdown, the same as a dict)."""
    from .integration.cache import decode_memory

    mine, theirs = decode_memory(model, lengths), decode_memory(base, lengths)
    head = " | ".join(f"cache at {n // 1024}k" if n % 1024 == 0 else f"cache at {n}" for n in lengths)
    lines = ["Decode memory of one sequence, from the configs (hf_polyattn.decode_memory):", "",
             f"| model | grows per token | {head} |", "|---|---:|" + "---:|" * len(lengths)]
    for label, mem in (("retrofit (PolyAttnCache)", mine), ("base (DynamicCache)", theirs)):
        cells = " | ".join(size(b) for b in mem.total)
        lines.append(f"| {label} | {size(mem.per_token)} | {cells} |")
    cells = " | ".join(_x(m / t if t else None) for m, t in zip(mine.total, theirs.total))
    lines.append(f"| retrofit / base | {_x(mine.per_token / theirs.per_token if theirs.per_token else None)} | "
                 f"{cells} |")
    data = {"lengths": list(lengths), "retrofit": {"per_token": mine.per_token, "total": list(mine.total)},
            "base": {"per_token": theirs.per_token, "total": list(theirs.total)}}
    return "\n".join(lines), data


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Time, memory and the ratios against the prompt length, per batch and model (log-log); False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [("prefill (s)", lambda m: m["prefill_best_s"]), ("decode (ms / step)", lambda m: m["decode_median_ms"]),
              ("prefill peak memory (MiB)", lambda m: None if m["peak_bytes"] is None else m["peak_bytes"] / 2**20),
              ("cache after the prompt (MiB)", lambda m: m["cache_bytes"] / 2**20)]
    colours = {"base": "tab:blue", "retrofit": "tab:orange"}
    done = [r for r in rows if "base" in r]
    batches = sorted({r["batch"] for r in done})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 5, figsize=(21, 4))
    for ax, (label, get) in zip(axes, panels):
        for i, batch in enumerate(batches):
            for name in NAMES:
                pts = [(r["length"], get(r[name])) for r in done if r["batch"] == batch]
                pts = [(n, v) for n, v in pts if v is not None and v > 0]
                if pts:
                    ax.loglog([n for n, _ in pts], [v for _, v in pts], "o" + styles[i % 4], color=colours[name],
                              label=f"{name}, batch {batch}")
        ax.set(xlabel="prompt length (tokens)", title=label)
    ax = axes[4]
    for i, batch in enumerate(batches):
        for key, colour in (("prefill_speedup", "tab:green"), ("decode_speedup", "tab:red")):
            pts = [(r["length"], r[key]) for r in done if r["batch"] == batch and r[key]]
            if pts:
                ax.semilogx([n for n, _ in pts], [v for _, v in pts], "o" + styles[i % 4], color=colour,
                            label=f"{key.split('_')[0]}, batch {batch}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="prompt length (tokens)", title="base time / retrofit time (> 1: retrofit faster)")
    axes[0].legend(fontsize=7)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The whole-model options of ``hf-polyattn bench`` (an argument group)."""
    cpu, cuda = DEFAULTS["cpu"], DEFAULTS["cuda"]
    g = p.add_argument_group("whole model (--model)", textwrap.fill(
        "A retrofitted checkpoint against its softmax base, both loaded in this process and run interleaved "
        "(hf_polyattn/bench_model.py). --lengths, --dtype, --repeats (prefill repeats), --threads, --device, --out "
        f"and --quick apply too, with their own defaults: lengths {cpu['lengths']} on CPU, {cuda['lengths']} on "
        f"CUDA; repeats {cpu['repeats']} / {cuda['repeats']}; out {DEFAULT_OUT}/; --quick: lengths "
        f"{QUICK['lengths']}, batch 1, one repeat.", 100))
    g.add_argument("--model", metavar="DIR", help="the retrofitted checkpoint folder (written by convert / retrofit: "
                                                  "its config.json records polyattn settings)")
    g.add_argument("--base", metavar="DIR", help="the softmax checkpoint folder it came from (default: --model's own "
                                                 "weights with softmax attention, sdpa)")
    g.add_argument("--batches", type=int_items(1), nargs="+", metavar="B",
                   help=f"batch sizes (default: {cpu['batches']})")
    for flag in ("--decode-steps", "--decode_steps"):
        g.add_argument(flag, dest="decode_steps", type=int_at_least(1),
                       help=argparse.SUPPRESS if "_" in flag else
                       f"timed decode steps per cell, the median counts (default: {cpu['decode_steps']} on CPU, "
                       f"{cuda['decode_steps']} on CUDA)")
    g.add_argument("--warmup", type=int_at_least(0),
                   help=f"untimed decode steps before the timed ones (default: {cpu['warmup']} on CPU, "
                        f"{cuda['warmup']} on CUDA)")
    for flag in ("--compile-decode", "--compile_decode"):
        g.add_argument(flag, dest="compile_decode", action="store_true", default=None,
                       help=argparse.SUPPRESS if "_" in flag else
                       "decode the retrofit's windowed kernel heads with torch.compile (hf_polyattn.compile_decode); "
                       "the warm-up steps absorb the compiling")
    for flag in ("--capture-decode", "--capture_decode"):
        g.add_argument(flag, dest="capture_decode", action="store_true", default=None,
                       help=argparse.SUPPRESS if "_" in flag else
                       "decode the retrofit from CUDA graphs (hf_polyattn.capture_decode; --device cuda, --warmup "
                       f">= {GRAPH_WARMUP}): the timed steps replay a recorded step; the table states how many did")
    for flag in ("--max-tokens", "--max_tokens"):
        g.add_argument(flag, dest="max_tokens", type=int_at_least(1),
                       help=argparse.SUPPRESS if "_" in flag else
                       f"skip the cells whose batch x length exceeds this, listed as skipped (default: "
                       f"{cpu['max_tokens']} on CPU: batch 8 runs to 4k tokens, not 16k; {cuda['max_tokens']} on "
                       "CUDA)")


def _checkpoint_dir(parser, option: str, path: str) -> Path:
    from .checkpoints import GEMMA3_ALIASES, MINILM_ALIASES, SMOLLM2_ALIASES, CheckpointError, resolve_checkpoint

    folder = Path(path)
    if not folder.is_dir() and path.lower() in (*SMOLLM2_ALIASES, *MINILM_ALIASES, *GEMMA3_ALIASES):
        try:  # a packaged checkpoint's name, as the other commands take it (--base smollm2)
            folder = Path(resolve_checkpoint(path))
        except CheckpointError as err:
            parser.error(f"{option} {path!r}: {err}")
    if not folder.is_dir():
        parser.error(f"{option} {path!r}: not a folder (pass a checkpoint folder with config.json, or 'smollm2' / "
                     "'minilm' / 'gemma3', the packaged checkpoints)")
    if not (folder / "config.json").is_file():
        parser.error(f"{option} {path!r}: no config.json in it (not a transformers checkpoint folder)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        parser.error(f"{option} {path!r}: cannot read its config.json ({err})")
    has_polyattn = isinstance(config.get("polyattn"), dict)
    if option == "--model" and not has_polyattn:
        parser.error(f"--model {path!r}: its config.json records no polyattn settings, so it is not a retrofitted "
                     "model (write one with `hf-polyattn convert` or the retrofit recipe; a softmax checkpoint goes "
                     "to --base)")
    if option == "--base" and has_polyattn:
        parser.error(f"--base {path!r}: its config.json records polyattn settings: pass the softmax checkpoint it "
                     "came from, or leave --base out to run --model's weights with softmax attention")
    return folder


def resolve(parser, args) -> argparse.Namespace:
    """Check the whole-model options and fill their defaults in place (usage errors through ``parser``)."""
    args.batches = flat(args.batches)
    if not args.model:
        given = [f"--{name.replace('_', '-')}" for name in MODEL_ONLY if getattr(args, name, None) is not None]
        if given:
            parser.error(f"{', '.join(given)}: options of the whole-model benchmark, which needs --model DIR")
        return args
    given = [f"--{name.replace('_', '-')}" for name in KERNEL_ONLY if getattr(args, name, None) not in (None, False)]
    if given:
        parser.error(f"{', '.join(given)}: options of the attention-kernel benchmark (without --model); the "
                     "whole-model benchmark runs the models' own attention")
    args.lengths = flat(args.lengths)
    args.compile_decode = bool(args.compile_decode)
    args.capture_decode = bool(args.capture_decode)
    if args.capture_decode and args.device != "cuda":
        parser.error(f"--capture-decode records CUDA graphs: it needs --device cuda, got --device {args.device}")
    args.model = _checkpoint_dir(parser, "--model", args.model)
    if args.base is not None:
        args.base = _checkpoint_dir(parser, "--base", args.base)
    d = DEFAULTS[args.device]
    quick = QUICK if args.quick else {}
    for name in ("lengths", "batches", "repeats", "decode_steps", "warmup"):
        if getattr(args, name) is None:
            setattr(args, name, quick.get(name, d[name]))
    args.dtype = args.dtype or d["dtype"]
    args.max_tokens = args.max_tokens or d["max_tokens"]
    args.out = DEFAULT_OUT if args.out is None else args.out
    if args.capture_decode and args.warmup < GRAPH_WARMUP:
        parser.error(f"--capture-decode needs --warmup >= {GRAPH_WARMUP} (got {args.warmup}): the first decoding "
                     "steps of a cache run eagerly before a recorded one replays")
    return args


def load_pair(args):
    """(retrofit, base, base label) loaded in ``args.dtype`` on ``args.device``, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from . import register

    register()  # the kinds, before the retrofit's config is read
    dtype = getattr(torch, DTYPES[args.dtype])

    def load(path, **kw):
        try:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(args.device).eval()
        except (OSError, ValueError, KeyError) as err:
            args._parser.error(f"{'--base' if path == args.base else '--model'} {str(path)!r}: cannot load it as a "
                               f"causal LM: {(str(err).splitlines() or [type(err).__name__])[0]}")

    model = load(args.model)
    if args.compile_decode:
        from .integration import compile_decode

        compile_decode(model)
    args.graphs = None
    if args.capture_decode:
        from .integration import capture_decode

        # room in the softmax heads' buffers for the longest prompt and every step after it (warm-up ones too)
        longest = max(max(args.lengths), WARMUP_TOKENS)
        args.graphs = capture_decode(model, max_length=longest + max(args.warmup, WARMUP_STEPS) + args.decode_steps + 1)
    if args.base is None:
        base, label = load(args.model, attn_implementation="sdpa"), (
            f"{args.model} with softmax attention (sdpa; its polyattn settings ignored)")
    else:
        base, label = load(args.base, attn_implementation="sdpa"), f"{args.base} (sdpa)"
    return model, base, label


def _graph_note(graphs) -> str:
    """How the retrofit's decoding calls ran under --capture-decode (every call so far, warm-up ones included)."""
    if graphs is None:
        return ""
    c = graphs.counts
    return (f" (the retrofit from CUDA graphs, --capture-decode: {c['replayed']} calls replayed, {c['recorded']} "
            f"graphs recorded, {c['static']} static steps run eagerly, {c['eager']} eager calls, prefills included; "
            f"while decoding from graphs the softmax heads' buffers hold max_length = {graphs.max_length} positions)")


def describe_load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def run(args, *, command: str) -> int:
    """The whole-model benchmark for ``resolve``d ``args``: load, measure, write the files (after every row: the
    module docstring)."""
    import torch

    from .machine import cpu_snapshot, others_between

    torch.set_num_threads(args.threads)
    where = bench_common.machine(args)
    info = bench_common.machine_info(args)
    model, base, base_label = load_pair(args)
    from .integration.state import get_polyattn_config

    cfg = get_polyattn_config(model)
    label = cfg.spec.table_label(cfg)  # names the softmax kv heads too
    mem_text, mem_data = memory_table(model, base)
    tag = (f"{args.device}-{args.dtype}" + ("-quick" if args.quick else "")
           + ("-compiled" if args.compile_decode else "") + ("-graphs" if args.capture_decode else ""))
    settings = {k: getattr(args, k) for k in ("device", "dtype", "threads", "lengths", "batches", "repeats",
                                              "decode_steps", "warmup", "max_tokens", "compile_decode",
                                              "capture_decode")}
    settings.update(model=str(args.model), base=str(args.base) if args.base else None, base_label=base_label,
                    polyattn=cfg.to_dict(), warmup_prefill_tokens=WARMUP_TOKENS, warmup_decode_steps=WARMUP_STEPS)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before, snap = describe_load(), cpu_snapshot()
    written = [0]

    def write(rows: list[dict], planned: int) -> None:
        """The .md and .json of the rows so far (the load and the other processes up to now); the .png once
        complete: drawing it takes 1-2 s of this process's CPU (and heap) between timed cells, so only at the end."""
        fields, note = bench_common.completion(len(rows), planned)
        others = others_between(snap, cpu_snapshot())
        load_after, wall = describe_load(), others["wall_s"]
        busiest = [(n, s) for n, s in others["busiest"] if s >= 0.05 * wall]  # 5% of a core or more
        others_text = (f"other processes used {others['cpu_s']:.0f} CPU s during the {wall:.0f} s run "
                       f"({others['cores']:.2f} of {os.cpu_count()} cores on average, from {others['source']}); "
                       "busiest visible here: "
                       + (", ".join(f"{n} {s:.0f} s" for n, s in busiest) or "none above 5% of a core"))
        header = [
            f"Machine: {where}",
            f"Load average before: {load_before}; after: {load_after}; {others_text}",
            f"Retrofit: {args.model}: {label}. Base: {base_label}.",
            f"{args.dtype}, {args.threads} threads; prefill best of {args.repeats} (repeats alternate the models); "
            f"decode median of {args.decode_steps} steps after {args.warmup} untimed, steps alternating the models"
            f"{' (the retrofit compiled: --compile-decode)' if args.compile_decode else ''}"
            f"{_graph_note(args.graphs)}; "
            f"warm-up: a {WARMUP_TOKENS}-token prefill and {WARMUP_STEPS} decode steps per model before the first "
            f"cell; cells with batch x length > {args.max_tokens} skipped; peak memory: "
            f"{rows[0]['memory_method'] if rows else '-'}.",
        ]
        text = "\n".join(header) + "\n\n" + markdown(rows) + "\n\n" + mem_text
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        bench_common.write_atomic(args.out / f"{tag}.md", f"Run {stamp}: `{command}`\n\n"
                           + (f"{note}\n\n" if note else "") + f"{text}\n")
        bench_common.write_atomic(args.out / f"{tag}.json", json.dumps(
            {"date": stamp, "command": command, "machine": where, "machine_info": info,
             "decode_graphs": None if args.graphs is None else dict(args.graphs.counts),
             "load_before": load_before, "load_after": load_after, "wall_s": wall, "other_processes": others,
             "settings": settings, **fields, "rows": rows,
             "decode_memory": mem_data}, indent=1, default=str))
        written[0] = len(rows)
        if note is not None:
            # a plot of an earlier run of this name would sit beside this run's table as if it were its own
            (args.out / f"{tag}.png").unlink(missing_ok=True)
            return
        print(text)
        drew = plot(rows, args.out / f"{tag}.png", f"{label}\n{where}")
        print(f"wrote {args.out}/{tag}.md, .json" + (", .png" if drew else " (matplotlib not installed: no plot)"))

    try:
        with bench_common.sigterm_exits():
            compare(model, base, args.lengths, batches=args.batches, decode_steps=args.decode_steps,
                           warmup=args.warmup, repeats=args.repeats, max_tokens=args.max_tokens, progress=True,
                           after_cell=write)
    except BaseException:  # noqa: BLE001 - Ctrl-C, SIGTERM, a failure: say what was kept, then re-raise
        if written[0]:
            print(bench_common.kept(written[0], len(args.batches) * len(args.lengths), args.out / f"{tag}.md"),
                  file=sys.stderr)
        raise
    return 0
