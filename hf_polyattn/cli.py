"""`hf-polyattn` command line: `hf-polyattn bench ...`, `hf-polyattn kinds`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: hf-polyattn {bench,kinds} [options]   (hf-polyattn bench --help)"
    if not argv or argv[0] in {"-h", "--help"}:
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if cmd == "kinds":
        from .config import FEATURE_MAPS, KINDS, SKETCHES

        print(f"kinds: {', '.join(KINDS)}\nsketches: {', '.join(SKETCHES)}\nlinear feature maps: "
              f"{', '.join(FEATURE_MAPS)}")
        return 0
    print(f"hf-polyattn: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
