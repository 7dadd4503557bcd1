"""Write recipes/results/SECTION_retrofit_window.md from recipes/results/retrofit_window/{demo_budget,ablation,...}.*.

    .venv/bin/python -m recipes.experiments.retrofit_window.fill_section

Every number comes from the tables the study's rows wrote (``python recipes/experiments/run.py retrofit_window``),
the per-step batch and the context of the demo's budget from the rows' own options in ``rows.py`` (no number
typed); also draws ablation.png next to the tables.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from ..run import option
from .rows import ROWS, TABLES

RESULTS = Path(__file__).resolve().parents[2] / "results"
RUN = "python recipes/experiments/run.py retrofit_window"

INTRO = """## Retrofit at the demo's budget: block-diagonal exact blocks vs a sliding window (issue 13)

SmolLM2-135M-Instruct on Tiny Shakespeare, the demo's budget for every row: {steps} attention-transfer steps of
4 x 256 tokens (only the polyattn parameters train, to match each layer's softmax output), no fine-tuning,
perplexity on {eval_tokens} held-out tokens (context 256, stride 256). Machine: {machine}; one run after another.
Command: `{run}` (the rows `demo_budget/*`; the inputs of every row are in
`recipes/experiments/retrofit_window/rows.py`).

"""

OUTRO = """
- Block-diagonal exact blocks (the demo until now) -> a sliding window of the same 64 tokens: {blocks:.2f}x ->
  {w64:.2f}x softmax's perplexity. The first query of each block saw only itself exactly; with a window every
  query sees its previous 64 keys through the model's own softmax.
- The learnable per-head projection before the kernel (feature_proj, identity at the start): {w64:.2f}x ->
  {w64p:.2f}x; with the per-head mixing factor (window_mix): {w64pm:.2f}x.
- A 128-token window with the projection: {w128p:.2f}x, at {w128cpu:.0f} transfer CPU-s. Caveat: the context is
  256 tokens, so a 128-token window covers at least half of every query's keys exactly; how the gap behaves at
  long contexts (where the kernel part carries most keys) is not measured here. The attention stays linear-time
  (O(n w) for the window, fixed w).
"""

TWO_STAGE = """
### Two stages: attention transfer, then LoRA

The rows `two_stage/*` (`{run}`): the 128-token window with the projection,
{transfer} transfer steps then {finetune} steps of LoRA r=8 on q/k/v/o plus the polyattn parameters (lr 1e-3,
4 x 256 tokens a step); softmax gets the same {finetune} LoRA steps. {eval_tokens} held-out tokens. Machine:
{machine}.

{table}

Final perplexity {ratio:.3f}x softmax's after the same fine-tuning, at {cpu:.0f} CPU-s for the retrofitted model
(transfer + fine-tuning + evaluations), context 256 as above.

"""

TWO_STAGE_KINDS = """
The other kinds through the same two stages (the rows `two_stage_kinds/*`: the same options and budget, softmax
rerun with its own {finetune} LoRA steps in that session): linear (elu + 1) and
Performer with the 128-token window and the projection, the exact polynomial kernel (degree 4, quadratic time, with
the projection, no window). Machine: {machine}.

{table}

Final perplexity relative to softmax after the same fine-tuning: {ratios}.
"""

MINILM = """
### MiniLM on SST-2 with a bidirectional window

The rows `minilm_sst2_window/*` (SST-2 from `$HF_POLYATTN_SST2`): each token attends exactly (softmax) to the
tokens within {window} positions on either side and through the kernel to the rest; the budget of issue 4's
section's MiniLM runs ({transfer} transfer + {finetune} fine-tuning steps x 16 sentences), softmax rerun in the same
session. Machine: {machine}.

{table}

Accuracy relative to softmax: {ratios}.
"""

ABLATION = """
### Ablation at the demo's budget

The rows `ablation/*` ran what the demo_budget table lacked, with the same
options, softmax rerun in the same session (`ablation.{{md,json}}`); the table below combines them with the rows of
`demo_budget.{{md,json}}`. One budget for every row: attention transfer only, {steps} steps x {batch} sequences x
{context} tokens = {tokens:,} tokens (only the polyattn parameters train), no fine-tuning; perplexity on
{eval_tokens} held-out tokens (context {eval_context}, stride {eval_stride}). Each ratio is to the softmax run of
its own table. CPU seconds as the recipe recorded them (process CPU time; total: loading, the transfer and the
evaluations before and after it) and the total wall seconds. The ablation runs shared the 2 cores with another
session's jobs for part of the time (where total CPU s is close to total wall s, the run had about one core), so
their CPU seconds can be higher than the demo_budget rows' for the same work; compare the cost of rows within a
table with that in mind. Machine: {machine}.

{header}
{rows}

Plot: `recipes/results/retrofit_window/ablation.png` (the ratio to softmax per row).

- Exact local part (r=16, with the projection): none (window 0) {w0p}, 16-token window {w16p}, 64-token window
  {w64p}, 128-token window {w128p}; block-diagonal 64-token blocks vs a 64-token sliding window (without the
  projection): {blocks} vs {w64}.
- Feature map (the learnable projection) on vs off, 128-token window, r=16: {w128p} vs {w128}; 64-token window:
  {w64p} vs {w64}.
- Sketch size, 128-token window + projection: r=16 {w128p}, r=32 {r32}.
- Kernel outside the window, 128-token window + projection: polysketch r=16 {w128p}, linear (elu + 1) {lin}.
  The exact polynomial kernel itself (degree 4, quadratic time, with the projection; no window, since it is exact
  everywhere): {poly}.
{missing}"""

TODO = """
Not yet done (issue 13): transfer + LoRA for every ablation row (the two-stage runs above cover each kind at its
best setting); contexts longer than 256 tokens, where the kernel part carries most keys and a 128-token
window no longer covers half of them; more than one seed per row.
"""

# the ablation rows (rows.py, ablation/<name>) and what they are
ABLATION_PLAN = {
    "polysketch_r32_window128_proj": dict(kind="polysketch", sketch_size=32, window=128, feature_proj=64),
    "polysketch_window0_proj": dict(kind="polysketch", sketch_size=16, window=0, local_exact=False, feature_proj=64),
    "polysketch_window128": dict(kind="polysketch", sketch_size=16, window=128, feature_proj=0),
    "linear_window128_proj": dict(kind="linear", window=128, feature_proj=64),
    "polysketch_window16_proj": dict(kind="polysketch", sketch_size=16, window=16, feature_proj=64),
    "polynomial4_proj": dict(kind="polynomial", degree=4, feature_proj=64),
}
HEADER = ("| kind | sketch r | exact local part | projection (feature_proj) | perplexity after transfer | / softmax "
          "| transfer CPU s | total CPU s | total wall s | table |\n|---|---|---|---|---|---|---|---|---|---|")
KIND_ORDER = {"softmax": 0, "polysketch": 1, "polynomial": 2, "linear": 3, "performer": 4}


def _budget() -> tuple[int, int]:
    """(sequences per transfer step, tokens per sequence), the same in every row of the combined table."""
    rows = TABLES["demo_budget"] + TABLES["ablation"]
    return int(option(ROWS, rows, "--transfer_batch_size")), int(option(ROWS, rows, "--context"))


def _local_part(c: dict) -> str:
    if c["kind"] == "polynomial":
        return "(all exact, quadratic time)"
    if c.get("window"):
        return f"{c['window']}-token sliding window{' (mixed)' if c.get('window_mix') else ''}"
    if c.get("local_exact"):
        return f"{c['block_size']}-token blocks (block-diagonal)"
    return "none (window 0, no blocks)"


def _sort_key(r: dict):
    c = r["polyattn"] or {}
    local = c.get("window") or (c["block_size"] - 0.5 if c.get("local_exact") else 0)
    return (KIND_ORDER.get(r["attention"], 9), c.get("sketch_size", 0) if r["attention"] == "polysketch" else 0,
            local, c.get("feature_proj", 0), c.get("window_mix", False))


def _ablation(folder: Path) -> str:
    """The 'Ablation at the demo's budget' subsection (and ablation.png) from ablation.json + demo_budget.json."""
    demo = json.loads((folder / "demo_budget.json").read_text())
    abl = json.loads((folder / "ablation.json").read_text())
    rows = [dict(r, table="demo_budget") for r in demo["rows"]] + [dict(r, table="ablation") for r in abl["rows"]]
    steps = {r["transfer_steps"] for r in rows if r["polyattn"]}
    finetune = {r["finetune_steps"] for r in rows}
    evals = {(t["data"]["eval_tokens"], t["eval"]["context"], t["eval"]["stride"], t["machine"]) for t in (demo, abl)}
    if len(steps) != 1 or finetune != {0} or len(evals) != 1:
        raise ValueError(f"the two tables do not share one budget: {steps}, {finetune}, {evals}")
    (eval_tokens, eval_context, eval_stride, machine), = evals
    steps = steps.pop()
    batch, context = _budget()
    rows.sort(key=_sort_key)

    def f(x, nd):
        return "–" if x is None else f"{x:.{nd}f}"

    lines = []
    for r in rows:
        c = r["polyattn"]
        if c is None:
            lines.append(f"| softmax | – | (all exact) | – | {f(r['final'], 2)} | {f(r['vs_softmax'], 4)} | – | "
                         f"{f(r['total_cpu_s'], 0)} | {f(r['total_wall_s'], 0)} | {r['table']} |")
            continue
        r_col = str(c["sketch_size"]) if c["kind"] == "polysketch" else "–"
        kind = c["kind"] if c["kind"] != "linear" else f"linear ({c['feature_map']})"
        proj = f"on ({c['feature_proj']})" if c.get("feature_proj") else "off"
        lines.append(f"| {kind} | {r_col} | {_local_part(c)} | {proj} | {f(r['final'], 2)} | "
                     f"{f(r['vs_softmax'], 4)} | {f(r['transfer_cpu_s'], 0)} | {f(r['total_cpu_s'], 0)} | "
                     f"{f(r['total_wall_s'], 0)} | {r['table']} |")

    def ratio(**want):
        hits = [r for r in rows if r["polyattn"] and all(r["polyattn"].get(k) == v for k, v in want.items())]
        if len(hits) > 1:
            raise ValueError(f"expected at most one run with {want}, found {len(hits)}")
        return f"{hits[0]['vs_softmax']:.2f}x" if hits else "(not run)"

    got = [r["polyattn"] for r in abl["rows"] if r["polyattn"]]
    missing = [name for name, want in ABLATION_PLAN.items()
               if not any(all(c.get(k) == v for k, v in want.items()) for c in got)]
    missing_text = ("" if not missing else
                    f"- Missing from the ablation rows' table (failed, or not started within the session's time box; "
                    f"see the run's log): {', '.join(f'`{m}`' for m in missing)}.\n")
    _plot(rows, folder / "ablation.png", steps, batch, context)
    return ABLATION.format(
        steps=steps, batch=batch, context=context, tokens=steps * batch * context, eval_tokens=eval_tokens,
        eval_context=eval_context, eval_stride=eval_stride, machine=machine, header=HEADER, rows="\n".join(lines),
        w0p=ratio(kind="polysketch", sketch_size=16, window=0, local_exact=False, feature_proj=64),
        w16p=ratio(kind="polysketch", sketch_size=16, window=16, feature_proj=64),
        w64p=ratio(kind="polysketch", sketch_size=16, window=64, feature_proj=64, window_mix=False),
        w128p=ratio(kind="polysketch", sketch_size=16, window=128, feature_proj=64),
        w128=ratio(kind="polysketch", sketch_size=16, window=128, feature_proj=0),
        w64=ratio(kind="polysketch", sketch_size=16, window=64, feature_proj=0),
        blocks=ratio(kind="polysketch", sketch_size=16, local_exact=True),
        r32=ratio(kind="polysketch", sketch_size=32, window=128, feature_proj=64),
        lin=ratio(kind="linear", window=128, feature_proj=64),
        poly=ratio(kind="polynomial", degree=4, feature_proj=64), missing=missing_text)


def _plot(rows: list[dict], path: Path, steps: int, batch: int, context: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    poly = [r for r in rows if r["polyattn"]]
    labels = []
    for r in poly:
        c = r["polyattn"]
        name = f"polysketch r={c['sketch_size']}" if c["kind"] == "polysketch" else c["kind"]
        labels.append(f"{name}, {_local_part(c).replace(' (block-diagonal)', '')}"
                      f"{', proj' if c.get('feature_proj') else ''}")
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(poly) + 1.4))
    y = range(len(poly))
    colors = {"demo_budget": "tab:gray", "ablation": "tab:blue"}
    ax.barh(y, [r["vs_softmax"] - 1 for r in poly], left=1, color=[colors[r["table"]] for r in poly])
    for i, r in enumerate(poly):
        ax.text(r["vs_softmax"], i, f" {r['vs_softmax']:.2f}", va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    top = max(r["vs_softmax"] for r in poly)
    ticks = [t for t in (1, 1.25, 1.5, 2, 3, 4, 6, 10, 20, 50, 100, 200, 500) if t <= 1.05 * top]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlim(0.9, 1.5 * top)
    for table, color in colors.items():
        ax.barh([0], [0], left=1, color=color, label=f"{table}.json")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("perplexity / softmax's (log scale; 1 = softmax)")
    ax.set_title(f"SmolLM2-135M, transfer only: {steps} steps x {batch} x {context} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", default=str(RESULTS / "retrofit_window" / "demo_budget"), help="table stem")
    p.add_argument("--out", default=str(RESULTS / "SECTION_retrofit_window.md"), help="section file to write")
    args = p.parse_args(argv)
    stem = Path(args.table)
    table = json.loads(stem.with_suffix(".json").read_text())
    rows = table["rows"]

    def row(**want):
        hits = [r for r in rows if r["polyattn"] and all(r["polyattn"].get(k) == v for k, v in want.items())]
        if len(hits) != 1:
            raise ValueError(f"expected one run with {want}, found {len(hits)}")
        return hits[0]

    blocks = row(local_exact=True)
    w64 = row(window=64, feature_proj=0)
    w64p = row(window=64, feature_proj=64, window_mix=False)
    w64pm = row(window=64, feature_proj=64, window_mix=True)
    w128p = row(window=128, feature_proj=64)
    steps = {r["transfer_steps"] for r in rows if r["polyattn"]}
    if len(steps) != 1:
        raise ValueError(f"the rows do not share one transfer budget: {sorted(steps)}")
    text = (INTRO.format(steps=steps.pop(), eval_tokens=table["data"]["eval_tokens"], machine=table["machine"], run=RUN)
            + stem.with_suffix(".md").read_text().strip() + "\n"
            + OUTRO.format(blocks=blocks["vs_softmax"], w64=w64["vs_softmax"], w64p=w64p["vs_softmax"],
                           w64pm=w64pm["vs_softmax"], w128p=w128p["vs_softmax"], w128cpu=w128p["transfer_cpu_s"]))
    if (stem.parent / "ablation.json").exists():
        text += _ablation(stem.parent)
    two = stem.parent / "two_stage"
    if two.with_suffix(".json").exists():
        t2 = json.loads(two.with_suffix(".json").read_text())
        poly = [r for r in t2["rows"] if r["polyattn"]]
        if len(poly) != 1:
            raise ValueError(f"two_stage: expected one retrofitted run, found {len(poly)}")
        r = poly[0]
        text += TWO_STAGE.format(run=RUN, transfer=r["transfer_steps"], finetune=r["finetune_steps"],
                                 eval_tokens=t2["data"]["eval_tokens"], machine=t2["machine"],
                                 table=two.with_suffix(".md").read_text().strip(), ratio=r["vs_softmax"],
                                 cpu=r["total_cpu_s"])
    kinds = stem.parent / "two_stage_kinds"
    if kinds.with_suffix(".json").exists():
        t4 = json.loads(kinds.with_suffix(".json").read_text())
        poly = [r for r in t4["rows"] if r["polyattn"]]
        budget = {(r["transfer_steps"], r["finetune_steps"]) for r in t4["rows"] if r["polyattn"]}
        if len(budget) != 1:
            raise ValueError(f"two_stage_kinds: the rows do not share one budget: {budget}")
        text += TWO_STAGE_KINDS.format(finetune=budget.pop()[1], machine=t4["machine"],
                                       table=kinds.with_suffix(".md").read_text().strip(),
                                       ratios="; ".join(f"{r['attention']} {r['vs_softmax']:.3f}x" for r in poly))
    minilm = stem.parent / "minilm_sst2_window"
    if minilm.with_suffix(".json").exists():
        t3 = json.loads(minilm.with_suffix(".json").read_text())
        poly = [r for r in t3["rows"] if r["polyattn"]]
        windows = {r["polyattn"]["window"] for r in poly}
        budget = {(r["transfer_steps"], r["finetune_steps"]) for r in poly}
        if len(windows) != 1 or len(budget) != 1:
            raise ValueError(f"minilm: expected one window and one budget, got {windows}, {budget}")
        (transfer, finetune), = budget
        text += MINILM.format(window=windows.pop() - 1, transfer=transfer, finetune=finetune, machine=t3["machine"],
                              table=minilm.with_suffix(".md").read_text().strip(),
                              ratios="; ".join(f"{r['attention']} {100 * r['vs_softmax']:.1f}%" for r in poly))
    text += TODO
    Path(args.out).write_text(re.sub(r"\n{3,}", "\n\n", text))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
