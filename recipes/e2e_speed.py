"""End-to-end speed of whole transformers models: training steps and decoding, polyattn kinds vs sdpa.

(a) Training step time: one optimizer step (forward + backward + AdamW step, batch 1) of a GPT-2-shaped
    ``GPT2LMHeadModel`` (hidden 768, 12 heads; ``--layers``, default 2: 12 layers at 8k tokens do not fit
    the time budget of a 2-core CPU, and the per-layer cost is what the comparison is about) at sequence
    lengths n, for

      sdpa                 softmax, torch scaled_dot_product_attention
      polysketch_local     PolyAttnConfig(kind="polysketch", local_exact=True)  (defaults: p=4, r=32, b=256)
      polysketch           PolyAttnConfig(kind="polysketch")                    (p=4, r=32, b=256)
      linear               PolyAttnConfig(kind="linear")                        (elu + 1)
      performer            PolyAttnConfig(kind="performer")                     (FAVOR+, m=256)

    All models share the same initial weights and are timed in the same process, interleaved
    (sdpa, kind1, kind2, ... per repetition), so background load hits every kind alike. Reported:
    the fastest of ``--reps`` (default 1) timed steps after ``--warmup`` (default 0) untimed ones at every n
    (plus one untimed step per model at ``--warmup_n`` tokens first), and sdpa / kind.
(b) Decoding: a small GPT-2 (``--dec_layers`` 4, hidden 256, 4 heads) prefills n tokens, then
    ``--dec_steps`` single-token forwards are timed (median ms / token). sdpa uses an explicit
    ``DynamicCache``; the polysketch models get no cache argument: the model's own ``DynamicCache`` is
    upgraded to hf_polyattn's recurrent ``PolyAttnCacheLayer`` state automatically (checked and recorded).

The crossover length is the smallest measured n from which on the kind is faster than sdpa.

  python recipes/e2e_speed.py                       # the record run (2 threads)
  nice -n -20 python recipes/e2e_speed.py           # on a shared machine
  python recipes/e2e_speed.py --quick --out /tmp/e2e   # tiny smoke run (tests)
  python recipes/e2e_speed.py --device cuda --dtype bfloat16   # GPU: -> recipes/results/e2e_speed/cuda-bfloat16

Defaults per device (each can be overridden; ``--help`` lists both):

  cpu:  float32; (a) 2 layers at n = 1k..8k, best of 1; (b) GPT-2 4 layers / hidden 256 at n = 512..8k
  cuda: bfloat16; (a) GPT-2 small (12 layers, hidden 768, 12 heads) at n = 4k..32k, best of 3 after 1 warm-up;
        (b) GPT-2 small at n = 4k..32k, median of 32 steps after 4 warm-up

An out-of-memory error of one kind at one n is recorded as OOM in its cell (that kind is not run at larger n)
and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import hf_polyattn  # noqa: E402
from hf_polyattn import PolyAttnConfig, cache_kwargs, returned_cache  # noqa: E402
from hf_polyattn.bench import int_at_least  # noqa: E402
from hf_polyattn.machine import record, uptime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN_KINDS = {
    "polysketch_local": dict(kind="polysketch", local_exact=True),
    "polysketch": dict(kind="polysketch"),
    "linear": dict(kind="linear", feature_map="elu"),
    "performer": dict(kind="performer"),
}
DECODE_KINDS = {
    "polysketch": dict(kind="polysketch"),
    "polysketch_local": dict(kind="polysketch", local_exact=True),
}
# Defaults that depend on --device (the CPU ones are those of the recorded CPU run).
DEVICE_DEFAULTS = {
    "cpu": dict(dtype="float32", train_lengths=[1024, 2048, 4096, 8192], layers=2, reps=1, warmup=0,
                decode_lengths=[512, 1024, 2048, 4096, 8192], dec_layers=4, dec_hidden=256, dec_heads=4,
                dec_steps=16, dec_warmup=3),
    "cuda": dict(dtype="bfloat16", train_lengths=[4096, 8192, 16384, 32768], layers=12, reps=3, warmup=1,
                 decode_lengths=[4096, 8192, 16384, 32768], dec_layers=12, dec_hidden=768, dec_heads=12,
                 dec_steps=32, dec_warmup=4),
}


def sync(device: str) -> None:
    """Wait for queued GPU work, so the timer measures the step and not the launch."""
    if device == "cuda":
        torch.cuda.synchronize()


def is_oom(err: BaseException) -> bool:
    """torch's out-of-memory errors (CUDA OutOfMemoryError, the CPU allocator's, MemoryError)."""
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    msg = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def free_memory(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing (an OOM cell)."""
    return a / b if a is not None and b is not None else None


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "OOM" if value is None else f"{value:{spec}}{suffix}"


