"""Reproduce the sequence-reversal experiment of the thesis "Fast Algorithms for Attention
Mechanism" (seed 000, Chapter 5) with the attention kernels of ``hf_polyattn.ops``.

Model (thesis Section 1.2.1, BERT-style post-LayerNorm encoder, Chapter 5 sizes):
token + learned positional embeddings (d_e = 32) -> one encoder block
  X1 = X + Attention(X); X2 = LN(X1); X3 = X2 + FF(X2) (GELU); X4 = LN(X3)
-> final projection X~ = LN(GELU(X4 W_f + b_f)) -> unembedding W_u -> 10 logits per position.
One head (d_attn = 32), bidirectional attention, sequences of 50 digits 0..9, target = the
sequence reversed, cross-entropy, AdamW, batch 128, fresh random batches every step.

Attentions (thesis Sections 3.2, 4.1, 4.3, 5.1-5.4):
  softmax          exp(q.k / sqrt(d)) (F.scaled_dot_product_attention)
  elu              linear attention, phi = elu + 1 (Katharopoulos et al.)
  x2, x4, x8       (q'.k')^p, q' k' = LayerNorm(q), LayerNorm(k) (Section 4.1), "1 +" in the denominator
  sq1..sq6         (1 + x + ... + x^d)^2, x = q'.k', coefficients fixed at 1 (Section 5.2)
  learned1..6      (a_0 + ... + a_d x^d)^2 with trainable a_i ~ U(-50, 50) (Section 5.3)

Usage:
  python recipes/thesis_reversal.py                       # full grid: 17 attentions x 3 seeds x 10k its
  python recipes/thesis_reversal.py --kinds softmax x8 --seeds 0 1 --iterations 2000
  python recipes/thesis_reversal.py --quick --out /tmp/rev  # tiny run (tests)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hf_polyattn.config import PolyAttnConfig
from hf_polyattn.machine import basics
from hf_polyattn.ops import PolyAttention

RESULTS = Path(__file__).resolve().parent / "results"

VOCAB = 10
SEQ_LEN = 50
D_MODEL = 32
D_FF = 128  # not stated in the thesis: 4 * d_e (BERT's ratio)
D_FINAL = 32  # d_f of the final projection, not stated: d_e

# The grid: Chapter 5's attentions (single-term polynomials, softmax and elu+1; squared and learned squared
# polynomials of degree 1-6)
SINGLE = ["softmax", "elu", "x2", "x4", "x8"]
SQUARED = [f"sq{d}" for d in range(1, 7)]
LEARNED = [f"learned{d}" for d in range(1, 7)]
ALL_KINDS = SINGLE + SQUARED + LEARNED
LABELS = {
    "softmax": "softmax", "elu": "elu+1 (linear)", "x2": "x^2", "x4": "x^4", "x8": "x^8",
    **{f"sq{d}": "(" + " + ".join(["1", "x"] + [f"x^{i}" for i in range(2, d + 1)]) + ")^2" for d in range(1, 7)},
    **{f"learned{d}": f"learned, degree {d}" for d in range(1, 7)},
}
GROUPS = {
    "single_softmax_elu": ("Single-term polynomials, softmax, elu+1", SINGLE),
    "squared": ("Squared polynomials (1 + x + ... + x^d)^2", SQUARED),
    "learned": ("Learned squared polynomials (a_0 + ... + a_d x^d)^2", LEARNED),
}

# Final losses the thesis states in its text (Sections 5.1-5.3, "approximately ... after 10000 steps").
THESIS_FINAL = {
    "x2": 0.19621022, "x4": 0.01990822, "x8": 0.00000408,
    "sq1": 2.20814011, "sq2": 0.17952636, "sq3": 0.00001183, "sq4": 0.14318735, "sq5": 0.00000469,
    "sq6": 0.09295710,
    "learned1": 0.21729853, "learned2": 0.00000564, "learned3": 0.00000451, "learned4": 0.18778882,
    "learned5": 0.00001671, "learned6": 0.00001326,
}
# Section 5.4 lists six final losses "in the same order as in the legend of Figure 5.7"; the legend is
# only in the figure, so they cannot be assigned to softmax / elu from the text alone.
THESIS_SECTION_5_4 = [0.00000477, 0.11890406, 0.04012463, 0.09217419, 0.00000410, 0.00052050]

CHANCE_PER_POSITION = math.log(VOCAB) / SEQ_LEN  # loss of one output position at chance, averaged over 50
SOLVED = 1e-3  # final loss below which a run counts as solved: 1/46 of one position left at chance


def attention_config(kind: str, args) -> PolyAttnConfig | None:
    """PolyAttnConfig of an attention name (None for softmax)."""
    if kind == "softmax":
        return None
    if kind == "elu":
        return PolyAttnConfig(kind="linear", feature_map="elu")
    common = dict(kind="polynomial", qk_norm=not args.no_qk_norm, denominator_offset=args.denominator_offset,
                  exact_path="quadratic")
    if kind in ("x2", "x4", "x8"):
        return PolyAttnConfig(degree=int(kind[1:]), **common)
    if kind.startswith("sq"):
        d = int(kind[2:])
        return PolyAttnConfig(poly_coefficients=(1.0,) * (d + 1), learn_coefficients=False, **common)
    if kind.startswith("learned"):
        d = int(kind[7:])
        # placeholder coefficients, re-drawn from U(-a, a) per seed in ReversalModel
        return PolyAttnConfig(poly_coefficients=(1.0,) * (d + 1), learn_coefficients=True, **common)
    raise ValueError(f"unknown attention {kind!r}; choose from {ALL_KINDS}")


class ReversalModel(nn.Module):
    def __init__(self, kind: str, args, gen: torch.Generator):
        super().__init__()
        self.kind = kind
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ_LEN, D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.ff = nn.Sequential(nn.Linear(D_MODEL, D_FF), nn.GELU(), nn.Linear(D_FF, D_MODEL))
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.final = nn.Linear(D_MODEL, D_FINAL)
        self.ln_f = nn.LayerNorm(D_FINAL)
        self.unembed = nn.Linear(D_FINAL, VOCAB, bias=False)
        cfg = attention_config(kind, args)
        self.attn = None if cfg is None else PolyAttention(cfg, num_heads=1, head_dim=D_MODEL)
        self.scaling = args.poly_scaling
        if cfg is not None and cfg.learn_coefficients:
            a = args.coef_init
            with torch.no_grad():
                coeffs = (torch.rand(self.attn.coefficients.shape, generator=gen) * 2 - 1) * a
                self.attn.coefficients.copy_(coeffs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n = x.shape
        h = self.tok(x) + self.pos(torch.arange(n, device=x.device))[None]
        q, k, v = self.qkv(h).view(b, n, 3, 1, D_MODEL).permute(2, 0, 3, 1, 4)  # each (B, 1, L, D)
        if self.attn is None:
            a = F.scaled_dot_product_attention(q, k, v)
        elif self.kind == "elu":
            a = self.attn(q, k, v, causal=False)
        else:
            a = self.attn(q, k, v, causal=False, scaling=self.scaling)
        h = self.ln1(h + self.proj(a.transpose(1, 2).reshape(b, n, D_MODEL)))
        h = self.ln2(h + self.ff(h))
        h = self.ln_f(F.gelu(self.final(h)))
        return self.unembed(h)


def run_one(kind: str, seed: int, args) -> dict:
    torch.manual_seed(seed)
    init_gen = torch.Generator().manual_seed(10_000 + seed)
    data_gen = torch.Generator().manual_seed(20_000 + seed)  # same batches for every attention of a seed
    model = ReversalModel(kind, args, init_gen)
    # --compile: inductor fuses the polynomial kernels' chains of small elementwise ops (2-core CPU, 1 thread:
    # (1+x+..+x^6)^2 37.3 -> 28.0 ms/it, x^8 33.7 -> 27.6, softmax 25.6 -> 26.4; results/thesis_reversal/
    # compile_check); same model, same parameters.
    if args.compile:
        # A fresh compilation per run: dynamo guards the forward on self.kind, and after 8 attentions in one
        # process it hits its recompile limit and silently runs the rest eagerly (seen in the 10k grid).
        torch._dynamo.reset()
    forward = torch.compile(model, dynamic=False) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            betas=(0.9, 0.999))
    losses = np.empty(args.iterations, dtype=np.float64)
    nonfinite_at, first_seconds = None, None
    t0 = time.perf_counter()
    for it in range(args.iterations):
        x = torch.randint(0, VOCAB, (args.batch_size, SEQ_LEN), generator=data_gen)
        y = x.flip(1)
        logits = forward(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        lv = loss.item()
        losses[it] = lv
        if not math.isfinite(lv):
            nonfinite_at = it
            losses[it:] = float("nan")
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        if it == 0:
            first_seconds = time.perf_counter() - t0  # includes the compilation with --compile
    seconds = time.perf_counter() - t0
    tail = losses[-min(100, args.iterations):]
    out = {
        "kind": kind, "seed": seed, "iterations": args.iterations, "seconds": seconds,
        "first_iteration_seconds": first_seconds,
        "final_loss": float(np.mean(tail)) if nonfinite_at is None else float("nan"),
        "nonfinite_at": nonfinite_at, "initial_loss": float(np.mean(losses[: min(10, args.iterations)])),
        "curve_first": window_means(losses[:1000], 10),
        "curve_rest": window_means(losses[1000:], rest_window(args.iterations)),
    }
    if model.attn is not None and getattr(model.attn.config, "learn_coefficients", False):
        out["learned_coefficients"] = model.attn.coefficients.detach().tolist()
    return out


def rest_window(iterations: int) -> int:
    """Points every 100 its after iteration 1000 (thesis); every 25 in shortened runs."""
    return 100 if iterations >= 5000 else 25


def window_means(a: np.ndarray, w: int) -> list[float]:
    n = len(a) // w
    return [float(v) for v in a[: n * w].reshape(n, w).mean(1)] if n else []


def fmt(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "nan"
    return f"{v:.3g}" if v >= 1e-3 else f"{v:.2e}"


def summarise(results: list[dict], kinds: list[str]) -> dict:
    summary = {}
    for kind in kinds:
        rs = [r for r in results if r["kind"] == kind]
        if not rs:
            continue
        finals = np.array([r["final_loss"] for r in rs])
        ok = finals[np.isfinite(finals)]
        summary[kind] = {
            "seeds": [r["seed"] for r in rs], "iterations": sorted({r["iterations"] for r in rs}),
            "final_losses": finals.tolist(),
            "mean": float(ok.mean()) if len(ok) else float("nan"),
            "std": float(ok.std(ddof=1)) if len(ok) > 1 else 0.0,
            "min": float(ok.min()) if len(ok) else float("nan"),
            "max": float(ok.max()) if len(ok) else float("nan"),
            "n_nonfinite": int((~np.isfinite(finals)).sum()),
            # "solved": every one of the 50 positions right (a single position at chance adds ln 10 / 50 = 0.046)
            "solved": int((ok < SOLVED).sum()),
            "seconds_per_iteration": float(np.mean([seconds_per_iteration(r) for r in rs])),
            "thesis_final": THESIS_FINAL.get(kind),
        }
    return summary


def markdown_table(summary: dict) -> str:
    its = sorted({i for s in summary.values() for i in s["iterations"]})
    lines = [
        f"Our runs: {'/'.join(map(str, its))} iterations per run, final loss = mean training cross-entropy of the "
        "last 100 iterations, mean ± sample std over seeds. Thesis values: one run each, after 10,000 iterations "
        "(Sections 5.1-5.3 text). Chance level ln 10 = 2.303.",
        "",
        "| attention | its | seeds | final loss mean ± std (last 100 its) | min | max | seeds < 1e-3 | "
        "thesis (Ch. 5, 1 run) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, s in summary.items():
        th = s["thesis_final"]
        th_s = (f"{th:.8f}" if th is not None else
                "plot only (Fig. 5.7/5.8; Sec. 5.4 numbers not assignable from the text)")
        nf = f" ({s['n_nonfinite']} non-finite)" if s["n_nonfinite"] else ""
        its = "/".join(str(i) for i in s["iterations"])
        lines.append(f"| {LABELS[kind]} | {its} | {len(s['seeds'])}{nf} | {fmt(s['mean'])} ± {fmt(s['std'])} | "
                     f"{fmt(s['min'])} | {fmt(s['max'])} | {s['solved']} of {len(s['seeds'])} | {th_s} |")
    return "\n".join(lines) + "\n"


def seconds_per_iteration(r: dict) -> float:
    """Training time per iteration of a run, its first iteration excluded (that one includes the compilation
    with --compile; runs recorded before first_iteration_seconds existed keep the plain mean)."""
    its = r["iterations"] if r["nonfinite_at"] is None else r["nonfinite_at"] + 1
    first = r.get("first_iteration_seconds")
    if first is None or its < 2:
        return r["seconds"] / its
    return (r["seconds"] - first) / (its - 1)


def first_below(r: dict, threshold: float) -> int | None:
    """First iteration at whose end the windowed mean loss is below ``threshold`` (None: never)."""
    for i, v in enumerate(r["curve_first"]):
        if v < threshold:
            return 10 * (i + 1)
    w = rest_window(r["iterations"])
    for i, v in enumerate(r["curve_rest"]):
        if v < threshold:
            return 1000 + w * (i + 1)
    return None


def runs_table(results: list[dict]) -> str:
    """One row per (attention, seed): final loss, how many of the 50 positions it leaves at chance, speed."""
    lines = [
        "Per run. 'positions at chance' = final loss / (ln 10 / 50): a model that has solved k of the 50 output "
        "positions and guesses the rest sits at (50 - k) ln 10 / 50. 'its to < 0.01' = end of the first "
        "averaging window (10 its before 1,000, then the curve's window) whose mean loss is below 0.01. ms/it "
        "excludes the first iteration (which includes compilation with --compile).",
        "",
        "| attention | seed | final loss | positions at chance | its to < 0.01 | ms/it | first it (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {k: i for i, k in enumerate(ALL_KINDS)}
    for r in sorted(results, key=lambda r: (order[r["kind"]], r["seed"])):
        first = r.get("first_iteration_seconds")
        reached = first_below(r, 0.01)
        lines.append(f"| {LABELS[r['kind']]} | {r['seed']} | {fmt(r['final_loss'])} | "
                     f"{r['final_loss'] / CHANCE_PER_POSITION:.2f} | {reached if reached else 'never'} | "
                     f"{1000 * seconds_per_iteration(r):.1f} | {'-' if first is None else f'{first:.1f}'} |")
    return "\n".join(lines) + "\n"


def plot_groups(results: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for gname, (title, kinds) in GROUPS.items():
        present = [k for k in kinds if any(r["kind"] == k for r in results)]
        if not present:
            continue
        its = max(r["iterations"] for r in results)
        for part, key, step, offset, log in (("first1000", "curve_first", 10, 0, False),
                                             ("after1000", "curve_rest", rest_window(its), 1000, True)):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            drawn = False
            for kind in present:
                curves = [r[key] for r in results if r["kind"] == kind and r[key]]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                arr = np.array([c[:n] for c in curves], dtype=np.float64)
                xs = offset + step * (np.arange(n) + 1)
                with np.errstate(all="ignore"):
                    mean = np.nanmean(arr, 0)
                    lo, hi = np.nanmin(arr, 0), np.nanmax(arr, 0)
                (line,) = ax.plot(xs, mean, label=f"{LABELS[kind]} (n={len(curves)})", lw=1.2)
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
                drawn = True
            if not drawn:
                plt.close(fig)
                continue
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("iteration")
            ax.set_ylabel(f"training cross-entropy (mean of {step} its)")
            ax.set_title(f"{title}\n{'first 1,000 its' if not log else f'its 1,000-{its:,}'}: "
                         "mean over seeds, band = min..max")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            path = out / f"{gname}_{part}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path.name)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=None, help="default 10000 (200 with --quick)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (0 with --quick)")
    p.add_argument("--kinds", nargs="+", default=None, choices=ALL_KINDS,
                   help="default: all 17 (softmax x4 learned2 with --quick)")
    p.add_argument("--out", default=str(RESULTS / "thesis_reversal"),
                   help="results folder: results.json, table.md, runs.md, plots (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny run for tests: softmax + x4 + learned2, 1 seed")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="not stated in the thesis")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW default; not stated in the thesis")
    p.add_argument("--grad-clip", type=float, default=0.0, help="0 = none (the thesis mentions none)")
    p.add_argument("--coef-init", type=float, default=50.0, help="learned coefficients ~ U(-a, a); thesis: 50")
    p.add_argument("--poly-scaling", type=float, default=1.0,
                   help="multiplier s of q'.k' in the polynomial kernels; 1 = the thesis' (q'.k')^p after LayerNorm")
    p.add_argument("--denominator-offset", type=float, default=1.0, help="thesis Section 4.1: '1 +'")
    p.add_argument("--no-qk-norm", action="store_true", help="drop the q/k LayerNorm of Section 4.1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (faster for the higher-degree polynomial kernels on CPU; "
                        "adds seconds of compilation per run)")
    p.add_argument("--tag", default="", help="suffix of the output file names (partial runs)")
    p.add_argument("--merge", nargs="*", default=None,
                   help="only merge these results_*.json files from --out into results.json/table/plots")
    args = p.parse_args(argv)
    if args.iterations is None:
        args.iterations = 200 if args.quick else 10_000
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    if args.kinds is None:
        args.kinds = ["softmax", "x4", "learned2"] if args.quick else list(ALL_KINDS)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.merge is not None:
        results, meta = [], []
        for f in args.merge:
            d = json.loads((out / f).read_text())
            results += d["runs"]
            # a merged file carries its sources' settings under "merged_from"
            meta.append({"file": f, "settings": d.get("settings", d.get("merged_from")), "started": d.get("started")})
        return write_outputs(out, results, {"merged_from": meta}, args)

    settings = {k: v for k, v in vars(args).items() if k != "merge"}
    settings.update(d_model=D_MODEL, d_ff=D_FF, d_final=D_FINAL, seq_len=SEQ_LEN, vocab=VOCAB, heads=1,
                    layers=1, optimizer="AdamW", **basics())
    results = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    for seed in args.seeds:  # seed-major: a run stopped early still has whole seeds for every attention
        for kind in args.kinds:
            r = run_one(kind, seed, args)
            results.append(r)
            print(f"{kind:10s} seed {seed}: final {fmt(r['final_loss'])}  initial {r['initial_loss']:.3f}  "
                  f"{1000 * r['seconds'] / args.iterations:.2f} ms/it"
                  + (f"  NON-FINITE at it {r['nonfinite_at']}" if r["nonfinite_at"] is not None else ""),
                  flush=True)
            # checkpoint partial results after every run
            (out / f"results{args.tag}.json").write_text(json.dumps(
                {"settings": settings, "started": started, "runs": results}))
    return write_outputs(out, results, {"settings": settings, "started": started}, args)


def write_outputs(out: Path, results: list[dict], meta: dict, args) -> int:
    kinds = [k for k in ALL_KINDS if any(r["kind"] == k for r in results)]
    summary = summarise(results, kinds)
    tag = args.tag if args.merge is None else ""
    payload = {**meta, "summary": summary, "thesis_section_5_4_unassigned": THESIS_SECTION_5_4, "runs": results}
    (out / f"results{tag}.json").write_text(json.dumps(payload))
    table = markdown_table(summary)
    (out / f"table{tag}.md").write_text(table)
    (out / f"runs{tag}.md").write_text(runs_table(results))
    plots = plot_groups(results, out) if not tag else []
    print(table)
    print("plots:", ", ".join(plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
