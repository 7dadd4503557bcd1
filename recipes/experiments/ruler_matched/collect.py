"""Join the rows that ``run_row.py`` wrote (``recipes/results/ruler_matched/<row>.json``) into one long-context record
and its tables: ``recipes/results/ruler_matched/long_context.json`` and ``long_context.md`` (perplexity, passkey
single-prompt and multi-turn, the RULER suite), through ``eval/long_context.long_context_markdown``; nothing typed.

    python recipes/experiments/ruler_matched/collect.py softmax streaming sparse256 streaming_matched256
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_polyattn.eval.long_context import long_context_markdown

OUT = Path(__file__).resolve().parents[3] / "recipes" / "results" / "ruler_matched"


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    records = [json.loads((OUT / f"{n}.json").read_text()) for n in names]
    rows = []
    for name, rec in zip(names, records):
        rows.append({**rec["row"], "file": f"{name}.json", "command": rec["command"], "machine": rec["machine"],
                     "row_wall_s": rec["wall_s"]})
    first = records[0]
    machines = sorted({r["machine"] for r in records})
    result = {"settings": first["settings"], "tokens": first["tokens"], "rows": rows, "machine": "; ".join(machines),
              "collected_by": "python recipes/experiments/ruler_matched/collect.py " + " ".join(names)}
    (OUT / "long_context.json").write_text(json.dumps(result, indent=1))
    commands = "\n".join(f"* `{r['file']}`: `{r['command']}` ({r['row_wall_s']} s)" for r in rows)
    (OUT / "long_context.md").write_text(long_context_markdown(result) + "\nRows (one process each):\n\n" + commands
                                         + f"\n\nJoined by `{result['collected_by']}`.\n")
    print((OUT / "long_context.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
