"""Copy what the gemma3_270m rows wrote under runs/gemma3_270m/ into recipes/results/gemma3_270m/.

    python -m recipes.experiments.gemma3_270m.collect [--runs DIR] [--results DIR]

Each retrofit row's ``results.json`` -> ``<row>.json`` and its long-context table ``long_context.{md,json}`` ->
``<row>_long_context.{md,json}``; the held-out evaluation's ``long_context.{md,json}`` -> ``heldout_demo.{md,json}``,
the RULER rows' -> ``ruler_demo_{4,16,32}k.{md,json}``, the ``prefill-chunk`` row's ``prefill_chunk.{md,json}``.
A file a row did not write is reported and left as it was.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# results file -> what a row wrote, relative to the study's runs folder
COPIES = {
    **{f"{row}.json": f"{row}/results.json" for row in ("quarter", "demo")},
    **{f"{row}_long_context.{ext}": f"{row}/long_context.{ext}"
       for row in ("quarter", "demo") for ext in ("md", "json")},
    **{f"heldout_demo.{ext}": f"heldout-demo/long_context.{ext}" for ext in ("md", "json")},
    **{f"ruler_demo_{n}k.{ext}": f"ruler-demo-{n}k/long_context.{ext}" for n in (4, 16, 32) for ext in ("md", "json")},
    **{f"prefill_chunk.{ext}": f"prefill-chunk/prefill_chunk.{ext}" for ext in ("md", "json")},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(ROOT / "runs" / "gemma3_270m"))
    p.add_argument("--results", default=str(ROOT / "recipes" / "results" / "gemma3_270m"))
    a = p.parse_args(argv)
    runs, results = Path(a.runs), Path(a.results)
    results.mkdir(parents=True, exist_ok=True)
    missing = []
    for target, source in COPIES.items():
        if (runs / source).is_file():
            shutil.copyfile(runs / source, results / target)
        else:
            missing.append(source)
    for source in missing:
        print(f"not written (row failed or not run): {runs / source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
