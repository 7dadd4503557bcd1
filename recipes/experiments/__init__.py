"""The scripts that produced recipes/results/ (one folder per study); see recipes/experiments/README.md."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def section_main(section: Callable[[Path], str], study: str, doc: str | None, argv=None) -> int:
    """A study's ``fill_section.py`` command line: ``section(--dir)`` (default recipes/results/<study>/) written to
    --out (default recipes/results/SECTION_<study>.md)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=RESULTS / study, help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS / f"SECTION_{study}.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    args.out.write_text(section(args.dir))
    print(f"wrote {args.out}")
    return 0
