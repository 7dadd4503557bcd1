"""The retrieval study's section: diagnostic rows (rows.DIAGNOSTICS, another grid) are stated under the table, with
their hits and command, and never enter the table."""

from __future__ import annotations

import json
from pathlib import Path

from recipes.experiments.retrieval import fill_section

ROOT = Path(__file__).resolve().parents[2]


def test_a_diagnostic_row_is_a_paragraph_not_a_table_row(tmp_path):
    study = ROOT / "recipes" / "results" / "retrieval"
    collected = {name: json.loads((study / f"{name}.json").read_text()) for name in ("hh", "hh+sparse64")}
    diag = json.loads(json.dumps(collected["hh"]))
    row = fill_section._model_row(diag)
    row["passkey"] = {**row["passkey"], "lengths": [4096], "hits": [[True] * 7 + [False] * 3]}
    row.pop("passkey_vault", None)
    diag["command"] = "python -m hf_polyattn.cli eval X --passkey 4096"
    out = tmp_path / "section.md"
    fill_section.write_table(collected, out, tmp_path / "plot.png", {"diag_row": diag})
    text = out.read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in table[1:]] == ["| hh", "| hh+sparse64"]
    para = next(line for line in text.splitlines() if line.startswith("Diagnostic row diag_row"))
    assert "passkey classic 4,096 tokens: 7 of 10" in para
    assert "Command: `python -m hf_polyattn.cli eval X --passkey 4096`" in para