def speedup_cell(times: dict, kind: str) -> str:
    """sdpa time / kind time as a table cell; says which side ran out of memory when one did."""
    if times[kind] is None:
        return "OOM"
    if times["sdpa"] is None:
        return "sdpa OOM"
    return f"{times['sdpa'] / times[kind]:.2f}x"


def gpt2(layers: int, hidden: int, heads: int, vocab: int, positions: int, polyattn: dict | None,
         device: str = "cpu", dtype: str = "float32"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # the same initial weights for every kind
    cfg = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=heads,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="sdpa",
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    if polyattn is not None:
        hf_polyattn.convert(model, PolyAttnConfig(**polyattn))
    return model.to(device=device, dtype=getattr(torch, dtype))


# ----------------------------------------------------------------------------------------------- training


def train_speed(args) -> dict:
    kinds = ["sdpa", *args.kinds]
    models = {k: gpt2(args.layers, args.hidden, args.heads, args.vocab, max(args.train_lengths),
                      None if k == "sdpa" else TRAIN_KINDS[k], args.device, args.dtype) for k in kinds}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    for m in models.values():
        m.train()
    if args.warmup_n:  # one untimed step per model at a short length (lazy initialisation, optimizer state)
        x = torch.randint(0, args.vocab, (1, args.warmup_n), generator=torch.Generator().manual_seed(1)).to(args.device)
        for k in kinds:
            models[k](input_ids=x, labels=x, use_cache=False).loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
    rows = []
    oom_at: dict[str, int] = {}  # kind -> the n at which it ran out of memory (larger n are not run)
    for n in args.train_lengths:
        x = torch.randint(0, args.vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(args.device)
        times = {k: [] for k in kinds}
        losses = {}
        for rep in range(args.warmup + args.reps):
            for k in kinds:
                if k in oom_at:
                    continue
                try:
                    sync(args.device)
                    t0 = time.perf_counter()
                    loss = models[k](input_ids=x, labels=x, use_cache=False).loss
                    loss.backward()
                    opts[k].step()
                    opts[k].zero_grad(set_to_none=True)
                    sync(args.device)
                except Exception as err:  # noqa: BLE001 - only OOM is recorded, the rest is re-raised
                    if not is_oom(err):
                        raise
                    loss = None
                    opts[k].zero_grad(set_to_none=True)
                    free_memory(args.device)
                    oom_at[k] = n
                    print(f"[train n={n:>5}] {k}: out of memory", flush=True)
                    continue
                dt = time.perf_counter() - t0
                losses[k] = loss.item()
                if rep >= args.warmup:
                    times[k].append(dt)
        row = {"n": n, "seconds": {k: min(v) if v else None for k, v in times.items()}, "all_seconds": times,
               "loss": losses, "oom": sorted(k for k in kinds if k in oom_at)}
        row["sdpa_over_kind"] = {k: ratio(row["seconds"]["sdpa"], row["seconds"][k]) for k in args.kinds}
        rows.append(row)
        print(f"[train n={n:>5}] " + "  ".join(f"{k} {fmt(row['seconds'][k], '.2f', 's')}" for k in kinds)
              + f"   ({uptime().split('load')[-1].strip()})", flush=True)
    return {"rows": rows, "kinds": kinds, "crossover": {k: crossover(rows, k) for k in args.kinds}}


def crossover(rows: list[dict], kind: str) -> int | None:
    """Smallest measured n from which on ``kind`` is faster than sdpa at every larger measured n."""
    best = None
    for r in reversed(rows):
        if (r["sdpa_over_kind"][kind] or 0.0) > 1.0:
            best = r["n"]
        else:
            break
    return best


# ----------------------------------------------------------------------------------------------- decoding


def cache_bytes(cache) -> int:
    from hf_polyattn import PolyAttnCacheLayer

    total = 0
    for layer in cache.layers:
        if isinstance(layer, PolyAttnCacheLayer):
            total += layer.nbytes()
        else:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
    return total


@torch.inference_mode()
def decode_speed(args) -> dict:
    from transformers import DynamicCache

    from hf_polyattn import PolyAttnCacheLayer

    positions = max(args.decode_lengths) + args.dec_warmup + args.dec_steps + 8
    kinds = ["sdpa", *DECODE_KINDS]
    models = {k: gpt2(args.dec_layers, args.dec_hidden, args.dec_heads, args.vocab, positions,
                      None if k == "sdpa" else DECODE_KINDS[k], args.device, args.dtype).eval() for k in kinds}
    rows = []
    oom_at: dict[str, int] = {}  # kind -> the n at which it ran out of memory (larger n are not run)

    def oom(k: str, n: int, err: Exception) -> None:
        if not is_oom(err):
            raise err
        caches.pop(k, None)
        tokens.pop(k, None)
        free_memory(args.device)
        oom_at[k] = n
        print(f"[decode n={n:>5}] {k}: out of memory", flush=True)

    for n in args.decode_lengths:
        prompt = torch.randint(0, args.vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(args.device)
        caches, tokens, prefill_s = {}, {}, {}
        for k, m in models.items():
            if k in oom_at:
                continue
            try:
                sync(args.device)
                t0 = time.perf_counter()
                # sdpa: an explicit DynamicCache. polysketch: no cache given; the model's DynamicCache is upgraded.
                out = m(prompt, **cache_kwargs(DynamicCache() if k == "sdpa" else None), use_cache=True,
                        logits_to_keep=1)
                sync(args.device)
                prefill_s[k] = time.perf_counter() - t0
                caches[k], tokens[k] = returned_cache(out), out.logits[:, -1:].argmax(-1)
            except Exception as err:  # noqa: BLE001 - oom() re-raises anything but out-of-memory
                out = None
                oom(k, n, err)
        recurrent = {k: all(isinstance(layer, PolyAttnCacheLayer) for layer in caches[k].layers) for k in caches}
        if not all(recurrent[k] for k in DECODE_KINDS if k in caches) or recurrent.get("sdpa", False):
            raise RuntimeError(f"unexpected cache types: {recurrent}")
        times = {k: [] for k in kinds}
        for step in range(args.dec_warmup + args.dec_steps):
            for k, m in models.items():  # interleaved: the same background load for every kind
                if k not in caches:
                    continue
                try:
                    sync(args.device)
                    t0 = time.perf_counter()
                    out = m(tokens[k], **cache_kwargs(caches[k]), use_cache=True)
                    sync(args.device)
                except Exception as err:  # noqa: BLE001 - oom() re-raises anything but out-of-memory
                    out = None
                    times[k] = []
                    oom(k, n, err)
                    continue
                dt = time.perf_counter() - t0
                caches[k], tokens[k] = returned_cache(out), out.logits[:, -1:].argmax(-1)
                if step >= args.dec_warmup:
                    times[k].append(dt)
        row = {"n": n, "ms_per_token": {k: 1e3 * statistics.median(v) if v else None for k, v in times.items()},
               "all_ms": {k: [1e3 * t for t in v] for k, v in times.items()}, "prefill_s": prefill_s,
               "cache_bytes": {k: cache_bytes(caches[k]) if k in caches else None for k in kinds},
               "cache_type": {k: type(caches[k]).__name__ + ("[PolyAttnCacheLayer]" if recurrent[k] else "")
                              if k in caches else "OOM" for k in kinds},
               "oom": sorted(k for k in kinds if k in oom_at)}
        row["sdpa_over_kind"] = {k: ratio(row["ms_per_token"]["sdpa"], row["ms_per_token"][k]) for k in DECODE_KINDS}
        rows.append(row)
        caches.clear()
        free_memory(args.device)
        print(f"[decode n={n:>5}] " + "  ".join(f"{k} {fmt(row['ms_per_token'][k], '.2f', 'ms')}" for k in kinds),
              flush=True)
    return {"rows": rows, "kinds": kinds, "crossover": {k: crossover(rows, k) for k in DECODE_KINDS}}


# ----------------------------------------------------------------------------------------------- output


def markdown(res: dict, args) -> str:
    tr, de = res["train"], res["decode"]
    fewer = "" if args.layers == 12 or args.quick or args.device != "cpu" else " (not 12: see the note)"
    md = (f"**(a) Training step time** (forward + backward + AdamW, batch 1), GPT-2 shape: {args.layers} layers"
          f"{fewer}, hidden {args.hidden}, {args.heads} heads (head_dim {args.hidden // args.heads}), "
          f"vocab {args.vocab}; best of {args.reps} interleaved step(s) after {args.warmup} warm-up step(s) per n "
          f"(+ one untimed step per model at n={args.warmup_n} first); "
          f"{args.dtype}; {args.device}" + (f", {args.threads} threads" if args.device == "cpu" else "")
          + ". Seconds per step, and speed-up = sdpa time / kind time (> 1: faster; OOM: out of memory).\n\n")
    md += "| n | " + " | ".join(tr["kinds"]) + " | " + " | ".join(f"speed-up {k}" for k in args.kinds) + " |\n"
    md += "|---:|" + "---:|" * (len(tr["kinds"]) + len(args.kinds)) + "\n"
    for r in tr["rows"]:
        md += (f"| {r['n']} | " + " | ".join(fmt(r["seconds"][k], ".3f") for k in tr["kinds"]) + " | "
               + " | ".join(speedup_cell(r["seconds"], k) for k in args.kinds) + " |\n")
    md += "\nTraining crossover (smallest measured n from which the kind beats sdpa): " + "; ".join(
        f"{k}: {c if c is not None else f'not reached up to {max(args.train_lengths)}'}"
        for k, c in tr["crossover"].items()) + "\n\n"
    if not tr["rows"]:
        md = "(a) skipped (--skip_train).\n\n"
    md += (f"**(b) Decoding latency per token** after a prefill of n tokens: GPT-2 {args.dec_layers} layers, hidden "
           f"{args.dec_hidden}, {args.dec_heads} heads (head_dim {args.dec_hidden // args.dec_heads}); median of "
           f"{args.dec_steps} steps after {args.dec_warmup} warm-up, interleaved; sdpa + DynamicCache vs polysketch "
           "(p=4, r=32; local: + exact blocks b=256) with the recurrent cache hf_polyattn installs by itself.\n\n")
    md += ("| n | " + " | ".join(f"{k} ms/token" for k in de["kinds"]) + " | "
           + " | ".join(f"speed-up {k}" for k in DECODE_KINDS) + " | "
           + " | ".join(f"{k} cache MiB" for k in de["kinds"]) + " |\n")
    md += "|---:|" + "---:|" * (2 * len(de["kinds"]) + len(DECODE_KINDS)) + "\n"
    for r in de["rows"]:
        md += (f"| {r['n']} | " + " | ".join(fmt(r["ms_per_token"][k], ".2f") for k in de["kinds"]) + " | "
               + " | ".join(speedup_cell(r["ms_per_token"], k) for k in DECODE_KINDS) + " | "
               + " | ".join(fmt(None if r["cache_bytes"][k] is None else r["cache_bytes"][k] / 2**20, ".2f")
                            for k in de["kinds"]) + " |\n")
    md += "\nDecoding crossover (smallest measured n from which the kind beats sdpa): " + "; ".join(
        f"{k}: {c if c is not None else f'not reached up to {max(args.decode_lengths)}'}"
        for k, c in de["crossover"].items()) + "\n"
    return md


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    tr, de = res["train"], res["decode"]
    for k in tr["kinds"]:
        pts = [(r["n"], r["seconds"][k]) for r in tr["rows"] if r["seconds"][k] is not None]
        a.plot([n for n, _ in pts], [t for _, t in pts], "o-", label=k)
    a.set_title("training step (fwd+bwd+AdamW, batch 1)")
    a.set_ylabel("seconds / step")
    for k in de["kinds"]:
        pts = [(r["n"], r["ms_per_token"][k]) for r in de["rows"] if r["ms_per_token"][k] is not None]
        b.plot([n for n, _ in pts], [t for _, t in pts], "o-", label=k)
    b.set_title("decoding after a prefill of n tokens")
    b.set_ylabel("ms / token")
    if not tr["rows"]:
        a.set_axis_off()
    for ax in (a, b) if tr["rows"] else (b,):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_positive_int = int_at_least(1)
_non_negative_int = int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    cpu, cuda = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]

    def per_device(name: str) -> str:
        return f"default: {cpu[name]} on CPU, {cuda[name]} on CUDA"

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default: cpu; picks the defaults below")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help=f"model weights (polyattn kernels accumulate in float32 either way); {per_device('dtype')}")
    p.add_argument("--threads", type=_positive_int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument("--kinds", nargs="+", default=list(TRAIN_KINDS), choices=list(TRAIN_KINDS),
                   help="kinds of (a) besides sdpa (default: all)")
    p.add_argument("--train_lengths", nargs="+", type=_positive_int, default=None,
                   help=f"sequence lengths of (a); {per_device('train_lengths')}")
    p.add_argument("--layers", type=_positive_int, default=None,
                   help=f"GPT-2 layers for (a), 12 = GPT-2 small; {per_device('layers')}")
    p.add_argument("--hidden", type=_positive_int, default=768, help="hidden size of (a) (default: 768)")
    p.add_argument("--heads", type=_positive_int, default=12, help="heads of (a) (default: 12)")
    p.add_argument("--vocab", type=_positive_int, default=1024,
                   help="small vocabulary: the LM head is not what is compared (default: 1024)")
    p.add_argument("--warmup_n", type=_non_negative_int, default=256,
                   help="one untimed step per model at this length first, 0: none (default: 256)")
    p.add_argument("--warmup", type=_non_negative_int, default=None,
                   help=f"untimed steps per model at every n; {per_device('warmup')}")
    p.add_argument("--reps", type=_positive_int, default=None,
                   help=f"timed steps per model at every n (the fastest counts); {per_device('reps')}")
    p.add_argument("--decode_lengths", nargs="+", type=_positive_int, default=None,
                   help=f"prefill lengths of (b); {per_device('decode_lengths')}")
    p.add_argument("--dec_layers", type=_positive_int, default=None, help=f"layers of (b); {per_device('dec_layers')}")
    p.add_argument("--dec_hidden", type=_positive_int, default=None,
                   help=f"hidden size of (b); {per_device('dec_hidden')}")
    p.add_argument("--dec_heads", type=_positive_int, default=None, help=f"heads of (b); {per_device('dec_heads')}")
    p.add_argument("--dec_steps", type=_positive_int, default=None,
                   help=f"timed decoding steps (the median counts); {per_device('dec_steps')}")
    p.add_argument("--dec_warmup", type=_non_negative_int, default=None,
                   help=f"untimed decoding steps first; {per_device('dec_warmup')}")
    p.add_argument("--skip_train", action="store_true", help="run (b) only")
    p.add_argument("--out", default=None,
                   help="output folder of results.json, tables.md, e2e_speed.png (default: recipes/results/e2e_speed "
                        "on CPU, recipes/results/e2e_speed/cuda-DTYPE on CUDA)")
    p.add_argument("--quick", action="store_true", help="tiny models and lengths: a smoke run (tests)")
    return p


def plan(args) -> argparse.Namespace:
    """Fill the --device dependent defaults of parsed ``args`` in place (touches no device); returns ``args``.

    Raises ValueError for settings that cannot run (a hidden size that the heads do not divide).
    """
    for name, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    if args.out is None:
        out = ROOT / "recipes/results/e2e_speed"
        args.out = str(out if args.device == "cpu" else out / f"{args.device}-{args.dtype}")
    if args.quick:
        args.train_lengths, args.layers, args.hidden, args.heads, args.warmup_n = [128, 256], 1, 64, 2, 32
        args.decode_lengths, args.dec_layers, args.dec_hidden, args.dec_heads = [64, 256], 1, 64, 2
        args.dec_steps, args.dec_warmup, args.vocab, args.reps, args.warmup = 4, 1, 128, 1, 0
    for hidden, heads, what in ((args.hidden, args.heads, "--hidden/--heads"),
                                (args.dec_hidden, args.dec_heads, "--dec_hidden/--dec_heads")):
        if hidden % heads:
            raise ValueError(f"{what}: hidden size {hidden} is not a multiple of the {heads} heads")
    args.kinds = list(dict.fromkeys(args.kinds))
    return args


def parse(argv=None, *, check_device: bool = True):
    """Parsed and planned arguments; bad input exits with an argparse error (code 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        plan(args)
    except ValueError as err:
        p.error(str(err))
    if check_device and args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    return args


def machine_line(m: dict, args) -> str:
    """The machine as one line of the tables: GPU name and torch/CUDA versions, or the CPU and its threads."""
    if args.device == "cuda":
        return (f"GPU {m['gpu']}, torch {m['torch']}, CUDA {m['cuda']}, {args.dtype}, "
                f"{m['cpus']}-core CPU host")
    return f"{m['cpus']}-core CPU ({m['cpu']}), no GPU used, {args.threads} torch threads, torch {m['torch']}"


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = {"uptime": uptime(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "nice": os.nice(0)}
    print(f"{start['date']}  {start['uptime']}  nice {start['nice']}  threads {args.threads}", flush=True)
    t0 = time.time()
    res = {"command": "python recipes/e2e_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "args": vars(args), "start": start,
           "machine": {**record(args.device), "cuda": torch.version.cuda, "dtype": args.dtype}}
    res["train"] = ({"rows": [], "kinds": ["sdpa", *args.kinds], "crossover": {}} if args.skip_train
                    else train_speed(args))
    res["decode"] = decode_speed(args)
    res["end"] = {"uptime": uptime(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    res["wall_s"] = time.time() - t0
    note = (f"Command: `{res['command']}` (nice {start['nice']})  \nMachine: {machine_line(res['machine'], args)}; "
            f"load at start `{start['uptime']}`, at end `{res['end']['uptime']}`; "
            f"{start['date']}; wall {res['wall_s']:.0f} s.  \n")
    if args.layers != 12 and not args.quick and not args.skip_train and args.device == "cpu":
        note += (f"Note: (a) uses {args.layers} layers instead of GPT-2 small's 12: 12 layers at n = 8192 do not fit "
                 "the ~15-minute budget on this CPU. Every layer is identical, so per-layer ratios carry over; "
                 "the fixed cost (embeddings, LM head) is a larger share with fewer layers.\n")
    md = note + "\n" + markdown(res, args)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    (out / "tables.md").write_text(md)
    plot(res, out / "e2e_speed.png")
    print("\n" + md)
    return res


if __name__ == "__main__":
    main()
