"""Comparison table softmax vs each attention kind, from the results.json of pipeline runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..config import PolyAttnConfig

__all__ = ["attention_label", "compare_runs", "mcnemar_exact", "table_markdown", "wilson_interval", "write_table"]

STAGES = ("before", "swapped", "after_transfer", "after_finetune")


def compare_runs(run_dirs: list[str | Path]) -> dict[str, Any]:
    """Rows (one per run) with the metric after each stage, the ratio to the softmax run, and times."""
    runs = []
    for d in run_dirs:
        p = Path(d) / "results.json" if Path(d).is_dir() else Path(d)
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist: run `hf-polyattn retrofit ... --output_dir {d}` first")
        runs.append(json.loads(p.read_text()))
    if not runs:
        raise ValueError("no runs to compare")
    tasks = {r["args"]["task"] for r in runs}
    if len(tasks) != 1:
        raise ValueError(f"runs of different tasks cannot share a table: {sorted(tasks)}")
    task = tasks.pop()
    metric = "perplexity" if task == "causal_lm" else "accuracy"
    soft = [r for r in runs if r["args"]["attention"] == "softmax"]
    base = soft[0] if soft else None
    base_final = _final(base, metric) if base else None
    base_hits = _final_eval(base).get("hits") if base and metric == "accuracy" else None
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
        row["label"] = attention_label(a["attention"], r.get("polyattn"))
        if base_final is not None and final is not None:
            row["vs_softmax"] = final / base_final
        if metric == "accuracy":
            last = _final_eval(r)
            row["ci95"] = wilson_interval(last["correct"], last["examples"])
            if base_hits and last.get("hits") and len(base_hits) == len(last["hits"]) and r is not base:
                only_base = sum(b == "1" and h == "0" for b, h in zip(base_hits, last["hits"]))
                only_this = sum(b == "0" and h == "1" for b, h in zip(base_hits, last["hits"]))
                row["paired_vs_softmax"] = {"only_softmax_right": only_base, "only_this_right": only_this,
                                            "mcnemar_p": mcnemar_exact(only_base, only_this)}
        rows.append(row)
    return {"task": task, "metric": metric, "model": runs[0]["args"]["model"], "data": runs[0].get("data"),
            "machine": runs[0].get("machine"), "rows": rows,
            "eval": ({"context": runs[0]["args"]["eval_context"], "stride": runs[0]["args"]["eval_stride"]}
                     if task == "causal_lm" else {"examples": runs[0]["args"]["num_eval"]})}


def _final_eval(run: dict[str, Any]) -> dict[str, Any] | None:
    ev = run["evaluations"]
    for s in reversed(STAGES):
        if s in ev:
            return ev[s]
    return None


def _final(run: dict[str, Any], metric: str):
    last = _final_eval(run)
    return None if last is None else last[metric]


def attention_label(attention: str, polyattn: dict[str, Any] | None) -> str:
    """'polysketch (learned r=32, p=4, exact polynomial 16-token blocks, qk LayerNorm)' and the like: the run's
    name and its kind's description of the setting (``KindSpec.label``)."""
    if not polyattn:
        return attention
    config = PolyAttnConfig.from_dict(polyattn)
    detail = config.spec.detail(config)
    return f"{attention} ({detail})" if detail else attention


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (sane near 0 and 1, unlike p +- 1.96 SE)."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: the b + c discordant pairs under H0 are Binomial(b + c, 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def table_markdown(table: dict[str, Any]) -> str:
    m = table["metric"]
    ratio = "final / softmax" if m == "perplexity" else "final / softmax (accuracy ratio)"
    head = ["attention", "as loaded / swapped (no training)", "after transfer", "after fine-tuning", ratio,
            "transfer CPU s", "fine-tune CPU s", "total CPU s"]
    if m == "accuracy":
        head[4:4] = ["95% CI (Wilson)", "paired vs softmax: only softmax right / only this right (McNemar p)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x, nd=2):
        if x is None:
            return "–"
        return f"{x:.{nd}f}" if isinstance(x, float) else str(x)

    nd = 2 if m == "perplexity" else 4
    for r in table["rows"]:
        first = r.get("swapped", r.get("before"))
        cells = [r.get("label", r["attention"]), f(first, nd), f(r.get("after_transfer"), nd),
                 f(r.get("after_finetune"), nd), f(r.get("vs_softmax"), 4), f(r.get("transfer_cpu_s"), 0),
                 f(r.get("finetune_cpu_s"), 0), f(r.get("total_cpu_s"), 0)]
        if m == "accuracy":
            ci = r.get("ci95")
            pv = r.get("paired_vs_softmax")
            cells[4:4] = ["–" if ci is None else f"{ci[0]:.3f}–{ci[1]:.3f}",
                          "–" if pv is None else f"{pv['only_softmax_right']} / {pv['only_this_right']} "
                          f"(p = {pv['mcnemar_p']:.2g})"]
        lines.append("| " + " | ".join(cells) + " |")
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
