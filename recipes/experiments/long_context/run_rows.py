"""Run rows of the long-context study (``rows.py``) one after another and record each as a flat result file.

    .venv/bin/python recipes/experiments/long_context/run_rows.py softmax streaming ...   # rows by name
    .venv/bin/python recipes/experiments/long_context/run_rows.py --list                 # the row names
    .venv/bin/python recipes/experiments/long_context/run_rows.py --resume ROW           # on from its checkpoints

Each row is one retrofit-pipeline run (``hf_polyattn.training.pipeline.run``) in ``runs/long_context/<row>/``; its
record (the arguments, the attention settings, the stages' times and losses, the long-context row) goes to
``recipes/results/long_context/<row>.json``. A row that fails is reported and the next one runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "recipes"))

from rows import COMMON, HEAD_SCORES, ROWS  # noqa: E402

from hf_polyattn.training.pipeline import RetrofitArgs, run  # noqa: E402

OUT = ROOT / "recipes" / "results" / "long_context"


def softmax_heads(spec: str) -> list[list[int]]:
    """'top:K' (the K best kv heads by retrieval score) or 'per_layer:K' (the K best of every layer) as pairs."""
    scores = json.loads(HEAD_SCORES.read_text())["retrieval"]
    how, _, k = spec.partition(":")
    k = int(k)
    cells = [(s, layer, head) for layer, row in enumerate(scores) for head, s in enumerate(row)]
    if how == "top":
        chosen = sorted(cells, reverse=True)[:k]
    elif how == "per_layer":
        chosen = [c for layer in range(len(scores)) for c in sorted(
            [c for c in cells if c[1] == layer], reverse=True)[:k]]
    else:
        raise ValueError(f"softmax_heads must be 'top:K' or 'per_layer:K', got {spec!r}")
    return sorted([layer, head] for _, layer, head in chosen)


def row_args(name: str, runs: Path) -> RetrofitArgs:
    fields = dict(ROWS[name])
    polyattn = dict(fields.pop("polyattn", {}))
    if fields.get("attention") not in ("softmax", "sliding_window"):
        # every long-context option spelled out: rows that left one unset ran before the pipeline's defaults
        # (RECOMMENDED_LONG_CONTEXT) set it
        polyattn = {"sinks": 0, "decay": "none", "window_mix": False, **polyattn}
        if polyattn["decay"] != "none":  # a decayed row that left the horizon unset ran with PolyAttnConfig's 1,024
            polyattn.setdefault("decay_horizon", 1024.0)
    if "softmax_heads" in fields:
        polyattn["softmax_heads"] = softmax_heads(fields.pop("softmax_heads"))
    if polyattn:
        fields["polyattn_json"] = json.dumps(polyattn)
    return RetrofitArgs(**{**COMMON, **fields, "output_dir": str(runs / name)})


def record(name: str, args: RetrofitArgs, results: dict) -> dict:
    lc = results["long_context"]
    row = lc["rows"][-1]
    return {"row": name, "inputs": ROWS[name], "args": results["args"], "polyattn": results.get("polyattn"),
            "stages": results["stages"], "label": row["label"], "perplexity": row["perplexity"],
            "passkey": row.get("passkey"), "eval_wall_s": row["wall_s"], "total_cpu_s": results.get("total_cpu_s"),
            "total_wall_s": results.get("total_wall_s"), "machine": lc["machine"], "settings": lc["settings"],
            "tokens": lc["tokens"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", help="row names (rows.py ROWS)")
    p.add_argument("--list", action="store_true", help="print the row names and exit")
    p.add_argument("--runs", default=str(ROOT / "runs" / "long_context"), help="where the pipeline runs go")
    p.add_argument("--resume", action="store_true",
                   help="continue each row from its run's stage checkpoints (a row stopped after training goes "
                        "straight to its evaluation; the stages' CPU time carries over)")
    a = p.parse_args(argv)
    if a.list or not a.rows:
        print("\n".join(ROWS))
        return 0
    unknown = [r for r in a.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in a.rows:
        t0 = time.time()
        print(f"== {name}", flush=True)
        try:
            args = row_args(name, Path(a.runs))
            if a.resume:
                args = dataclasses.replace(args, resume=True)
            results = run(args)
        except Exception:  # one failing row does not stop the others; the failure is reported
            traceback.print_exc()
            failed.append(name)
            continue
        (OUT / f"{name}.json").write_text(json.dumps(record(name, args, results), indent=1) + "\n")
        print(f"== {name} done in {time.time() - t0:.0f} s", flush=True)
    if failed:
        print(f"FAILED rows: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
