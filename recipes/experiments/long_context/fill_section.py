"""The long-context study's table, plots and section, from the flat result files (no number typed by hand).

    .venv/bin/python -m recipes.experiments.long_context.fill_section

Reads ``recipes/results/long_context/<row>.json`` (written by ``run_rows.py``) and writes, in that folder,
``ablation.md`` (perplexity at every context with its ratio to the softmax row, passkey per length, training cost),
``ablation.png`` (perplexity against context; passkey accuracy against length), ``grid.md`` and ``grid.png`` (the
one-factor-at-a-time ablation of ``rows.ABLATION``: every setting of a factor beside the base row, a panel per
factor), and ``recipes/results/SECTION_long_context.md`` (the tables with the study's setting and the rows' inputs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_polyattn.eval.compare import attention_label

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rows.py beside it (run with -m)
from rows import ABLATION, ABLATION_BASE  # noqa: E402

RESULTS = ROOT / "recipes" / "results"
FOLDER = RESULTS / "long_context"
NOT_ROWS = ("head_scores_smollm2.json",)
READING = Path(__file__).with_name("reading.md")


def load_rows() -> list[dict]:
    rows = [json.loads(p.read_text()) for p in sorted(FOLDER.glob("*.json")) if p.name not in NOT_ROWS]
    order = {"softmax": 0, "streaming_cachepos": 1, "streaming": 2}
    return sorted(rows, key=lambda r: (order.get(r["row"], 2), r["row"]))


def label(r: dict) -> str:
    """The row's attention from its recorded settings, not its stored label (rows run before labels named the
    softmax heads). A record from before ``sink_position`` existed scored its sinks at their own positions."""
    polyattn = dict(r["polyattn"]) if r.get("polyattn") else None
    if polyattn and polyattn.get("sinks") and "sink_position" not in polyattn:
        polyattn["sink_position"] = "own"
    return attention_label(r["args"]["attention"], polyattn)


def table(rows: list[dict]) -> str:
    soft = next((r for r in rows if r["row"] == "softmax"), None)
    contexts = [p["context"] for p in rows[0]["perplexity"]]
    lengths = rows[0]["settings"]["passkey_lengths"]
    head = ["row", "attention", *[f"ppl @ {c:,}" for c in contexts], *[f"passkey @ {n:,}" for n in lengths],
            "transfer", "train CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r['row']}`", label(r)]
        for i, p in enumerate(r["perplexity"]):
            ratio = ""
            if soft is not None and r is not soft:
                ratio = f" ({p['perplexity'] / soft['perplexity'][i]['perplexity']:.2f}x)"
            cells.append(f"{p['perplexity']:.2f}{ratio}")
        pk = r.get("passkey")
        for n in lengths:
            hits = pk["hits"][pk["lengths"].index(n)] if pk else None
            cells.append("–" if hits is None else f"{sum(hits)}/{len(hits)}")
        args = r["args"]
        stages = r["stages"]
        parts = []
        if args.get("transfer_steps"):
            parts.append(f"transfer {args.get('transfer_schedule') or args['transfer_steps']}")
        if args.get("finetune_steps"):
            how = "LoRA" if args.get("lora") else "fine-tune"
            parts.append(f"{how} {args.get('finetune_schedule') or args['finetune_steps']}")
        cells.append(", ".join(parts) or "none")
        cpu = sum(s.get("cpu_s", 0) for s in stages.values())
        cells.append(f"{cpu:.0f}" if cpu else "0")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cells(r: dict, soft: dict | None) -> list[str]:
    cells = []
    for i, p in enumerate(r["perplexity"]):
        ratio = f" ({p['perplexity'] / soft['perplexity'][i]['perplexity']:.2f}x)" if soft is not None else ""
        cells.append(f"{p['perplexity']:.2f}{ratio}")
    pk = r.get("passkey")
    cells += [f"{sum(h)}/{len(h)}" for h in pk["hits"]] if pk else []
    cpu = sum(s.get("cpu_s", 0) for s in r["stages"].values())
    return cells + [f"{cpu:.0f}"]


def grid_table(rows: list[dict]) -> str:
    """One factor at a time (``rows.ABLATION``): each setting's row, the base row's setting in bold; a row not run
    yet says so (its name is in rows.py, its command is run_rows.py ROW)."""
    by = {r["row"]: r for r in rows}
    soft = by.get("softmax")
    base = by[ABLATION_BASE]
    contexts = [p["context"] for p in base["perplexity"]]
    lengths = base["settings"]["passkey_lengths"]
    head = ["factor", "setting", "row", *[f"ppl @ {c:,}" for c in contexts], *[f"passkey @ {n:,}" for n in lengths],
            "train CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for factor, settings in ABLATION.items():
        for setting, name in settings.items():
            shown = f"**{setting}**" if name == ABLATION_BASE else setting
            r = by.get(name)
            cells = _cells(r, soft) if r else ["not run"] + [""] * (len(head) - 4)
            lines.append("| " + " | ".join([factor, shown, f"`{name}`", *cells]) + " |")
    return "\n".join(lines) + "\n"


def grid_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["row"]: r for r in rows}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), sharey=True)
    for ax, (factor, settings) in zip(axes.flat, ABLATION.items()):
        for ref, style in (("softmax", ":"), ("streaming_cachepos", "--")):
            if ref in by:
                ax.plot([p["context"] for p in by[ref]["perplexity"]],
                        [p["perplexity"] for p in by[ref]["perplexity"]], style, color="grey", label=ref)
        for setting, name in settings.items():
            if name in by:
                r = by[name]
                pk = r.get("passkey")
                hits = "" if not pk else " (passkey " + "/".join(str(sum(h)) for h in pk["hits"]) + ")"
                ax.plot([p["context"] for p in r["perplexity"]], [p["perplexity"] for p in r["perplexity"]],
                        marker="o", lw=2.5 if name == ABLATION_BASE else 1.5, label=f"{setting}{hits}")
        ax.set_title(factor)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("held-out perplexity")
    fig.suptitle(f"one factor at a time around {ABLATION_BASE} (SmolLM2-135M, Tiny Shakespeare, transfer only)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for r in rows:
        style = "--" if r["row"] in ("softmax", "streaming") else "-"
        xs = [p["context"] for p in r["perplexity"]]
        ax.plot(xs, [p["perplexity"] for p in r["perplexity"]], style, marker="o", label=r["row"])
        pk = r.get("passkey")
        if pk:
            bx.plot(pk["lengths"], [sum(h) / len(h) for h in pk["hits"]], style, marker="o", label=r["row"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("perplexity vs context (SmolLM2-135M, Tiny Shakespeare)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7)
    bx.set_xscale("log", base=2)
    bx.set_ylim(-0.05, 1.05)
    bx.set_xlabel("passkey prompt length (tokens)")
    bx.set_ylabel("passkey accuracy")
    bx.set_title("passkey retrieval (10 depths)")
    bx.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(rows: list[dict], tab: str, grid: str = "") -> str:
    r0 = rows[0]
    s = r0["settings"]
    inputs = "\n".join(f"- `{r['row']}`: `{json.dumps(r['inputs'])}`" for r in rows)
    return f"""## Long context: retrofits judged at 256 ... 8,192 tokens

