"""Comparison table softmax vs each attention kind, from the results.json of pipeline runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["compare_runs", "table_markdown", "write_table"]

STAGES = ("before", "swapped", "after_transfer", "after_finetune")


def compare_runs(run_dirs: list[str | Path]) -> dict[str, Any]:
    """Rows (one per run) with the metric after each stage, the ratio to the softmax run, and times."""
    runs = []
    for d in run_dirs:
        p = Path(d) / "results.json" if Path(d).is_dir() else Path(d)
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist: run recipes/retrofit.py with --output_dir {d} first")
        runs.append(json.loads(p.read_text()))
    if not runs:
        raise ValueError("no runs to compare")
    tasks = {r["args"]["task"] for r in runs}
    if len(tasks) != 1:
        raise ValueError(f"runs of different tasks cannot share a table: {sorted(tasks)}")
    task = tasks.pop()
    metric = "perplexity" if task == "causal_lm" else "accuracy"
    soft = [r for r in runs if r["args"]["attention"] == "softmax"]
    base_final = _final(soft[0], metric) if soft else None
    rows = []
    for r in runs:
        a = r["args"]
        ev = r["evaluations"]
        final = _final(r, metric)
        row = {
            "attention": a["attention"],
            "polyattn": r.get("polyattn"),
            **{s: ev[s][metric] for s in STAGES if s in ev},
            "final": final,
            "transfer_steps": a["transfer_steps"],
            "finetune_steps": a["finetune_steps"],
            "transfer_cpu_s": r["stages"].get("transfer", {}).get("cpu_s"),
            "finetune_cpu_s": r["stages"].get("finetune", {}).get("cpu_s"),
            "total_cpu_s": r.get("total_cpu_s"),
            "total_wall_s": r.get("total_wall_s"),
        }
        if base_final is not None and final is not None:
            row["vs_softmax"] = final / base_final
        rows.append(row)
    return {"task": task, "metric": metric, "model": runs[0]["args"]["model"], "data": runs[0].get("data"),
            "machine": runs[0].get("machine"), "rows": rows,
            "eval": ({"context": runs[0]["args"]["eval_context"], "stride": runs[0]["args"]["eval_stride"]}
                     if task == "causal_lm" else {"examples": runs[0]["args"]["num_eval"]})}


def _final(run: dict[str, Any], metric: str):
    ev = run["evaluations"]
    for s in reversed(STAGES):
        if s in ev:
            return ev[s][metric]
    return None


def table_markdown(table: dict[str, Any]) -> str:
    m = table["metric"]
    ratio = "final / softmax" if m == "perplexity" else "final / softmax (accuracy ratio)"
    head = ["attention", "as loaded / swapped (no training)", "after transfer", "after fine-tuning", ratio,
            "transfer CPU s", "fine-tune CPU s", "total CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x, nd=2):
        if x is None:
            return "–"
        return f"{x:.{nd}f}" if isinstance(x, float) else str(x)

    nd = 2 if m == "perplexity" else 4
    for r in table["rows"]:
        first = r.get("swapped", r.get("before"))
        lines.append("| " + " | ".join([
            r["attention"], f(first, nd), f(r.get("after_transfer"), nd), f(r.get("after_finetune"), nd),
            f(r.get("vs_softmax"), 4), f(r.get("transfer_cpu_s"), 0), f(r.get("finetune_cpu_s"), 0),
            f(r.get("total_cpu_s"), 0)]) + " |")
    return "\n".join(lines)


def write_table(table: dict[str, Any], stem: str | Path) -> tuple[Path, Path]:
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    j, md = stem.with_suffix(".json"), stem.with_suffix(".md")
    j.write_text(json.dumps(table, indent=2))
    desc = f"{table['model']} — {table['metric']}"
    if table["task"] == "causal_lm":
        desc += f" (exp mean token NLL, context {table['eval']['context']}, stride {table['eval']['stride']})"
    md.write_text(f"### {desc}\n\n{table_markdown(table)}\n")
    return j, md
