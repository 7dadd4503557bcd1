"""Copy what the second_family rows wrote under runs/second_family/ into recipes/results/second_family/.

    python -m recipes.experiments.second_family.collect [--runs DIR] [--results DIR]

The study's first ``AFTER`` step (``rows.py``): the scratch run's ``results.json`` -> ``train.json``, the two
evaluations' ``long_context.{json,md}`` -> ``long_context_{linear,streaming}.{json,md}``, and what the conversion
printed -> ``convert.txt``: the row's log (``runs/second_family/gemma3-linear.log``, where the runner sends its
output) from the line ``hf-polyattn convert`` starts its report with (``converted ...``), leaving out the loading
progress bars before it. The row ``generate`` writes ``generate.json`` there itself. A file a failed row did not
write is reported and left as it was.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# results file -> what a row wrote, relative to the study's runs folder
COPIES = {
    "train.json": "gemma3-scratch/results.json",
    "long_context_linear.json": "eval-linear/long_context.json",
    "long_context_linear.md": "eval-linear/long_context.md",
    "long_context_streaming.json": "eval-streaming/long_context.json",
    "long_context_streaming.md": "eval-streaming/long_context.md",
}
CONVERT_LOG = "gemma3-linear.log"


def convert_report(log: str) -> str:
    """The lines of ``hf-polyattn convert``'s report in a row's log (from 'converted ' on)."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("converted ")), None)
    if start is None:
        raise ValueError("no 'converted ...' line: the conversion did not finish")
    return "\n".join(lines[start:]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "second_family", help="(default: %(default)s)")
    p.add_argument("--results", type=Path, default=ROOT / "recipes" / "results" / "second_family",
                   help="(default: %(default)s)")
    args = p.parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, source in COPIES.items():
        if (args.runs / source).is_file():
            shutil.copyfile(args.runs / source, args.results / name)
        else:
            missing.append(source)
    log = args.runs / CONVERT_LOG
    try:
        (args.results / "convert.txt").write_text(convert_report(log.read_text()))
    except (OSError, ValueError) as e:
        missing.append(f"{CONVERT_LOG} ({e})")
    print(f"collected into {args.results}" + (f"; not written by the rows: {missing}" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