SmolLM2-135M-Instruct on Tiny Shakespeare. Perplexity = exp(mean token NLL) over the first {r0['tokens']:,} held-out
tokens (the last 10 % of the lines, never trained on), in non-overlapping windows of each context; ratios to the
softmax row. Passkey: {s['passkey_depths']} needle depths per length, keys seeded ({s['passkey_seed']}), greedy
decoding through the model's own `generate()` cache, exact match of the 5-digit key. Softmax heads (`top:K`) are the
K kv heads with the highest retrieval score of `hf-polyattn score-heads smollm2 --seed 1` (other keys than the
evaluation's), `recipes/results/long_context/head_scores_smollm2.json`. Machine: {r0['machine']}; rows run one after
another by `recipes/experiments/long_context/run_rows.py ROW...`; this section by
`python -m recipes.experiments.long_context.fill_section`.

{tab}
![perplexity vs context and passkey accuracy](long_context/ablation.png)
{_grid_part(grid)}{extra()}
Rows (`recipes/experiments/long_context/rows.py`, on top of its `COMMON` settings):

{inputs}
"""


def _grid_part(grid: str) -> str:
    if not grid:
        return ""
    return (f"\n### One factor at a time\n\nAround `{ABLATION_BASE}` (every kv head linear-time, transfer only, the "
            "same 60 x 2,048 transfer tokens): each row changes one setting (`rows.ABLATION`); ratios to softmax, "
            "the base's setting in bold.\n\n" + grid + "\n![one factor at a time](long_context/grid.png)\n")


def extra() -> str:
    """The study's reading of the table (``reading.md`` beside this script, written by whoever ran the rows) and the
    held-out check's table (``heldout_licenses.py`` wrote it), each when there is one."""
    parts = []
    if READING.exists():
        parts.append(READING.read_text().strip())
    if (FOLDER / "heldout" / "licenses.md").exists():
        parts.append("### The same models on text that is not in the repository\n\n"
                     "`recipes/experiments/long_context/heldout_licenses.py ROW...`: the license texts in "
                     "/usr/share/common-licenses, concatenated (`heldout/licenses.json`).\n\n"
                     + (FOLDER / "heldout" / "licenses.md").read_text().strip())
    return "".join(f"\n{part}\n" for part in parts)


def main() -> int:
    rows = load_rows()
    if not rows:
        raise SystemExit(f"no result files in {FOLDER}: run recipes/experiments/long_context/run_rows.py first")
    tab = table(rows)
    (FOLDER / "ablation.md").write_text(tab)
    plot(rows, FOLDER / "ablation.png")
    written = [FOLDER / "ablation.md", FOLDER / "ablation.png"]
    grid = ""
    if any(r["row"] == ABLATION_BASE for r in rows):
        grid = grid_table(rows)
        (FOLDER / "grid.md").write_text(grid)
        grid_plot(rows, FOLDER / "grid.png")
        written += [FOLDER / "grid.md", FOLDER / "grid.png"]
    (RESULTS / "SECTION_long_context.md").write_text(section(rows, tab, grid))
    written.append(RESULTS / "SECTION_long_context.md")
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
