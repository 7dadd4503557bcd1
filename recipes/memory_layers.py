"""Peak memory of one bf16 attention layer's causal forward + backward against SDPA, counted by tensor storages.

Issue 11's memory target: a layer at most 2x SDPA's (FlashAttention's) peak. Every layer of
``recipes/live_memory.py``'s ``LAYERS`` is built as a bf16 model builds it (``module.to(bfloat16)``) on the
``triton`` backend and run on bf16 q, k, v (B=1, H heads, d=64) under ``PeakLive``, which adds up the live
storages made inside (inputs and weights excluded, gradients included): a lower bound on any allocator's peak,
the same on every device. Without a GPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
here before triton is imported): slow (minutes per layer at n = 2048) but the same tensors. SDPA
(``scaled_dot_product_attention``, is_causal=True, same inputs) is counted in the same run.

The unit is one bf16 tensor shaped like the query (B H n d 2 bytes). The Triton causal product keeps one F x 64
fp32 state per chunk of T >= F rows (``ops/triton/causal.STATE_CHUNK_RULE``; F = 528 at r = 32, T = 1024 with
block 256, F rounded up to a power of two with the diagonal): 2 F / T, about 1 unit, at most n / T - 1 of them, so
their share is about the same at every n; run two lengths to see how the units move.

    python recipes/memory_layers.py                                   # n = 1024 2048, every layer
    python recipes/memory_layers.py --lengths 1024 --layers sdpa polysketch --top 20
    python recipes/memory_layers.py --device cuda --heads 16 --lengths 8192 32768   # GPU: + the allocator's peak
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton


from live_memory import LAYERS, attention_peak, layer_config  # noqa: E402  (recipes/live_memory.py)

from hf_polyattn import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def measure(name: str, n: int, heads: int, top: int, device: str) -> dict:
    start = time.perf_counter()
    tracker, unit = attention_peak(layer_config(name), n, heads, 64, torch.bfloat16, top=top, device=device)
    return {"layer": name, "n": n, "heads": heads, "peak_bytes": tracker.peak, "unit_bytes": unit,
            "units": tracker.peak / unit, "device_peak_bytes": tracker.device_peak,
            "seconds": time.perf_counter() - start,
            "at_peak": [dict(units=a.nbytes / unit, op=a.op, shape=list(a.shape), dtype=str(a.dtype), where=a.where)
                        for a in tracker.at_peak]}


def table(rows: list[dict]) -> str:
    sdpa = {r["n"]: r["units"] for r in rows if r["layer"] == "sdpa"}
    lines = ["| layer | n | H | peak (MiB) | peak (bf16 query units) | / SDPA |", "|---|---|---|---|---|---|"]
    allocator = any(r["device_peak_bytes"] is not None for r in rows)
    if allocator:  # CUDA: the allocator's peak next to the count
        lines = [lines[0] + " allocator peak (MiB) |", lines[1] + "---|"]
    for r in rows:
        ratio = f"{r['units'] / sdpa[r['n']]:.2f}" if r["n"] in sdpa else "-"
        lines.append(f"| {r['layer']} | {r['n']} | {r['heads']} | {r['peak_bytes'] / 2**20:.1f} | {r['units']:.2f} "
                     f"| {ratio} |" + (f" {r['device_peak_bytes'] / 2**20:.1f} |" if allocator else ""))
    return "\n".join(lines)


def breakdown(r: dict) -> str:
    lines = [f"{r['layer']} n={r['n']}: the largest live storages at the peak ({r['units']:.2f} units)"]
    for a in r["at_peak"]:
        lines.append(f"  {a['units']:6.2f}  {a['op']:<48} {str(tuple(a['shape'])):<26} {a['dtype']:<15} {a['where']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="memory_layers.py")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="sequence lengths n (default: "
                   "%(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads H (default: %(default)s)")
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS),
                   help="rows to measure (default: all)")
    p.add_argument("--top", type=int, default=12, help="live storages listed per row at its peak (default: "
                   "%(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device of the tensors (default: %(default)s; CPU runs the kernels in Triton's interpreter)")
    p.add_argument("--out", default=str(RESULTS / "memory_layers"), help="output folder, '' for none (default: "
                   "%(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = []
    for n in args.lengths:
        for name in args.layers:
            rows.append(measure(name, n, args.heads, args.top, args.device))
            print(f"{name} n={n}: {rows[-1]['units']:.2f} units ({rows[-1]['seconds']:.0f} s)", file=sys.stderr)
    details = "\n\n".join(breakdown(r) for r in rows if r["at_peak"])
    text = table(rows) + (f"\n\n```\n{details}\n```" if details else "")
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        command = "python recipes/memory_layers.py " + " ".join(argv if argv is not None else sys.argv[1:])
        device = torch.device(args.device).type
        where = "CUDA" if device == "cuda" else "CPU, Triton interpreter"
        info = machine.record(device)
        gpu = f", {info['gpu']}" if info["gpu"] else ""
        head = (f"Run {info['date']}: `{command.strip()}`\n\nMachine: {info['cpu']}, {info['cpus']} CPUs{gpu}, torch "
                f"{info['torch']} ({where}); bf16, B=1, d=64, causal forward+backward, backend='triton'; counted "
                "live storages (PeakLive), not allocator bytes.\n\n")
        (out / f"{device}-bf16.md").write_text(head + text + "\n")
        record = {"machine": info, "command": command, "rows": rows}
        (out / f"{device}-bf16.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
