"""Run rows of the long-context study (``rows.py``) one after another and record each as a flat result file.

    .venv/bin/python recipes/experiments/long_context/run_rows.py softmax streaming ...   # rows by name
    .venv/bin/python recipes/experiments/long_context/run_rows.py --list                 # the row names
    .venv/bin/python recipes/experiments/long_context/run_rows.py --dry_run ROW          # the command, not run
    .venv/bin/python recipes/experiments/long_context/run_rows.py --resume ROW           # on from its checkpoints

Each row is one `hf-polyattn retrofit` run in ``runs/long_context/<row>/``: its command line is built from the row
(``row_argv``; ``--dry_run`` prints it) and read by the command's own parser (``hf_polyattn.cli.retrofit_args``); its
record (the arguments, the attention settings, the stages' times and losses, the long-context row) goes to
``recipes/results/long_context/<row>.json``. A row that fails is reported and the next one runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

from rows import COMMON, HEAD_SCORES, RESULTS, ROWS

from hf_polyattn import cli
from hf_polyattn.training.pipeline import RetrofitArgs, run

ROOT = RESULTS.parents[1]
OUT = RESULTS / "long_context"


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


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):  # (layer, head) pairs
        return ",".join(f"{layer}:{head}" for layer, head in value)
    return str(value)


def row_argv(name: str, runs: Path) -> list[str]:
    """The `hf-polyattn retrofit` command line of row ``name``: --kind and one --set per attention field, then the
    study's common flags and the row's training flags."""
    fields = {**COMMON, **{k: v for k, v in ROWS[name].items() if k not in ("attention", "softmax_heads")},
              "output_dir": str(runs / name)}
    attention = ROWS[name]["attention"]
    argv = ["--kind", "softmax"] if attention == "softmax" else ["--kind", attention["kind"]]
    if attention != "softmax":
        settings = {k: v for k, v in attention.items() if k != "kind"}
        if "softmax_heads" in ROWS[name]:
            settings["softmax_heads"] = softmax_heads(ROWS[name]["softmax_heads"])
        for k, v in settings.items():
            argv += ["--set", f"{k}={_text(v)}"]
    for k, v in fields.items():
        argv += [f"--{k}", _text(v)]
    return argv


def row_args(name: str, runs: Path) -> RetrofitArgs:
    """The row's arguments, read from its command line by the command's own parser."""
    return cli.retrofit_args(cli.build_parser().parse_args(["retrofit", *row_argv(name, runs)]))


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
    p.add_argument("--dry_run", action="store_true", help="print each row's command line, run nothing")
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
    if a.dry_run:
        for name in a.rows:
            argv = row_argv(name, Path(a.runs))
            row_args(name, Path(a.runs))  # the command's own checks
            print(f"{name}: hf-polyattn retrofit {shlex.join(argv)}")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in a.rows:
        t0 = time.time()
        print(f"== {name}", flush=True)
        try:
            args = row_args(name, Path(a.runs))
            if a.resume:
                args.train = dataclasses.replace(args.train, resume=True)
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
