"""The rope_fft study (seed 003): its section regenerates byte for byte from the recorded JSON, the recipe runs from
any directory and writes what the section reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "recipes" / "results"
RECIPE = ROOT / "recipes" / "rope_fft_accuracy.py"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_rope_fft_section_regenerates_byte_identical(tmp_path):
    out = tmp_path / "SECTION_rope_fft.md"
    _run(["-m", "recipes.experiments.rope_fft.fill_section", "--out", str(out)], cwd=ROOT)
    assert out.read_bytes() == (RESULTS / "SECTION_rope_fft.md").read_bytes()


def test_rope_fft_section_names_machine_command_and_numbers():
    res = json.loads((RESULTS / "rope_fft" / "results.json").read_text())
    text = (RESULTS / "SECTION_rope_fft.md").read_text()
    assert res["machine"]["cpu"] in text and res["machine"]["summary"] in text
    assert f"`{res['command']}`" in text and "`python recipes/experiments/run.py rope_fft`" in text
    for r in res["timing"]:  # every timing row, as recorded
        assert f"| {r['d']} | {r['g']} | {r['terms']} | {r['n']} | {r['fast_s']:.4f} | {r['quadratic_s']:.4f} |" in text
    assert res["accuracy"] and res["crossings"]


def test_recipe_help_from_elsewhere(tmp_path):
    proc = _run([str(RECIPE), "--help"], cwd=tmp_path)
    flat = re.sub(r"\s+", " ", proc.stdout)
    assert f"--out OUT folder for results.json, table.md, rope_fft.png (default: {RESULTS / 'rope_fft'})" in flat


def test_recipe_tiny_run_feeds_the_section(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "res"
    _run([str(RECIPE), "--out", str(out), "--acc_n", "16", "--acc_d", "2", "--bounds", "0.5", "--max_degree", "2:3",
          "--timing", "2:2", "--min_n", "64", "--max_n", "128", "--threads", "1"], cwd=tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "rope_fft.png", "table.md"]
    res = json.loads((out / "results.json").read_text())
    assert [r["g"] for r in res["accuracy"]] == [1, 2, 3]
    assert [r["n"] for r in res["timing"]] == [64, 128]
    assert res["accuracy"][-1]["rel_err_fro"] < res["accuracy"][0]["rel_err_fro"]
    section = tmp_path / "SECTION.md"
    _run(["-m", "recipes.experiments.rope_fft.fill_section", "--results", str(out / "results.json"), "--out",
          str(section)], cwd=ROOT)
    assert res["command"] in section.read_text()
