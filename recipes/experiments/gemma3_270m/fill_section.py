"""Write recipes/results/SECTION_gemma3_270m.md from recipes/results/gemma3_270m/.

    .venv/bin/python -m recipes.experiments.gemma3_270m.fill_section

Every number comes from the files the study's rows wrote (``python recipes/experiments/run.py gemma3_270m``, copied
by ``collect``): ``quarter.json`` / ``demo.json`` (the two retrofits' records: head scores, layout, training, speed,
machine), ``*_long_context.md`` (their tables on the demo text), ``heldout_demo.{md,json}`` (the held-out
evaluation), ``ruler_demo_{4,16,32}k.md`` (the RULER-style suite at 4k, 16k and 32k; their perplexity tables left
out) and ``prefill_chunk.md`` (what reading a prompt in calls of 2,048 tokens changes). Nothing is measured here.
"""

from __future__ import annotations

import json
from pathlib import Path

from recipes.experiments import section_main

ROWS = ("quarter", "demo")
RULER = ("4k", "16k", "32k")

SECTION = """## The presets on a family with few global layers: Gemma 3 270M (issue 59, item 5)

`python recipes/experiments/run.py gemma3_270m` (the inputs: `recipes/experiments/gemma3_270m/rows.py`) on the
project's {machine}. Results: `recipes/results/gemma3_270m/`.

- **The model**: the base Gemma 3 270M (`--model gemma3`, `google/gemma-3-270m` as the Q4_K_M GGUF that PyPI
  packages ship, de-quantised): {layers} attention layers, {sliding} of them sliding-window layers of window
  {window} (kept exact: the recipe converts the {globals} global ones, {global_layers}), one kv head per layer.
- **The retrofit**: `make demo`'s recipe, `--preset demo` (the long-context preset's attention, {steps} transfer
  steps at {context} tokens, {transfer_cpu} CPU-s). The global layers' kv heads scored by retrieval before the
  conversion: {scores}.
- **`quarter`**: {quarter_rule}, keeping {quarter_heads} softmax (recorded by `--preset demo` before `auto` counted
  the share; `auto:1`, its row's command, chooses the same head); **`demo`**: `softmax_heads='auto'` as it is now,
  {demo_rule}, keeping {demo_heads} softmax.

`quarter` on the demo text (the bundled Tiny Shakespeare's held-out tail):

{quarter_table}

`demo` on the same tokens:

{demo_table}

Speed and decode cache at {speed_length:,} tokens against the base checkpoint (same run, batch 1): `quarter` prefill
{quarter_prefill:.2f}x, decode {quarter_decode:.2f}x, cache {quarter_cache:.2f}x the base's; `demo` prefill
{demo_prefill:.2f}x, decode {demo_decode:.2f}x, cache {demo_cache:.2f}x.

`demo` on text no recipe trained on (the license texts of /usr/share/common-licenses, the second half held out),
beside the checkpoint and StreamingLLM on the same layers, two passkey templates at 10 depths:

{heldout_table}

The RULER-style suite (`hf_polyattn/eval/ruler.py`, the question in the prompt). At 4k tokens, 8 tasks x 2 samples,
the `demo` model beside the checkpoint (`ruler-demo-4k`, on the first run of the `demo` row):

{ruler_4k}

At 16k and 32k tokens beside the checkpoint and StreamingLLM on the same layers (4 sinks + a 128-token window), every
prompt read in forward calls of 2,048 tokens (`--prefill-chunk 2048`). At 16k, 8 tasks x 2 samples
(`ruler-demo-16k`):

{ruler_16k}

At 32k tokens (32,704: the checkpoint's 32,768 positions less the longest answer), 8 tasks x 1 sample
(`ruler-demo-32k`):

{ruler_32k}

Mean over the tasks: {ruler_means}.

Why the prompts are read in calls (`prefill-chunk`): in one call transformers runs the checkpoint's sliding layers as
full attention under a mask, so their cost grows as n^2; in calls of 2,048 tokens each reads the cache's last 511
keys and its own (the probe ran beside other processes: the load it names):

{prefill_chunk}
"""


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def _table(md: str) -> str:
    """The markdown table of an evaluation with the note under it."""
    return md.strip()


