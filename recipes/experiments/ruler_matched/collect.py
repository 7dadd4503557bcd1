"""Join the rows that ``run_row.py`` wrote (``recipes/results/ruler_matched/<row>.json``) into
``recipes/results/ruler_matched/summary.md``: each row's perplexity (with the held-out tokens it scored: rows run
at different --max-eval-tokens score different token sets, so no ratio is formed), its passkey hits single-prompt
and multi-turn (turn 1, turn 2) per length, and the RULER table (``eval/ruler.ruler_markdown``); nothing typed.

    python recipes/experiments/ruler_matched/collect.py softmax sparse256 streaming_matched256
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_polyattn.eval.ruler import ruler_markdown

OUT = Path(__file__).resolve().parents[3] / "recipes" / "results" / "ruler_matched"


def _hits(pk, key: str, n: int) -> str:
    if pk is None or n not in pk["lengths"]:
        return "–"
    h = pk[key][pk["lengths"].index(n)]
    return f"{sum(h)}/{len(h)}"


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    records = [json.loads((OUT / f"{n}.json").read_text()) for n in names]
    lengths = sorted({n for rec in records for n in rec["row"].get("passkey", {}).get("lengths", [])})
    head = ["row", "attention", "perplexity (context: value, tokens scored)",
            *[f"passkey {what} @ {n:,}" for n in lengths for what in ("single", "turn 1", "turn 2")]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rec in zip(names, records):
        row = rec["row"]
        ppl = "; ".join(f"{p['context']:,}: {p['perplexity']:.2f} ({p['tokens']:,})" for p in row["perplexity"])
        single, multi = row.get("passkey"), row.get("passkey_multi_turn")
        cells = [name, row["label"], ppl]
        for n in lengths:
            cells += [_hits(single, "hits", n), _hits(multi, "hits", n), _hits(multi, "hits_second", n)]
        lines.append("| " + " | ".join(cells) + " |")
    rows = [rec["row"] for rec in records]
    commands = "\n".join(f"* `{n}.json`: `{rec['command']}` ({rec['machine']}; {rec['wall_s']} s of evaluation)"
                         for n, rec in zip(names, records))
    text = ("\n".join(lines) + "\n\nPasskey: classic template, 4 depths per length, seed 0, greedy; 'turn 1': the "
            "document read by its own forward call, then the question on that cache; 'turn 2': the same question "
            "again after the first answer, on the same cache.\n\n" + ruler_markdown(rows)
            + "\nRows (one process each):\n\n" + commands
            + "\n\nJoined by `python recipes/experiments/ruler_matched/collect.py " + " ".join(names) + "`.\n")
    (OUT / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
