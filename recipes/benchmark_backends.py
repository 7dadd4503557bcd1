"""Which causal-product backend is faster on this device: ``loop`` vs ``batched`` (vs ``triton`` on CUDA).

One attention layer (B=1, H heads, d=64), causal forward+backward, best of ``--repeats``, every
backend timed in the same run at each n; the table gives ms and the ratio to ``loop``. This is
the measurement behind ``backend='auto'`` (hf_polyattn/ops/backend.py).

    python recipes/benchmark_backends.py                       # CPU, fp32, n = 1k..16k
    python recipes/benchmark_backends.py --device cuda --dtype bf16 --lengths 2048 8192 32768 65536
    python recipes/benchmark_backends.py --set decay            # the long-context settings: decayed products
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from hf_polyattn import PolyAttnConfig, machine
from hf_polyattn.ops import PolyAttention
from hf_polyattn.ops.backend import ENV_VAR, triton_available

RESULTS = Path(__file__).resolve().parent / "results"

KINDS = {
    "polysketch-local": dict(kind="polysketch", sketch="learned", local_exact=True),
    "polysketch": dict(kind="polysketch"),
    "linear": dict(kind="linear"),
}
# the long-context preset's settings (hf_polyattn/presets.py: a 128-token window, sinks, window_mix, the
# projection to d + qk LayerNorm): every product in them is decayed, the case 'auto' sends to 'batched' on the CPU
LONG_CONTEXT = dict(window=128, sinks=4, window_mix=True, window_mix_init=0.01, qk_norm=True, feature_proj=64,
                    block_size=64)
KINDS_DECAY = {
    "polysketch-r16-gate": dict(kind="polysketch", sketch="learned", sketch_size=16, decay="gate",
                                decay_horizon=256.0, **LONG_CONTEXT),
    "linear-gate": dict(kind="linear", decay="gate", **LONG_CONTEXT),
    "linear-scalar": dict(kind="linear", decay="scalar", **LONG_CONTEXT),
}
SETS = {"plain": KINDS, "decay": KINDS_DECAY}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def time_one(pa, n, heads, dtype, device, repeats) -> float:
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 64, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up (allocator, Triton compile)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        pa(qs, ks, vs, causal=True).float().square().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="benchmark_backends.py",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="torch device to time on")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="input dtype (default fp32 on CPU, bf16 else)")
    p.add_argument("--heads", type=int, default=4, help="attention heads H")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384], help="sequence lengths n")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (best is kept)")
    p.add_argument("--set", default="plain", choices=list(SETS),
                   help="'plain': the kinds' defaults; 'decay': the long-context settings (window, sinks, decay)")
    p.add_argument("--out", default=str(RESULTS / "benchmark_backends"), help="output folder (default: %(default)s)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("fp32" if device.type == "cpu" else "bf16")
    dtype = DTYPES[dtype_name]
    backends = ["loop", "batched"] + (["triton"] if device.type == "cuda" and triton_available() else [])
    rows = []
    for label, opts in SETS[args.set].items():
        pa = PolyAttention(PolyAttnConfig(**opts), args.heads, 64).to(device)
        for n in args.lengths:
            times = {}
            for b in backends:
                os.environ[ENV_VAR] = b
                times[b] = time_one(pa, n, args.heads, dtype, device, args.repeats)
            os.environ.pop(ENV_VAR, None)
            rows.append({"kind": label, "n": n, "ms": {b: round(t * 1e3, 2) for b, t in times.items()},
                         "ratio_to_loop": {b: round(t / times["loop"], 3) for b, t in times.items()}})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{device.type}-{dtype_name}" + ("" if args.set == "plain" else f"-{args.set}")
    info = machine.record(device.type)
    (out / f"{tag}.json").write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=1))
    lines = [f"# Causal backends, forward+backward, B=1, H={args.heads}, d=64, {dtype_name}, best of {args.repeats}",
             "", "Settings: " + "; ".join(f"{k}: {v}" for k, v in SETS[args.set].items()), "",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), "",
             "A ratio > 1: that backend took longer than the loop.", "",
             "Generated by `python recipes/benchmark_backends.py "
             + " ".join(argv if argv is not None else sys.argv[1:]) + "`.", "",
             "| kind | n | " + " | ".join(f"{b} ms" for b in backends) + " | "
             + " | ".join(f"{b} time / loop time" for b in backends[1:]) + " |",
             "|---|---|" + "---|" * (2 * len(backends) - 1)]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['n']} | " + " | ".join(f"{r['ms'][b]:.1f}" for b in backends) + " | "
                     + " | ".join(f"{r['ratio_to_loop'][b]:.2f}x" for b in backends[1:]) + " |")
    (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / (tag + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
