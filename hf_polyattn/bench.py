"""Causal attention speed and memory: every kind against SDPA, measured in the same run.

    hf-polyattn bench                  # = python recipes/benchmark_attention.py
    hf-polyattn bench --quick          # n = 1k, 2k, one repeat (a minute)
    hf-polyattn bench --device cuda    # bf16 on a GPU, against SDPA's flash path

Defaults: n = 1k..32k, B=1, H=4, d=64, fp32, 2 threads.

Each (kind, n) runs in its own subprocess so its peak memory can be read cleanly: on CPU the
peak resident set (ru_maxrss) minus the resident set just before the timed forward+backward,
on CUDA torch.cuda.max_memory_allocated. Time = best of ``--repeats`` forward+backward passes
after one warm-up. Ratios (SDPA time / kind time, kind memory / SDPA memory) are taken within
this run only: machines are noisy, never compare against numbers from another run.

Also printed: the achieved GFLOP/s of the polysketch path (an analytic count of its matmul
flops, forward + backward, divided by its time) next to torch.mm's GFLOP/s on 2048^2
matrices measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

KINDS = {
    "sdpa": None,
    "polysketch-local": dict(kind="polysketch", sketch_size=32, local_exact=True, block_size=256),
    "polysketch": dict(kind="polysketch", sketch_size=32, block_size=256),
    "linear-elu": dict(kind="linear", feature_map="elu", block_size=256),
    "performer": dict(kind="performer", num_features=256, block_size=256),
    "polysketch-cumsum": dict(kind="polysketch", sketch_size=32, causal_algorithm="cumsum"),
    "polynomial-exact": dict(kind="polynomial", degree=4, exact_path="quadratic"),
}
# per-token cumsum stores n x F x (d+1) for autograd, the exact polynomial is O(n^2): cap them
MAX_LEN = {"polysketch-cumsum": 4096, "polynomial-exact": 8192}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def polysketch_flops(n: int, heads: int, d: int, r: int, block: int, local: bool) -> float:
    """Matmul flops of the polysketch causal path, forward + backward (see ops/causal.py).

    Per token and head with F = r(r+1)/2 features and e = d+1 value columns: forward = state
    update + query read (2 x 2Fe); backward = state recompute + dA + suffix + dB + dC (5 x 2Fe);
    local exact blocks: scores 2bd + weights x values 2be, three times over (forward, backward);
    the degree-2 sketch: 2 factors x 2dr for q and k, three times over.
    """
    feats = r * (r + 1) // 2
    e = d + 1
    per_token = 7 * 2 * feats * e + 3 * 2 * 2 * d * r * 2
    per_token += 3 * (2 * block * d + 2 * block * e) if local else 3 * (2 * block * feats + 2 * block * e)
    return float(per_token * n * heads)


def worker(kind: str, n: int, args) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, args.heads, n, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(dev, dtype).requires_grad_() for _ in range(3))
    if kind == "sdpa":
        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    else:
        from hf_polyattn import PolyAttnConfig
        from hf_polyattn.ops import PolyAttention

        mod = PolyAttention(PolyAttnConfig(**KINDS[kind]), args.heads, args.head_dim).to(dev)

        def step():
            mod(q, k, v, causal=True).sum().backward()

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
    dtype = torch.float32 if args.dtype == "fp32" else {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    x = torch.randn(2048, 2048, device=dev, dtype=dtype)
    torch.mm(x, x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(x, x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best / 1e9


def machine(args) -> str:
    if args.device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name()} ({args.dtype})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"CPU {cpu}, {os.cpu_count()} cores, {args.threads} threads ({args.dtype}); load average at start "
            f"{os.getloadavg()[0]:.1f}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--out", type=Path, default=Path("recipes/results/benchmark_attention"))
    p.add_argument("--quick", action="store_true", help="n = 1k, 2k and one repeat (a smoke run)")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args)))
        return 0
    if args.quick:
        args.lengths, args.repeats = [1024, 2048], 1
    if "sdpa" not in args.kinds:
        args.kinds = ["sdpa", *args.kinds]
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    common = ["--heads", str(args.heads), "--head-dim", str(args.head_dim), "--threads", str(args.threads),
              "--repeats", str(args.repeats), "--device", args.device, "--dtype", args.dtype]
    where = machine(args)  # read the load average before the runs add to it
    gflops_mm = mm_gflops(args)
    rows = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **_):
            return x
    jobs = [(n, kind) for n in args.lengths for kind in args.kinds if n <= MAX_LEN.get(kind, n)]
    for n, kind in tqdm(jobs, desc="benchmark", unit="run"):
        res = subprocess.run([sys.executable, "-m", "hf_polyattn.bench", "--worker", kind, str(n), *common], env=env,
                             capture_output=True, text=True)
        if res.returncode != 0:
            rows.append({"kind": kind, "n": n, "error": res.stderr.strip().splitlines()[-1][:200]})
            continue
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    by = {(r["kind"], r["n"]): r for r in rows}
    lines = [f"Machine: {where}; B=1, H={args.heads}, d={args.head_dim}; causal forward+backward; "
             f"best of {args.repeats}; torch.mm 2048^2: {gflops_mm:.1f} GFLOP/s", "",
             "| kind | n | time (s) | SDPA time / time | peak memory (MiB) | memory / SDPA memory |",
             "|---|---|---|---|---|---|"]
    for n in args.lengths:
        base = by.get(("sdpa", n))
        for kind in args.kinds:
            r = by.get((kind, n))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {kind} | {n} | error: {r['error']} | | | |")
                continue
            speed = f"{base['seconds'] / r['seconds']:.2f}x" if base and "seconds" in base else "-"
            mem = (f"{r['peak_bytes'] / max(base['peak_bytes'], 1):.2f}" if base and "peak_bytes" in base else "-")
            lines.append(f"| {kind} | {n} | {r['seconds']:.3f} | {speed} | {r['peak_bytes'] / 2**20:.0f} | {mem} |")
    lines.append("")
    for n in args.lengths:
        r = by.get(("polysketch-local", n))
        if r and "seconds" in r:
            fl = polysketch_flops(n, args.heads, args.head_dim, 32, 256, True)
            lines.append(f"polysketch-local n={n}: {fl / r['seconds'] / 1e9:.1f} GFLOP/s achieved "
                         f"(torch.mm: {gflops_mm:.1f} GFLOP/s)")
    table = "\n".join(lines)
    print(table)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    tag = f"{args.device}-{args.dtype}" + ("-quick" if args.quick else "")
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / f"{tag}.md").write_text(f"Run {stamp}: `python recipes/benchmark_attention.py {cmd}`\n\n{table}\n")
    (args.out / f"{tag}.json").write_text(json.dumps({"machine": where, "date": stamp, "mm_gflops": gflops_mm,
                                                      "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for kind in args.kinds:
            pts = [(n, by[(kind, n)]) for n in args.lengths if "seconds" in by.get((kind, n), {})]
            if pts:
                axes[0].loglog([n for n, _ in pts], [r["seconds"] for _, r in pts], "o-", label=kind)
                axes[1].loglog([n for n, _ in pts], [max(r["peak_bytes"], 1) / 2**20 for _, r in pts], "o-",
                               label=kind)
        axes[0].set(xlabel="context length n", ylabel="forward+backward (s)", title="time")
        axes[1].set(xlabel="context length n", ylabel="peak extra memory (MiB)", title="memory")
        axes[0].legend(fontsize=7)
        fig.suptitle(where, fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out / f"{tag}.png", dpi=110)
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"wrote {args.out}/{tag}.md, .json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
