"""The long-context study's table, plots and section, from the flat result files (no number typed by hand).

    .venv/bin/python -m recipes.experiments.long_context.fill_section

Reads ``recipes/results/long_context/<row>.json`` (written by ``run_rows.py``) and writes, in that folder,
``ablation.md`` (perplexity at every context with its ratio to the softmax row, passkey per length, training cost),
``ablation.png`` (perplexity against context; passkey accuracy against length), and
``recipes/results/SECTION_long_context.md`` (the table with the study's setting and the rows' inputs).
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_polyattn.training.compare import attention_label

ROOT = Path(__file__).resolve().parents[3]
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


def section(rows: list[dict], tab: str) -> str:
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
{extra()}
Rows (`recipes/experiments/long_context/rows.py`, on top of its `COMMON` settings):

{inputs}
"""


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
    (RESULTS / "SECTION_long_context.md").write_text(section(rows, tab))
    print(f"wrote {FOLDER / 'ablation.md'}, {FOLDER / 'ablation.png'}, {RESULTS / 'SECTION_long_context.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
