"""PolySketchFormer Tables 1 and 2 (seed 001, Section 5) at small scale, on Tiny Shakespeare.

Every attention kind trains the *same* small GPT-2 from scratch (``GPT2LMHeadModel``, config built here)
with the same data, steps, tokens per step, learning rate and seed; only the attention differs:

  softmax              sdpa
  polynomial           kind="polynomial", degree 4, exact (quadratic path: head_dim 32 has too many
                       tensor-power features for the exact linear path)
  polysketch_random    kind="polysketch", degree 4, Gaussian sketch, r = 32
  polysketch_learned   kind="polysketch", degree 4, learned sketch, r = 32
  polysketch_local     polysketch_learned + local_exact (exact degree-4 diagonal blocks of block_size)
  performer            kind="performer", FAVOR+ with m = 256 features

Tokenizer: characters (the alphabet of the training part, unknown characters -> <unk>), the cheapest
sensible choice on a CPU: the embedding and LM head are tiny and 1024 tokens are 1024 characters.
Data: ``load_text_data`` (last 10 % of the lines held out, never trained on) and ``lm_batch``; training
loop ``train_loop`` (AdamW, 5 % warm-up, cosine to 10 %, grad clip 1); perplexity: ``metrics.perplexity``
at the training context, stride = context (hf_polyattn.training, as scratch.train_scratch uses them).
The number of tokens per optimizer step is the same at every context (batch = tokens_per_step / context),
as the paper halves its batch when it doubles the context.

Table 1 = held-out perplexity (per character), Table 2 = training steps per second (single thread).
Steps/s is reported per CPU-second of the process (robust to other processes on a shared machine) and
per wall-second; both exclude the first 5 steps and the evaluation.

  python recipes/paper_tables.py                                  # the recorded grid
  python recipes/paper_tables.py --contexts 256 1024 --steps 300  # choose the grid
  python recipes/paper_tables.py --quick --out /tmp/pt            # tiny smoke run (tests)

Runs are checkpointed in ``--runs_dir``/<kind>-<context>; rerunning the same command resumes (a
finished run is not retrained, its recorded metrics are reused).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_polyattn  # noqa: E402
from hf_polyattn import (
    PolyAttnConfig,  # noqa: E402
    machine,  # noqa: E402
)
from hf_polyattn.data import lm_batch, load_text_data  # noqa: E402
from hf_polyattn.eval.metrics import perplexity  # noqa: E402
from hf_polyattn.training.loop import LoopConfig, fingerprint_of, train_loop  # noqa: E402
from recipes._defaults import RESULTS, TINY_SHAKESPEARE  # noqa: E402  (the data path: see recipes/_defaults.py)

ROOT = Path(__file__).resolve().parents[1]
SKIP_TIMING_STEPS = 5
# The grid: PolySketchFormer's Tables 1-2 rows (module docstring)
PAPER_KINDS = ["softmax", "polynomial", "polysketch_random", "polysketch_learned", "polysketch_local", "performer"]
LABELS = {
    "softmax": "Softmax (sdpa)",
    "polynomial": "Polynomial p=4 (exact)",
    "polysketch_random": "Polysketch (random)",
    "polysketch_learned": "Polysketch (learned)",
    "polysketch_local": "Polysketch (learned + local exact)",
    "performer": "Performer",
}


def polyattn_config(kind: str, args) -> PolyAttnConfig | None:
    common = dict(block_size=args.block_size, seed=args.seed)
    if kind == "softmax":
        return None
    if kind == "polynomial":
        return PolyAttnConfig(kind="polynomial", degree=4, seed=args.seed)
    if kind == "polysketch_random":
        return PolyAttnConfig(kind="polysketch", degree=4, sketch="gaussian", sketch_size=args.sketch_size, **common)
    if kind == "polysketch_learned":
        return PolyAttnConfig(kind="polysketch", degree=4, sketch="learned", sketch_size=args.sketch_size, **common)
    if kind == "polysketch_local":
        return PolyAttnConfig(kind="polysketch", degree=4, sketch="learned", sketch_size=args.sketch_size,
                              local_exact=True, **common)
    if kind == "performer":
        return PolyAttnConfig(kind="performer", num_features=args.num_features, **common)
    raise ValueError(f"unknown kind {kind!r}; choose from {PAPER_KINDS}")


class CharTokenizer:
    """Character-level tokenizer with the call signature ``load_text_data`` uses."""

    def __init__(self, text: str):
        self.chars = ["<unk>"] + sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [self.index.get(c, 0) for c in text]}


def char_tokenizer(data_file: str, eval_fraction: float) -> CharTokenizer:
    lines = Path(data_file).read_text().splitlines()
    cut = int(round(len(lines) * (1.0 - eval_fraction)))  # same cut as load_text_data
    return CharTokenizer("\n".join(lines[:cut]))


def build_model(kind: str, vocab: int, context: int, args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)  # identical initial transformer weights for every kind
    cfg = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=args.n_embd, n_layer=args.n_layer,
                     n_head=args.n_head, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    pc = polyattn_config(kind, args)
    if pc is not None:
        hf_polyattn.convert(model, pc)
    return model, pc


def steps_per_second(history: list[dict], summary: dict) -> dict:
    """Steps per CPU-second (history's cumulative cpu_s) after the first few steps; wall steps/s overall."""
    h = [x for x in history if x["step"] > SKIP_TIMING_STEPS]
    out = {"per_cpu_s": None, "per_wall_s": summary["steps"] / summary["wall_s"] if summary["wall_s"] else None}
    if len(h) >= 2 and h[-1]["cpu_s"] > h[0]["cpu_s"]:
        out["per_cpu_s"] = (h[-1]["step"] - h[0]["step"]) / (h[-1]["cpu_s"] - h[0]["cpu_s"])
    return out


def run_one(kind: str, context: int, data, vocab: int, args) -> dict:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    batch = max(1, args.tokens_per_step // context)
    model, pc = build_model(kind, vocab, context, args)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out_dir = Path(args.runs_dir) / f"{kind}-{context}"
    loop = LoopConfig(output_dir=str(out_dir), max_steps=args.steps, lr=args.lr, weight_decay=0.1,
                      warmup_steps=max(1, args.steps // 20), save_every=args.save_every, resume=True,
                      desc="pretrain", progress=False)
    fp = fingerprint_of(params, stage="pretrain", kind=kind, context=context, batch=batch, lr=args.lr,
                        seed=args.seed, steps=args.steps, n_layer=args.n_layer, n_embd=args.n_embd,
                        n_head=args.n_head, polyattn=pc.to_dict() if pc else None)
    wrapped = acc.prepare(model)
    t0 = time.time()
    summary = train_loop(acc, wrapped, params,
                         lambda s, m, r: lm_batch(data.train_ids, batch_size=batch, context=context, seed=args.seed,
                                                  step=s, micro=m, rank=r, world=acc.num_processes),
                         lambda m, b: m(**b).loss, loop, fp)
    train_wall = time.time() - t0
    model = acc.unwrap_model(wrapped)
    t1 = time.time()
    ev = perplexity(model, data.eval_ids, context=context, stride=context, batch_size=max(1, batch // 2))
    hist = summary["history"]
    res = {
        "kind": kind, "context": context, "batch_size": batch, "tokens_per_step": batch * context,
        "polyattn": pc.to_dict() if pc else None, "steps": summary["steps"], "resumed_from": summary["resumed_from"],
        "perplexity": ev["perplexity"], "eval_nll": ev["mean_nll"], "eval_tokens": ev["tokens"],
        "eval_windows": ev["windows"], "steps_per_s": steps_per_second(hist, summary),
        "train_cpu_s": summary["cpu_s"], "train_wall_s": summary["wall_s"], "this_call_train_wall_s": train_wall,
        "eval_wall_s": time.time() - t1, "initial_loss": hist[0]["loss"], "final_loss": hist[-1]["loss"],
        "loss_curve": [[x["step"], x["loss"]] for x in hist],
    }
    finite = all(math.isfinite(v) for _, v in res["loss_curve"]) and math.isfinite(res["perplexity"])
    res["finite"] = finite
    print(f"[{kind:>18} @ {context:>4}] batch {batch}  ppl {ev['perplexity']:7.3f}  loss {res['initial_loss']:.3f}"
          f" -> {res['final_loss']:.3f}  steps/cpu-s {res['steps_per_s']['per_cpu_s'] or float('nan'):.3f}"
          f"  train wall {summary['wall_s']:.0f}s", flush=True)
    return res


def fmt(v, nd=2) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.{nd}f}"


def tables(results: list[dict], kinds: list[str], contexts: list[int]) -> str:
    by = {(r["kind"], r["context"]): r for r in results}
    head = "| attention | " + " | ".join(str(c) for c in contexts) + " |\n|---|" + "---:|" * len(contexts) + "\n"

    def table(val, nd):
        return head + "".join(
            f"| {LABELS[k]} | " + " | ".join(fmt(val(by[(k, c)]) if (k, c) in by else None, nd) for c in contexts)
            + " |\n" for k in kinds)

    soft = {c: by[("softmax", c)]["perplexity"] for c in contexts if ("softmax", c) in by}
    gap_rows = ""
    for k in kinds:
        if k == "softmax" or not soft:
            continue
        cells = []
        for c in contexts:
            if (k, c) in by and c in soft:
                cells.append(f"{100 * (by[(k, c)]['perplexity'] / soft[c] - 1):+.1f}%")
            else:
                cells.append("-")
        gap_rows += f"| {LABELS[k]} | " + " | ".join(cells) + " |\n"
    md = "**Table 1 (small scale): held-out perplexity per character** (rows = attention, columns = context)\n\n"
    md += table(lambda r: r["perplexity"], 3)
    if gap_rows:
        md += "\n**Perplexity relative to softmax at the same context**\n\n" + head + gap_rows
    md += ("\n**Table 2 (small scale): training steps per second, 1 CPU thread, per CPU-second of the process**\n\n"
           + table(lambda r: r["steps_per_s"]["per_cpu_s"], 2))
    md += "\n**Training steps per wall-second (shared machine: affected by other processes)**\n\n"
    md += table(lambda r: r["steps_per_s"]["per_wall_s"], 2)
    return md


def running_mean(values, w: int) -> list[float]:
    """Mean of each value and the w - 1 before it (fewer at the start), for readable loss curves."""
    return [sum(values[max(0, i - w + 1): i + 1]) / len(values[max(0, i - w + 1): i + 1]) for i in range(len(values))]


def plot(results: list[dict], kinds: list[str], contexts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(contexts), figsize=(5.2 * len(contexts), 3.8), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        for k in kinds:
            r = next((r for r in results if r["kind"] == k and r["context"] == c), None)
            if r is None:
                continue
            steps = [s for s, _ in r["loss_curve"]]
            loss = [v for _, v in r["loss_curve"]]
            smooth = running_mean(loss, max(1, len(loss) // 30))  # over ~3 % of the run
            ax.plot(steps, smooth, lw=1.2, label=f"{LABELS[k]} (ppl {r['perplexity']:.2f})")
        ax.set_title(f"context {c}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Tiny Shakespeare, char-level GPT-2 from scratch: training loss per attention kind", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=TINY_SHAKESPEARE, help="text file (default: %(default)s)")
    p.add_argument("--kinds", nargs="+", default=PAPER_KINDS, choices=PAPER_KINDS)
    p.add_argument("--contexts", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tokens_per_step", type=int, default=2048, help="batch = tokens_per_step // context")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--block_size", type=int, default=64, help="block b of the linear-time kinds (local window)")
    p.add_argument("--sketch_size", type=int, default=32)
    p.add_argument("--num_features", type=int, default=256)
    p.add_argument("--eval_tokens", type=int, default=32768, help="held-out characters evaluated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save_every", type=int, default=100)
    p.add_argument("--out", default=str(RESULTS / "paper_tables"),
                   help="results folder: results.json, tables, plots (default: %(default)s)")
    p.add_argument("--runs_dir", default=None, help="checkpoints (default: runs/paper_tables, or OUT/runs if --quick)")
    p.add_argument("--quick", action="store_true", help="tiny grid: contexts 64 128, 30 steps, small eval")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.steps, args.tokens_per_step, args.eval_tokens = [64, 128], 30, 512, 2048
        args.block_size, args.num_features, args.sketch_size = 32, 64, 16
    if args.runs_dir is None:
        args.runs_dir = str(Path(args.out) / "runs") if args.quick else str(ROOT / "runs/paper_tables")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer(args.data, 0.1)
    data = load_text_data(args.data, tok, eval_fraction=0.1, max_eval_tokens=args.eval_tokens)
    info = machine.record()
    print(f"{info['date']}  {info['uptime']}\nvocab {len(tok)} chars, train {data.train_ids.numel()} / eval "
          f"{data.eval_ids.numel()} tokens; grid {args.kinds} x {args.contexts}, {args.steps} steps, "
          f"{args.tokens_per_step} tokens/step", flush=True)
    t0 = time.time()
    results = []
    for context in args.contexts:
        for kind in args.kinds:
            results.append(run_one(kind, context, data, len(tok), args))
    md = tables(results, args.kinds, args.contexts)
    info_end = machine.record()
    record = {
        "command": "python recipes/paper_tables.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine_start": info, "machine_end": info_end, "total_wall_s": time.time() - t0,
        "setup": {
            "model": f"GPT2LMHeadModel, {args.n_layer} layers, n_embd {args.n_embd}, {args.n_head} heads "
                     f"(head_dim {args.n_embd // args.n_head}), learned absolute positions, dropout 0",
            "tokenizer": f"characters ({len(tok)} symbols incl. <unk>)",
            "data": data.describe(), "eval": f"perplexity at the training context, stride = context, first "
                                              f"{args.eval_tokens} held-out characters",
            "optimizer": f"AdamW lr {args.lr}, weight decay 0.1, warm-up {max(1, args.steps // 20)} steps, cosine "
                         "to 10 %, grad clip 1.0",
            "steps": args.steps, "tokens_per_step": args.tokens_per_step, "seed": args.seed,
            "threads": args.threads, "block_size": args.block_size, "sketch_size": args.sketch_size,
            "num_features": args.num_features,
        },
        "kinds": args.kinds, "contexts": args.contexts, "results": results,
    }
    (out / "results.json").write_text(json.dumps(record, indent=2))
    header = (f"Command: `{record['command']}`  \nMachine: 2-core CPU, no GPU, {args.threads} torch thread(s); "
              f"load at start: `{info['uptime']}`; at end: `{info_end['uptime']}`; {info['date']}  \n"
              f"Setup: {record['setup']['model']}; {record['setup']['tokenizer']}; {args.steps} steps x "
              f"{args.tokens_per_step} tokens; {record['setup']['optimizer']}; polysketch r={args.sketch_size}, "
              f"block {args.block_size}; performer m={args.num_features}.\n\n")
    (out / "tables.md").write_text(header + md)
    plot(results, args.kinds, args.contexts, out / "loss_curves.png")
    print("\n" + md)
    print(f"total wall {record['total_wall_s']:.0f} s; wrote {out}/results.json, tables.md, loss_curves.png")
    return record


if __name__ == "__main__":
    main()
