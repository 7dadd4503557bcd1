"""Write recipes/results/SECTION_retrofit_kinds.md from recipes/results/retrofit_kinds/*.json and the CPU benchmark
tables of recipes/results/benchmark_attention_kinds/.

    .venv/bin/python -m recipes.experiments.retrofit_kinds.fill_section

Every number comes from the tables the study's rows wrote (``python recipes/experiments/run.py retrofit_kinds``,
compare_runs), the rows' own options (``rows.py``) and what `hf-polyattn bench` wrote (no number typed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..run import option
from .rows import ROWS, TABLES

RESULTS = Path(__file__).resolve().parents[2] / "results"

INTRO = """## The seed documents' other systems as kinds (issue 14): retrofit rows and CPU speed

The registry's new kinds (`hf_polyattn/kinds/`, one file each): `linformer`, `nystrom`, `fnet` (encoders only),
`bigbird`, `reformer` (both directions) and `taylor` (seed 002's Taylor kernel by name).
"""

MINILM = """
### MiniLM on SST-2 (bidirectional kinds)

`python recipes/experiments/run.py retrofit_kinds` (the rows `minilm_sst2_kinds/*`): all-MiniLM-L6-v2, {finetune}
fine-tuning steps x 16 sentences for every row (lr 1e-4), {eval_rows} held-out sentences; linformer's E, F first
get {transfer} attention-transfer steps, the parameter-free kinds cannot be transferred; softmax in the same
session. Settings per row in the table's labels and `minilm_sst2_kinds.json`. Machine: {machine}.

{table}
{summary}
"""

SMOLLM2 = """
### SmolLM2-135M on Tiny Shakespeare (causal kinds)

The rows `smollm2_kinds/*`: {finetune} LoRA r=8 steps (q/k/v/o plus the polyattn
parameters, 4 x 256 tokens a step) for every row, after {transfer} attention-transfer steps for the kind with
parameters (taylor's projection); bigbird and reformer have none. Perplexity on {eval_tokens} held-out tokens.
Machine: {machine}.

{table}
{summary}
"""

BENCH = """
### CPU speed against SDPA

`{command}` (`recipes/results/benchmark_attention_kinds/{name}`):

{table}
"""


def _summary(table: dict, higher_is_better: bool) -> str:
    rows = [r for r in table["rows"] if r["attention"] != "softmax"]
    what = "of softmax's accuracy" if higher_is_better else "softmax's perplexity"
    parts = [f"{r['attention']} {r['vs_softmax']:.3f}x" for r in rows if r.get("vs_softmax") is not None]
    return f"Final metric / softmax's ({what}): " + ", ".join(parts) + "." if parts else ""


def _section_from_table(template: str, path: Path, higher_is_better: bool) -> str:
    table = json.loads(path.with_suffix(".json").read_text())
    rows = table["rows"]
    finetune = sorted({r["finetune_steps"] for r in rows})
    transfer = sorted({r["transfer_steps"] for r in rows if r["transfer_steps"]})
    data = table.get("data", {})
    return template.format(
        finetune="/".join(map(str, finetune)), transfer="/".join(map(str, transfer)) or "0",
        eval_rows=data.get("eval_rows", "?"), eval_tokens=option(ROWS, TABLES["smollm2_kinds"], "--max_eval_tokens"),
        machine=table["machine"], table=path.with_suffix(".md").read_text().strip(),
        summary=_summary(table, higher_is_better))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=RESULTS / "retrofit_kinds")
    p.add_argument("--bench", type=Path, default=RESULTS / "benchmark_attention_kinds")
    p.add_argument("--out", type=Path, default=RESULTS / "SECTION_retrofit_kinds.md")
    args = p.parse_args(argv)
    text = INTRO
    if (args.dir / "minilm_sst2_kinds.json").exists():
        text += _section_from_table(MINILM, args.dir / "minilm_sst2_kinds", True)
    if (args.dir / "smollm2_kinds.json").exists():
        text += _section_from_table(SMOLLM2, args.dir / "smollm2_kinds", False)
    for md in sorted(args.bench.glob("*.md")) if args.bench.exists() else []:
        run = json.loads(md.with_suffix(".json").read_text())
        body = md.read_text().split("\n", 2)[2].strip()  # the table after the "Run ...: `command`" line
        text += BENCH.format(command=run["command"], name=md.name, table=body)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
