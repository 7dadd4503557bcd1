"""How fast a retrofit's decoding step can get by changing its attention alone: the step against its base's, and the
step with no attention at all.

    python recipes/decode_floor.py MODEL_DIR --base BASE [--lengths 4096 16384] [--steps 16] [--threads 2]
                                   [--compile-decode] [--unfused] [--out DIR]

Per prompt length, interleaved decoding steps (median of ``--steps`` after 3 untimed, fp32, batch 1) of:

* ``base``: the base checkpoint on SDPA + ``DynamicCache`` (the whole-model bench's base);
* ``retrofit``: the retrofit as it decodes (``PolyAttnCache``);
* ``floor``: the retrofit with every polyattn layer's attention replaced by zeros of its output's shape (its state
  is not touched): what the step costs outside attention (the weights' matmuls, norms, MLP, RoPE, transformers'
  glue). No attention change can make the retrofit's step faster than this, so base / floor is the most any
  attention can give on this machine, and retrofit - floor is what the retrofit's attention costs now;
* with ``--compile-decode``, ``compiled``: the retrofit with the windowed kernel heads' step under ``torch.compile``
  (``hf_polyattn.compile_decode``; its first steps compile: they are timed apart, as ``warm-up``);
* with ``--unfused``, ``unfused``: the retrofit with every layer's ``fused_decode`` off, so one sequence's steps take
  the general ring step (``ops/decode.py`` ``ring_step``) instead of ``fused_step``: what the fused step saves, in
  the same run.

Printed and written to ``--out``/decode_floor.{md,json}`` with the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path


@contextlib.contextmanager
def attention_off(model):
    """Every polyattn layer of ``model`` returns zeros (B, H, Lq, D) and leaves its state as it is."""
    import torch

    from hf_polyattn.integration.state import HFPolyAttention

    layers = [m for m in model.modules() if isinstance(m, HFPolyAttention)]
    if not layers:
        raise ValueError("attention_off: the model has no polyattn layer (is it a retrofit?)")

    def zeros(query, key, value, *, state=None, **kwargs):
        out = torch.zeros_like(query)
        return out if state is None else (out, state)

    for m in layers:
        m.forward = zeros
    try:
        yield
    finally:
        for m in layers:
            del m.forward


@contextlib.contextmanager
def fused_off(model):
    """``model``'s polyattn layers decode with the general ring step (``fused_decode`` False) inside the block."""
    layers = [m for m in model.modules() if getattr(m, "fused_decode", None) is True]
    for m in layers:
        m.fused_decode = False
    try:
        yield
    finally:
        for m in layers:
            m.fused_decode = True


@contextlib.contextmanager
def decode_compiled(model):
    """``model``'s windowed kernel heads decode compiled (``hf_polyattn.compile_decode``) inside the block."""
    import hf_polyattn

    hf_polyattn.compile_decode(model, True)
    try:
        yield
    finally:
        hf_polyattn.compile_decode(model, False)


def measure(models: dict, length: int, steps: int, compile_decode: bool, unfused: bool = False) -> dict:
    """Median ms per decoding step of each variant after a ``length``-token prompt, steps interleaved."""
    import torch

    from hf_polyattn.bench_model import _new_cache, _step, prompt

    base, retrofit = models["base"], models["retrofit"]
    ids = prompt(1, length, retrofit.get_input_embeddings().num_embeddings, torch.device("cpu"))
    variants = {"base": (base, contextlib.nullcontext), "retrofit": (retrofit, contextlib.nullcontext),
                "floor": (retrofit, lambda: attention_off(retrofit))}
    if compile_decode:
        variants["compiled"] = (retrofit, lambda: decode_compiled(retrofit))
    if unfused:
        variants["unfused"] = (retrofit, lambda: fused_off(retrofit))
    state, times, warm = {}, {name: [] for name in variants}, {}
    with torch.no_grad():
        for name, (model, ctx) in variants.items():
            cache = _new_cache("base" if name == "base" else "retrofit", model)
            token = _step(model, ids, cache)
            t0 = time.perf_counter()
            with ctx():
                for _ in range(3):
                    token = _step(model, token, cache)
            warm[name] = time.perf_counter() - t0
            state[name] = (token, cache)
        for _ in range(steps):
            for name, (model, ctx) in variants.items():
                token, cache = state[name]
                with ctx():
                    t = time.perf_counter()
                    token = _step(model, token, cache)
                    times[name].append((time.perf_counter() - t) * 1e3)
                state[name] = (token, cache)
    row = {"length": length, **{f"{k}_ms": statistics.median(v) for k, v in times.items()}}
    if compile_decode:
        row["compiled_warmup_s"] = warm["compiled"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a retrofitted checkpoint folder")
    p.add_argument("--base", required=True, help="its base checkpoint's folder, or 'smollm2' (the packaged one)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile-decode", action="store_true")
    p.add_argument("--unfused", action="store_true", help="also the retrofit on the general ring step (docstring)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "decode_floor")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import hf_polyattn  # noqa: F401 - registers the retrofit's attention
    from hf_polyattn import machine
    from hf_polyattn.bench_model import _checkpoint_dir

    base = _checkpoint_dir(p, "--base", args.base)
    torch.set_num_threads(args.threads)
    models = {"retrofit": AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval(),
              "base": AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()}
    load_before = os.getloadavg()
    rows = [measure(models, n, args.steps, args.compile_decode, args.unfused) for n in args.lengths]
    load_after = os.getloadavg()
    cols = (["base", "retrofit", "floor"] + (["compiled"] if args.compile_decode else [])
            + (["unfused"] if args.unfused else []))
    cmd = (f"python recipes/decode_floor.py {args.model} --base {args.base} --lengths "
           f"{' '.join(map(str, args.lengths))} --steps {args.steps} --threads {args.threads}"
           + (" --compile-decode" if args.compile_decode else "") + (" --unfused" if args.unfused else ""))
    lines = [f"`{cmd}`", "",
             f"Machine: {machine.summary()}, fp32, batch 1; load average before "
             f"{load_before[0]:.2f}, after {load_after[0]:.2f}; median of {args.steps} interleaved steps after 3 "
             "untimed", "",
             "| length | " + " | ".join(f"{c} (ms/step)" for c in cols)
             + " | base / retrofit | base / floor (the most attention can give) | retrofit's attention (ms) |",
             "|---:|" + "---:|" * (len(cols) + 3)]
    for r in rows:
        lines.append(f"| {r['length']} | " + " | ".join(f"{r[c + '_ms']:.1f}" for c in cols)
                     + f" | {r['base_ms'] / r['retrofit_ms']:.2f}x | {r['base_ms'] / r['floor_ms']:.2f}x"
                     f" | {r['retrofit_ms'] - r['floor_ms']:.1f} |")
    if args.compile_decode:
        lines += ["", "compiled: first 3 steps (compiling) "
                  + ", ".join(f"{r['compiled_warmup_s']:.1f} s at {r['length']}" for r in rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_floor.md").write_text(text)
    (args.out / "decode_floor.json").write_text(json.dumps(
        {"command": cmd, "machine": machine.summary(), "torch": torch.__version__, "threads": args.threads,
         "load_before": load_before, "load_after": load_after, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
