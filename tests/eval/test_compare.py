"""The comparison table: ratios, labels, accuracy intervals and the paired test against softmax."""

from __future__ import annotations

import json
import math

import pytest

from hf_polyattn.eval.compare import attention_label, compare_runs, mcnemar_exact, table_markdown, wilson_interval


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(869, 1000)
    # 86.9% of 1000: Wilson 95% interval 0.8467..0.8885 (as online Wilson calculators give)
    assert lo == pytest.approx(0.84667, abs=1e-4) and hi == pytest.approx(0.88851, abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and 0.27 < hi < 0.28  # stays inside [0, 1]
    with pytest.raises(ValueError, match="n must be"):
        wilson_interval(0, 0)


def test_mcnemar_exact():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    assert mcnemar_exact(5, 0) == mcnemar_exact(0, 5)
    assert mcnemar_exact(10, 10) == 1.0
    # 20 vs 40 discordant: two-sided exact p = 2 P(X <= 20), X ~ Bin(60, 1/2)
    expect = 2 * sum(math.comb(60, i) for i in range(21)) / 2**60
    assert mcnemar_exact(20, 40) == pytest.approx(expect) and expect < 0.02


def _run(tmp_path, name, attention, hits, polyattn=None):
    correct = hits.count("1")
    res = {"args": {"task": "classification", "attention": attention, "model": "m", "transfer_steps": 0,
                    "finetune_steps": 10, "num_eval": len(hits)},
           "polyattn": polyattn, "stages": {},
           "evaluations": {"after_finetune": {"accuracy": correct / len(hits), "correct": correct,
                                              "examples": len(hits), "hits": hits}}}
    d = tmp_path / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps(res))
    return d


def test_compare_classification_pairs_each_run_with_softmax(tmp_path):
    soft = _run(tmp_path, "s", "softmax", "1111100000")
    lin = _run(tmp_path, "l", "linear", "1110011000",
               {"kind": "linear", "feature_map": "elu", "local_exact": True, "block_size": 16, "qk_norm": True})
    table = compare_runs([soft, lin])
    rows = {r["attention"]: r for r in table["rows"]}
    assert rows["linear"]["vs_softmax"] == pytest.approx(1.0)
    # softmax right, linear wrong: rows 3, 4; linear right, softmax wrong: rows 5, 6
    assert rows["linear"]["paired_vs_softmax"] == {"only_softmax_right": 2, "only_this_right": 2, "mcnemar_p": 1.0}
    assert "paired_vs_softmax" not in rows["softmax"]
    assert rows["linear"]["label"] == "linear (elu, exact softmax 16-token blocks, qk LayerNorm)"
    md = table_markdown(table)
    assert "McNemar" in md and "2 / 2 (p = 1)" in md and "0.237–0.763" in md


def test_attention_label_names_the_settings():
    assert attention_label("softmax", None) == "softmax"
    cfg = {"kind": "polysketch", "sketch": "learned", "sketch_size": 32, "degree": 4, "local_exact": True,
           "block_size": 64, "qk_norm": False}
    assert attention_label("polysketch", cfg) == "polysketch (learned r=32, p=4, exact polynomial 64-token blocks)"
    window = {"kind": "polysketch", "sketch": "learned", "sketch_size": 16, "degree": 4, "window": 64,
              "window_mix": True, "feature_proj": 64, "qk_norm": True}
    assert attention_label("polysketch", window) == (
        "polysketch (learned r=16, p=4, exact softmax 64-token sliding window (mixed), learnable projection to 64, "
        "qk LayerNorm)")
