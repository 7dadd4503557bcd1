"""Write recipes/results/SECTION_paper_tables_long.md from the longer paper_tables runs (no number typed by hand).

    python recipes/results/paper_tables_long/scripts/fill_section.py

Reads recipes/results/paper_tables_long/seed*/results.json (one paper_tables.py run per seed, same grid).
"""

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "recipes"))
from paper_tables import LABELS  # noqa: E402

D = Path(__file__).resolve().parents[1]


def main() -> int:
    runs = {int(p.parent.name[4:]): json.loads(p.read_text()) for p in sorted(D.glob("seed*/results.json"))}
    if not runs:
        raise SystemExit(f"no {D}/seed*/results.json")
    seeds = sorted(runs)
    first = runs[seeds[0]]
    kinds, contexts = first["kinds"], first["contexts"]
    ppl = {(s, r["kind"], r["context"]): r["perplexity"] for s, rec in runs.items() for r in rec["results"]}
    sps = {(s, r["kind"], r["context"]): r["steps_per_s"]["per_cpu_s"] for s, rec in runs.items()
           for r in rec["results"]}
    setup = first["setup"]
    lines = [
        "## PolySketchFormer Table 1 at small scale, trained longer (issue 5, item 2)",
        "",
        f"Machine: the project's 2-core CPU, no GPU, torch {first['machine_start']['torch']}; one process per seed, "
        "one thread each, side by side. The other core was not always free: seed 0 started beside the thesis "
        "grid's last run, and the grid's merge, its eager/compiled timing check and a test file ran beside seed 1. "
        "Steps/s are per CPU-second of the process (robust to that); perplexities do not depend on it.",
        "",
        "Commands (verbatim in `recipes/results/paper_tables_long/scripts/launch.sh`):",
        "",
        "```bash",
        *[f"{runs[s]['command']}   # {runs[s]['machine_start']['date']}, {runs[s]['total_wall_s'] / 60:.1f} min wall"
          for s in seeds],
        "python recipes/results/paper_tables_long/scripts/fill_section.py",
        "```",
        "",
        "Load (`uptime`) at start and end: " + "; ".join(
            f"seed {s}: `{runs[s]['machine_start']['uptime'].split('load average: ')[-1]}` -> "
            f"`{runs[s]['machine_end']['uptime'].split('load average: ')[-1]}`" for s in seeds) + ".",
        "",
        f"Setup (as the 150-step tables above, longer): {setup['model']}; {setup['tokenizer']}; {setup['steps']} "
        f"steps x {setup['tokens_per_step']} tokens; {setup['optimizer']}; polysketch r = {setup['sketch_size']}, "
        f"block {setup['block_size']}; {setup['eval']}. Seeds {', '.join(map(str, seeds))}: the seed sets the "
        "initial weights, the sketch and the order of the training batches; every kind of one seed starts from "
        "the same transformer weights and sees the same batches.",
        "",
    ]
    for c in contexts:
        head = "| attention | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | vs softmax (per seed) | " \
               "steps per CPU-s |"
        lines += [f"**Held-out perplexity per character, context {c}**", "", head,
                  "|---|" + "---:|" * (len(seeds) + 3)]
        for k in kinds:
            vals = [ppl.get((s, k, c)) for s in seeds]
            ok = [v for v in vals if v is not None]
            gaps = [f"{100 * (ppl[(s, k, c)] / ppl[(s, 'softmax', c)] - 1):+.1f}%"
                    for s in seeds if (s, k, c) in ppl and (s, "softmax", c) in ppl]
            speed = [sps[(s, k, c)] for s in seeds if sps.get((s, k, c))]
            lines.append(f"| {LABELS[k]} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals)
                         + f" | {statistics.mean(ok):.3f} | {', '.join(gaps) if k != 'softmax' else '-'} | "
                         f"{statistics.mean(speed):.2f} |")
        lines.append("")
        for k in kinds:
            gaps = [100 * (ppl[(s, k, c)] / ppl[(s, "softmax", c)] - 1) for s in seeds
                    if (s, k, c) in ppl and (s, "softmax", c) in ppl]
            if k != "softmax" and gaps:
                lines.append(f"* {LABELS[k]}: {statistics.mean(gaps):+.1f}% against softmax, mean over "
                             f"{len(gaps)} seed(s) (PolySketchFormer: polysketch 6-10 % worse than softmax).")
        lines.append("")
        soft = [ppl[(s, "softmax", c)] for s in seeds if (s, "softmax", c) in ppl]
        if len(soft) > 1:
            lines.append(f"Softmax itself moves {100 * (max(soft) / min(soft) - 1):.1f}% between seeds at context {c}: "
                         "the scale against which the gaps above are read.")
            lines.append("")
    passes = setup["steps"] * setup["tokens_per_step"] / setup["data"]["train_tokens"]
    lines.append(f"Still early training ({setup['steps']} steps x {setup['tokens_per_step']} characters, {passes:.2f} "
                 "passes over the training text): the models have only started to leave the unigram/bigram plateau, "
                 "one seed pair cannot separate a few-% gap from noise, and contexts 1024-2048 were not trained this "
                 "long. Pending, with a GPU or more CPU time.")
    lines.append("")
    lines.append("Loss curves: `recipes/results/paper_tables_long/seed*/loss_curves.png`; per-run records "
                 "(loss curve, timing, eval tokens): `seed*/results.json`.")
    out = ROOT / "recipes/results/SECTION_paper_tables_long.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
