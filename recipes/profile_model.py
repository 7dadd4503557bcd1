"""Where a decoding step (or a prefill) goes: a retrofit against its own weights on softmax (SDPA + DynamicCache).

    python recipes/profile_model.py MODEL_DIR [--phase decode|prefill] [--length 1024] [--batch 1] [--steps 3]
                                    [--threads 1] [--device cpu|cuda] [--dtype fp32|bf16] [--out DIR]

Both models run the whole-model bench's own step (``hf-polyattn bench --model``: ``bench_model._step`` into the
cache ``generate()`` gives each). ``decode``: prefill the same ``--length`` prompt, 3 untimed decoding steps, then
``--steps`` steps under ``torch.profiler``; ``prefill``: one untimed prefill, then ``--steps`` prefills of the prompt
into a fresh cache under the profiler. Printed and written (``--out``/profile_PHASE-DEVICE.{md,json}``): per step,
the aten calls (a count: it does not depend on the machine's load), the self time of the weights' matmuls
(``aten::mm`` / ``addmm``) and of everything on the host, on CUDA the GPU's own time (kernels) beside it: a step
whose host time far exceeds its GPU time is bound by launching work, not by doing it. Times depend on the load
(the output gives the load average). Then the ops whose calls per step differ most between the two and, on CUDA,
each model's heaviest GPU kernels; on the CPU each model's heaviest aten operations by host self time.

``decode`` on the CPU also splits the step's wall time, outside the profiler (``--timed-steps`` steps, timed before
it runs): the layers' attention calls (transformers' attention function for the model's implementation, timed per
call) and the cache's ``update`` (where a ``DynamicCache`` concatenates every layer's keys and values), the rest
being the weights' matmuls, norms and RoPE; and each attention module class's median call. Which part of a step
the retrofit saves or adds, per layer: what the decoding targets turn on.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

MATMULS = ("aten::mm", "aten::addmm")


def _prompted(model, which: str, phase: str, length: int, batch: int, device):
    """(the prompt ids, the cache ``generate()`` gives the model, the next token) after the prompt's prefill, and for
    ``decode`` 3 untimed decoding steps."""
    from hf_polyattn.bench_model import _new_cache, _step, prompt

    ids = prompt(batch, length, model.get_input_embeddings().num_embeddings, device)
    cache = _new_cache(which, model)
    token = _step(model, ids, cache)
    if phase == "decode":
        for _ in range(3):
            token = _step(model, token, cache)
    return ids, cache, token


def _heaviest(times: dict[str, float], count: int = 12) -> dict[str, float]:
    """The ``count`` largest of ``times`` (name -> ms per step), largest first."""
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:count])


def profile(model, which: str, phase: str, length: int, steps: int, device, batch: int = 1) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from hf_polyattn.bench_model import _new_cache, _step, _sync

    ids, cache, token = _prompted(model, which, phase, length, batch, device)
    _sync(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            if phase == "decode":
                token = _step(model, token, cache)
            else:
                _step(model, ids, _new_cache(which, model))
        _sync(device)
    events = prof.key_averages()
    aten = {e.key: e.count / steps for e in events if e.key.startswith("aten::")}
    row = {"aten_calls": sum(aten.values()), "calls": aten,
           "matmul_ms": sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / steps / 1e3,
           "self_ms": sum(e.self_cpu_time_total for e in events) / steps / 1e3}
    # where a CPU step's time goes
    row["cpu_top"] = _heaviest({e.key: e.self_cpu_time_total / steps / 1e3 for e in events
                                if e.key.startswith("aten::")})
    if cuda:
        gpu = {e.key: e.self_device_time_total / steps / 1e3 for e in events if e.self_device_time_total > 0}
        row["gpu_ms"] = sum(gpu.values())
        row["gpu_top"] = _heaviest(gpu)
    return row


def time_parts(model, which: str, length: int, steps: int, batch: int = 1) -> dict:
    """Median wall ms per decoding step on the CPU of the whole step, the attention calls and the cache updates
    (module docstring), and each attention class's median ms per call, after a ``length``-token prompt and 3 untimed
    steps."""
    import statistics
    import time

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_polyattn.bench_model import _step

    _, cache, token = _prompted(model, which, "decode", length, batch, "cpu")
    impl = model.config._attn_implementation
    attend = ALL_ATTENTION_FUNCTIONS[impl]
    calls, spent = {}, {"attention": 0.0, "update": 0.0}

    def timed_attention(module, *args, **kwargs):
        t = time.perf_counter()
        out = attend(module, *args, **kwargs)
        dt = time.perf_counter() - t
        spent["attention"] += dt
        pa = getattr(module, "polyattn", None)
        name = type(module if pa is None else pa).__name__
        calls.setdefault(name, {}).setdefault(module.layer_idx, []).append(dt)
        return out

    update = cache.update

    def timed_update(*args, **kwargs):
        t = time.perf_counter()
        out = update(*args, **kwargs)
        spent["update"] += time.perf_counter() - t
        return out

    cache.update = timed_update
    ALL_ATTENTION_FUNCTIONS[impl] = timed_attention
    parts = {"step": [], "attention": [], "update": []}
    try:
        for _ in range(steps):
            spent.update(attention=0.0, update=0.0)
            t = time.perf_counter()
            token = _step(model, token, cache)
            parts["step"].append(time.perf_counter() - t)
            parts["attention"].append(spent["attention"])
            parts["update"].append(spent["update"])
    finally:
        ALL_ATTENTION_FUNCTIONS[impl] = attend
        del cache.update
    row = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in parts.items()}
    row["classes"] = {name: {"layers": len(layers),
                             "median_call_ms": statistics.median(statistics.median(t) for t in layers.values()) * 1e3}
                      for name, layers in calls.items()}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a retrofitted checkpoint folder")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    p.add_argument("--length", type=int, default=1024, help="prompt tokens (before the decoding steps)")
    p.add_argument("--batch", type=int, default=1, help="sequences (the whole-model bench times batch 1 and 8)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--timed-steps", type=int, default=20,
                   help="decode on the CPU: steps timed part by part, before the profiled ones (module docstring)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "profile_model")
    args = p.parse_args(argv)
    for name in ("length", "batch", "steps", "threads", "timed_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")

    import torch
    from transformers import AutoModelForCausalLM

    import hf_polyattn  # noqa: F401 - registers the retrofit's attention
    from hf_polyattn import machine

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    load_before = os.getloadavg()
    models = (("retrofit", {}), ("base", {"attn_implementation": "sdpa"}))

    def load(kw):
        return AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32, **kw).to(device).eval()

    # both models timed before the profiler has run in this process, so nothing it set up is in the timed steps (one
    # 4k run timing after it gave the demo's model 163 ms a step, against 124-128 ms timed before it in two later
    # runs; at 16k the later run was the slower one, 218 against 170 ms: this 2-core CPU varies that much between
    # runs, so compare the two models within one run)
    parts = {}
    if args.phase == "decode" and device.type == "cpu":
        for which, kw in models:
            parts[which] = time_parts(load(kw), which, args.length, args.timed_steps, args.batch)
    rows = {}
    for which, kw in models:
        rows[which] = profile(load(kw), which, args.phase, args.length, args.steps, device, args.batch)
        if which in parts:
            rows[which]["parts"] = parts[which]
    r, b = rows["retrofit"], rows["base"]
    diff = sorted(set(r["calls"]) | set(b["calls"]), key=lambda k: b["calls"].get(k, 0) - r["calls"].get(k, 0))
    where = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}" if device.type == "cuda"
             else machine.summary())
    lines = [f"`python recipes/profile_model.py {args.model} --phase {args.phase} --length {args.length} --batch "
             f"{args.batch} --steps "
             f"{args.steps} --threads {args.threads} --device {args.device} --dtype {dtype}`", "",
             f"Machine: {where}; load average before {load_before[0]:.2f}, after "
             f"{os.getloadavg()[0]:.2f} (times depend on it, call counts do not)", "",
             f"| per {args.phase} step ({args.batch} x {args.length} tokens) | retrofit | base (SDPA + DynamicCache) |",
             "|---|---:|---:|",
             f"| aten calls | {r['aten_calls']:,.0f} | {b['aten_calls']:,.0f} |",
             f"| weights' matmuls (ms, host self time) | {r['matmul_ms']:.1f} | {b['matmul_ms']:.1f} |",
             f"| everything (ms, host self time) | {r['self_ms']:.1f} | {b['self_ms']:.1f} |"]
    if "gpu_ms" in r:
        lines.append(f"| GPU kernels (ms) | {r['gpu_ms']:.2f} | {b['gpu_ms']:.2f} |")
    if "parts" in r:
        rp, bp = r["parts"], b["parts"]
        lines += ["", f"Wall time of a decoding step, median of {args.timed_steps} steps outside the profiler (ms):",
                  "", "| part | retrofit | base |", "|---|---:|---:|"]
        for key, label in (("step", "the whole step"), ("attention", "attention calls (every layer)"),
                           ("update", "cache update (every layer)")):
            lines.append(f"| {label} | {rp[key + '_ms']:.1f} | {bp[key + '_ms']:.1f} |")
        lines.append(f"| the rest (weights' matmuls, norms, RoPE) | "
                     f"{rp['step_ms'] - rp['attention_ms'] - rp['update_ms']:.1f} | "
                     f"{bp['step_ms'] - bp['attention_ms'] - bp['update_ms']:.1f} |")
        lines += ["", "| attention module (model) | layers | median ms per call |", "|---|---:|---:|"]
        for which in ("retrofit", "base"):
            for name, c in rows[which]["parts"]["classes"].items():
                lines.append(f"| {name} ({which}) | {c['layers']} | {c['median_call_ms']:.3f} |")
    lines += ["", "| op | retrofit calls / step | base calls / step |", "|---|---:|---:|"]
    lines += [f"| {k} | {r['calls'].get(k, 0):.0f} | {b['calls'].get(k, 0):.0f} |" for k in diff[:15]]
    for which in ("retrofit", "base") if device.type == "cpu" else ():
        lines += ["", f"{which}'s heaviest operations (host self time, ms per step):", ""]
        lines += [f"- {ms:.1f} {name}" for name, ms in rows[which]["cpu_top"].items()]
    for which in ("retrofit", "base") if "gpu_ms" in r else ():
        lines += ["", f"{which}'s heaviest GPU kernels (ms per step):", ""]
        lines += [f"- {ms:.3f} {name[:100]}" for name, ms in rows[which]["gpu_top"].items()]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"profile_{args.phase}-{device.type}" + (f"-batch{args.batch}" if args.batch > 1 else "")
    (args.out / f"{tag}.md").write_text(text)
    (args.out / f"{tag}.json").write_text(json.dumps(
        {"model": str(args.model), "phase": args.phase, "length": args.length, "batch": args.batch, "steps": args.steps,
         "timed_steps": args.timed_steps, "threads": args.threads, "device": where, "dtype": dtype,
         "torch": torch.__version__, "load_before": load_before, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