def _candidates(scores: dict) -> int:
    # a record written before 'candidates' was recorded: the candidate layers' kv heads
    return scores.get("candidates") or len(scores["layers"]) * len(scores["retrieval"][0])


def _heads(record: dict) -> str:
    scores = record["head_scores"]
    pairs = scores["selected"]
    return f"{len(pairs)} of {_candidates(scores)} (" + ", ".join(f"layer {a}" for a, _ in pairs) + ")"


def section(results: Path) -> str:
    recs = {r: _load(results, f"{r}.json") for r in ROWS}
    demo, quarter = recs["demo"], recs["quarter"]
    layout = demo["layer_layout"]
    sliding = [e for e in layout if e["role"] == "sliding"]
    globals_ = [e["layer"] for e in layout if e["role"] != "sliding"]
    windows = {e["window"] for e in sliding}
    assert len(windows) == 1, windows
    machines = {r["machine"] for r in recs.values()}
    assert len(machines) == 1, machines
    scores = demo["head_scores"]
    assert scores["retrieval"] == quarter["head_scores"]["retrieval"], "the two runs scored the heads differently"
    stage = demo["stages"]["transfer"]
    context = int(stage["fingerprint"]["transfer_schedule"].split(":")[0])
    quarter_rule = quarter["head_scores"].get("rule") or f"a quarter of {_candidates(quarter['head_scores'])}"
    speed = {r: rec["speed"][0] for r, rec in recs.items()}
    return SECTION.format(
        machine=machines.pop(), layers=len(layout), sliding=len(sliding), window=windows.pop(),
        globals=len(globals_), global_layers=", ".join(map(str, globals_)), steps=stage["steps"], context=context,
        transfer_cpu=f"{stage['cpu_s']:.0f}",
        scores=", ".join(f"layer {layer} {scores['retrieval'][layer][0]:.2f}" for layer in scores["layers"]),
        quarter_rule=quarter_rule, quarter_heads=_heads(quarter), demo_rule=scores["rule"], demo_heads=_heads(demo),
        quarter_table=_table((results / "quarter_long_context.md").read_text()),
        demo_table=_table((results / "demo_long_context.md").read_text()),
        speed_length=speed["demo"]["length"],
        **{f"{r}_{k}": speed[r][f"{k}_{'speedup' if k != 'cache' else 'ratio'}"] for r in ROWS
           for k in ("prefill", "decode", "cache")},
        heldout_table=_table((results / "heldout_demo.md").read_text()),
        **{f"ruler_{n}": _ruler(results, n) for n in RULER},
        ruler_means=_ruler_means(results),
        prefill_chunk=_table((results / "prefill_chunk.md").read_text()))


def _ruler(results: Path, n: str) -> str:
    """The RULER table of ``ruler_demo_<n>.md`` (its perplexity table and note left out)."""
    return _table((results / f"ruler_demo_{n}.md").read_text()).split("\n\n", 2)[2]


def _ruler_means(results: Path) -> str:
    """'the checkpoint a / b / c% at 4k / 16k / 32k; ...': each row's mean at the lengths it ran, from the records."""
    names = {"softmax": "the checkpoint", "streaming": "StreamingLLM", None: "`demo`"}
    means: dict[str, dict[str, str]] = {}
    for n in RULER:
        for row in _load(results, f"ruler_demo_{n}.json")["rows"]:
            (avg,) = row["ruler"]["average"].values()
            means.setdefault(names[row.get("baseline")], {})[n] = f"{100 * avg:.1f}"
    return "; ".join(f"{name} {' / '.join(v.values())}% at {' / '.join(v)}" for name, v in means.items())


def main(argv=None) -> int:
    return section_main(section, "gemma3_270m", __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
