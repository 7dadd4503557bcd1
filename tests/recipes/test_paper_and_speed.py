"""Fast smoke tests of recipes/paper_tables.py and recipes/e2e_speed.py in their tiny modes.

The scripts are imported and their ``main(argv)`` called in this process (transformers is imported
once), single-threaded.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared/data/tinyshakespeare_train.txt"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not DATA.exists(), reason="Tiny Shakespeare not available")
def test_paper_tables_quick(tmp_path):
    mod = _load("paper_tables")
    rec = mod.main(["--quick", "--contexts", "64", "--steps", "16", "--eval_tokens", "512", "--threads", "1",
                    "--out", str(tmp_path)])
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["kinds"] == mod.KINDS
    md = (tmp_path / "tables.md").read_text()
    for kind in mod.KINDS:  # every attention kind is a row of both tables
        assert md.count(f"| {mod.LABELS[kind]} |") >= 3, kind
    assert {r["kind"] for r in rec["results"]} == set(mod.KINDS)
    for r in rec["results"]:
        assert r["finite"] and math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["steps_per_s"]["per_cpu_s"] > 0
        # training from scratch: the loss must fall clearly below its start (~ln 66 = 4.19) in 16 steps
        assert r["final_loss"] < r["initial_loss"] - 0.5, (r["kind"], r["initial_loss"], r["final_loss"])
        # a character model beats the uniform distribution over its 66 symbols
        assert r["perplexity"] < 66


def test_e2e_speed_quick(tmp_path):
    mod = _load("e2e_speed")
    res = mod.main(["--quick", "--threads", "1", "--out", str(tmp_path)])
    assert (tmp_path / "e2e_speed.png").stat().st_size > 0 and (tmp_path / "tables.md").exists()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["n"] for r in saved["train"]["rows"]] == [128, 256]
    for r in res["train"]["rows"]:
        assert set(r["seconds"]) == {"sdpa", *mod.TRAIN_KINDS}
        assert all(math.isfinite(v) and v > 0 for v in r["seconds"].values())
        assert all(math.isfinite(v) for v in r["loss"].values())
    rows = res["decode"]["rows"]
    for r in rows:
        assert all(math.isfinite(v) and v > 0 for v in r["ms_per_token"].values())
        # the polysketch models decode with hf_polyattn's recurrent cache, sdpa with a KV cache
        assert r["cache_type"]["sdpa"] == "DynamicCache"
        assert r["cache_type"]["polysketch"].endswith("[PolyAttnCacheLayer]")
    # a softmax KV cache grows with the context; the polysketch state does not
    assert rows[1]["cache_bytes"]["sdpa"] > 3 * rows[0]["cache_bytes"]["sdpa"]  # contexts 64 and 256
    assert rows[1]["cache_bytes"]["polysketch"] == rows[0]["cache_bytes"]["polysketch"]
