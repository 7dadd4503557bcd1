"""Issue 32: a trained row's attention trained further with the settings it runs with at inference in the loop.

The ``linear-only`` preset transfers at 1,024 tokens without a sparse cache and only afterwards (``reconfigure``)
gets its 512-key cache, its re-choice by the prompt's last 16 queries and its 256-token bound on the decayed state: at
1k a 512-key cache evicts almost nothing, so the transfer never saw the cache do its job. Here a saved model is first
given those settings (``hf-polyattn convert MODEL --set ...``: they add no tensor, every trained one is kept) and then
trained again (``hf-polyattn retrofit --model <that folder>``: a saved polyattn folder trains with its own settings, so
the transfer's forward runs the sparse cache, its selection under no_grad and its fold of the evicted keys with
gradients, ``ops/sparse.py``) at lengths where the cache evicts (2k-4k tokens).

    python -m recipes.experiments.retrieval.train_in_loop MODEL --set FIELD=VALUE ... --out DIR [retrofit args]

The settings folder goes to ``DIR/start``; every other argument is the retrofit's (``hf-polyattn retrofit --help``),
which writes ``DIR`` (``--output_dir DIR``) as usual.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_polyattn.cli import main as cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a saved polyattn model folder (a trained row's runs/.../model)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="settings that add no tensor (sparse_cache, sparse_observe, decay_max_horizon, ...)")
    parser.add_argument("--out", required=True, help="the retrofit's output_dir; the settings folder goes to OUT/start")
    args, rest = parser.parse_known_args(argv)
    start = Path(args.out) / "start"
    sets = [x for s in args.set for x in ("--set", s)]
    rc = cli(["convert", args.model, *sets, "--out", str(start), "--overwrite"])
    if rc:
        return rc
    return cli(["retrofit", "--model", str(start), "--kind", "linear", "--output_dir", args.out, *rest])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
