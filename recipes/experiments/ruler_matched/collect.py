"""Join the rows that ``run_row.py`` wrote (``recipes/results/ruler_matched/<row>.json``) into
``recipes/results/ruler_matched/summary.md``: each row's perplexity (with the held-out tokens it scored: rows run
at different --max-eval-tokens score different token sets, so no ratio is formed), its passkey hits per template,
single-prompt and multi-turn (turn 1, turn 2) per length, and the RULER table (``eval/ruler.ruler_markdown``) of the
rows that ran it; nothing typed.

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


def _passkeys(row: dict) -> dict[str, tuple[dict | None, dict | None]]:
    """template -> (its single-prompt grid, its multi-turn grid) of a row (either may be missing)."""
    out: dict[str, list] = {}
    for key, grid in row.items():
        if key == "passkey" or key.startswith("passkey_"):
            multi = key.endswith("_multi_turn")
            out.setdefault(grid["template"], [None, None])[int(multi)] = grid
    return {t: (g[0], g[1]) for t, g in out.items()}


def _depths(grid: dict | None) -> str:
    return "–" if grid is None else str(len(grid["depths"]))


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    records = [json.loads((OUT / f"{n}.json").read_text()) for n in names]
    grids = [_passkeys(rec["row"]) for rec in records]
    templates = sorted({t for g in grids for t in g}, key=lambda t: (t != "classic", t))
    lines = ["| row | attention | perplexity (context: value, tokens scored) |", "|---|---|---|"]
    for name, rec in zip(names, records):
        ppl = "; ".join(f"{p['context']:,}: {p['perplexity']:.2f} ({p['tokens']:,})" for p in rec["row"]["perplexity"])
        label, att = rec["row"]["label"], rec["row"].get("attention")
        if isinstance(att, dict) and att.get("sparse_value_keys") and "|v|" not in label:
            # rows recorded before the label named sparse_value_keys: their recorded attention says it
            label += (f" ({att['sparse_value_keys']} of the selected keys by the largest |v| pooled over "
                      f"{att['sparse_value_pool']})")
        if rec["settings"].get("read") == "copy":
            label += "; multi-turn reads the document by copy scores (hf_polyattn.read_document)"
        lines.append(f"| {name} | {label} | {ppl} |")
    for template in templates:
        lengths = sorted({n for g in grids for grid in g.get(template, ()) if grid for n in grid["lengths"]})
        head = ["row", "depths", *[f"{what} @ {n:,}" for n in lengths for what in ("single", "turn 1", "turn 2")]]
        lines += ["", f"Passkey '{template}':", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, g in zip(names, grids):
            if template not in g:
                continue
            single, multi = g[template]
            cells = [name, _depths(multi or single)]
            for n in lengths:
                cells += [_hits(single, "hits", n), _hits(multi, "hits", n), _hits(multi, "hits_second", n)]
            lines.append("| " + " | ".join(cells) + " |")
    # the RULER table names each row as the tables above do (two rows of one attention run at other lengths)
    rows = [{**rec["row"], "label": name} for name, rec in zip(names, records)]
    commands = "\n".join(f"* `{n}.json`: `{rec['command']}` ({rec['machine']}; {rec['wall_s']} s of evaluation)"
                         for n, rec in zip(names, records))
    text = ("\n".join(lines) + "\n\nPasskey: seed 0, greedy, hits of the depths per length; 'single': document and "
            "question in one prompt; 'turn 1': the document read by its own forward call, then the question on that "
            "cache; 'turn 2': the same question again after the first answer, on the same cache; '–': not run.\n\n"
            + ruler_markdown([r for r in rows if r.get("ruler") or r.get("ruler_multi_turn")])
            + "\nRows (one process each):\n\n" + commands
            + "\n\nJoined by `python recipes/experiments/ruler_matched/collect.py " + " ".join(names) + "`.\n")
    (OUT / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
