"""Write the held-out license texts (``recipes/experiments/long_context/heldout_licenses.py``'s, in its order) to
one .txt file, for ``hf-polyattn eval --data FILE``.

    python -m recipes.experiments.gemma3_270m.licenses_file OUT.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

from recipes.experiments.long_context.heldout_licenses import licenses_text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].endswith(".txt"):
        raise SystemExit("usage: python -m recipes.experiments.gemma3_270m.licenses_file OUT.txt")
    out = Path(argv[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(licenses_text())
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
