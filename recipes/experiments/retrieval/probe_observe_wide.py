"""Probe for issue 32: does ``sparse_observe`` lose the far 'vault' needles in its choice, or before it?

`hf-polyattn eval` with ``SparseMixin.observe_keys`` set: the prompt's last ``sparse_observe`` queries read ``--keys``
of the keys their re-choice ranks (every key of the prompt when ``--keys`` covers it, which makes each of those rows
exact softmax attention over the prompt; tests/ops/test_sparse_cache.py), while the state the prefill leaves keeps
its ``sparse_cache`` first, as the library's. Every earlier row of the prompt streams as before (window, sinks, the
streaming cache, the kernel state): if the needles are still missed, the rows computed while streaming lose them,
not the choice.

    python -m recipes.experiments.retrieval.probe_observe_wide --keys 4096 MODEL [hf-polyattn eval arguments]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, required=True, help="keys each observed query reads (>= sparse_cache)")
    args, rest = ap.parse_known_args(argv)
    from hf_polyattn.cli import main as cli_main
    from hf_polyattn.ops.sparse import SparseMixin

    if args.keys < 1:  # below the model's sparse_cache: refused by the layers (SparseMixin.observe_keys)
        raise SystemExit(f"--keys must be >= 1, got {args.keys}")
    SparseMixin.observe_keys = args.keys
    return cli_main(["eval", *rest])


if __name__ == "__main__":
    sys.exit(main())
