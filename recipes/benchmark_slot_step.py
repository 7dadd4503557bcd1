"""The decoding step of steady rings (``hf_polyattn.ops.slot_step``) a call at a time: the eager PyTorch step, the
compiled one and the native CPU kernel (``ops/cpu/slot_step.c``), on the demo's layer (3 kv heads, 3 queries a head,
head dim 64, window 128, 4 sinks, gated decay, projection to 64, q/k LayerNorm, window mix, the sinks' query turned
by RoPE), one entry of a state layer of 16 entries and 300 slots laid out as vLLM lays them out.

    python recipes/benchmark_slot_step.py    # writes recipes/results/benchmark_slot_step/cpu-2threads.json

Per batch (1 and 16 sequences): microseconds a call, the best of 5 runs of 30 calls after a warm-up, and each step's
ratio to the eager one, all in one process. The compiled step's first call compiles (tens of seconds on a 2-core
CPU), outside the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from functools import partial
from pathlib import Path

import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import build_attention
from hf_polyattn.ops.cpu_kernels import kernel_error, run_slot_step_native, slot_step_kernel
from hf_polyattn.ops.packed import RingLayout
from hf_polyattn.ops.rotary import RopeRotation
from hf_polyattn.ops.slot_step import compiled_slot_step, run_slot_step, slot_buffers, slot_plan, slot_state, slot_step

RESULTS = Path(__file__).resolve().parent / "results"
D, HEADS, GROUPS, WINDOW, SINKS, ENTRIES, SLOTS = 64, 3, 3, 128, 4, 16, 300


def _time(fn, repeats: int = 5, calls: int = 30) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "benchmark_slot_step"),
                   help="the folder the JSON result goes to, as cpu-<threads>threads.json ('' = none) "
                        "(default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = PolyAttnConfig(kind="linear", feature_map="elu", window=WINDOW, sinks=SINKS, decay="gate", window_mix=True,
                         window_mix_init=0.01, qk_norm=True, feature_proj=D)
    module = build_attention(cfg, HEADS * GROUPS, D, HEADS, 0).eval()
    module.rope = RopeRotation(1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), D)
    layout = RingLayout(heads=HEADS, features=module.num_features, head_dim=D, window=WINDOW, sinks=SINKS, decay=True)
    _, buffers = slot_buffers(layout, SLOTS, ENTRIES)
    buffers[5][:, :, 0] = 5000  # the sinks' query turned as at 5,000 tokens
    state, offsets = slot_state(buffers)
    plan = slot_plan(module, torch.float32, torch.device("cpu"), D ** -0.5)
    dims, sub = (ENTRIES, HEADS, module.num_features, D, True), 5
    native = slot_step_kernel()
    rows = {}
    with torch.inference_mode():
        for batch in (1, 16):
            q, k, v = torch.randn(batch, HEADS, GROUPS, D), torch.randn(batch, HEADS, D), torch.randn(batch, HEADS, D)
            slots = torch.randperm(SLOTS)[:batch]
            sub_t = torch.tensor([sub])
            step = (q, k, v, slots, sub_t, state, plan, offsets, dims)
            row = {"eager_us": _time(partial(run_slot_step, slot_step, *step)),
                   "compiled_us": _time(partial(run_slot_step, compiled_slot_step(), *step))}
            if native is not None:
                row["native_us"] = _time(partial(run_slot_step_native, native, q, k, v, slots, sub, state, plan,
                                                 torch.tensor(offsets), dims))
            row.update({f"{name}_speedup": row["eager_us"] / row[f"{name}_us"] for name in ("compiled", "native")
                        if f"{name}_us" in row})
            rows[str(batch)] = row
    result = {"command": " ".join(["python recipes/benchmark_slot_step.py", *(argv or [])]),
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__, "load": os.getloadavg()},
              "native": native is not None, "native_error": kernel_error(), "rows": rows}
    text = json.dumps(result, indent=2)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"cpu-{args.threads}threads.json").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
