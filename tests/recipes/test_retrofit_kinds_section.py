"""SECTION_retrofit_kinds.md is generated from the recorded tables (no number typed): it regenerates byte for byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "recipes" / "results"


def test_retrofit_kinds_section_regenerates_byte_identical(tmp_path):
    out = tmp_path / "SECTION_retrofit_kinds.md"
    subprocess.run([sys.executable, "-m", "recipes.experiments.retrofit_kinds.fill_section", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    assert out.read_bytes() == (RESULTS / "SECTION_retrofit_kinds.md").read_bytes()


def test_retrofit_kinds_section_quotes_the_tables():
    text = (RESULTS / "SECTION_retrofit_kinds.md").read_text()
    for name in ("cpu-fp32-bidirectional.md", "cpu-fp32.md"):
        table = (RESULTS / "benchmark_attention_kinds" / name).read_text().split("\n", 2)[2].strip()
        assert table in text, name
    for name in ("minilm_sst2_kinds.md", "smollm2_kinds.md"):
        path = RESULTS / "retrofit_kinds" / name
        assert path.read_text().strip() in text, name
