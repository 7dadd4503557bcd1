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


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def quick_tables(tmp_path_factory):
    """One tiny paper_tables.py grid (all kinds, context 64, the bundled Tiny Shakespeare), shared by the tests
    below."""
    out = tmp_path_factory.mktemp("paper_tables")
    mod = _load("paper_tables")
    rec = mod.main(["--quick", "--contexts", "64", "--steps", "16", "--eval_tokens", "512", "--threads", "1",
                    "--out", str(out)])
    return mod, rec, out


def test_paper_tables_quick(quick_tables):
    mod, rec, tmp_path = quick_tables
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["kinds"] == mod.PAPER_KINDS
    md = (tmp_path / "tables.md").read_text()
    for kind in mod.PAPER_KINDS:  # every attention kind is a row of both tables
        assert md.count(f"| {mod.LABELS[kind]} |") >= 3, kind
    assert {r["kind"] for r in rec["results"]} == set(mod.PAPER_KINDS)
    for r in rec["results"]:
        assert r["finite"] and math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["steps_per_s"]["per_cpu_s"] > 0
        # training from scratch: the loss must fall clearly below its start (~ln 66 = 4.19) in 16 steps
        assert r["final_loss"] < r["initial_loss"] - 0.5, (r["kind"], r["initial_loss"], r["final_loss"])
        # a character model beats the uniform distribution over its 66 symbols
        assert r["perplexity"] < 66


def test_paper_tables_long_section(quick_tables, tmp_path):
    """fill_section.py lays a seed x context grid of real paper_tables records out as Tables 1-2 and computes the
    gaps, the paper comparison, the speed crossover and the non-finite list from them (numbers set here)."""
    _, rec, _ = quick_tables
    spec = importlib.util.spec_from_file_location(
        "fill_long", ROOT / "recipes/experiments/paper_tables_long/fill_section.py")
    fill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fill)
    # seed -> kind -> (perplexity, steps per CPU-s); softmax 10 in both seeds
    chosen = {0: {"softmax": (10.0, 4.0), "polysketch_learned": (10.8, 2.0), "performer": (9.5, 5.0)},
              1: {"softmax": (10.0, 4.0), "polysketch_learned": (11.2, 2.0), "performer": (10.1, 4.5)}}
    for seed, per_kind in chosen.items():
        r = json.loads(json.dumps(rec))
        r["results"] = [x for x in r["results"] if x["kind"] in per_kind and x["context"] == 64]
        for x in r["results"]:
            x["perplexity"], x["steps_per_s"]["per_cpu_s"] = per_kind[x["kind"]]
            x["finite"] = not (seed == 1 and x["kind"] == "performer")
        (tmp_path / f"seed{seed}/ctx64").mkdir(parents=True)
        (tmp_path / f"seed{seed}/ctx64/results.json").write_text(json.dumps(r))
    # longer runs at one context, one call per seed and kind: softmax 9, learned polysketch 9.9 (+10 %)
    for kind, value in (("softmax", 9.0), ("polysketch_learned", 9.9)):
        r = json.loads(json.dumps(rec))
        r["setup"]["steps"] = 48
        r["results"] = [x for x in r["results"] if x["kind"] == kind and x["context"] == 64]
        r["results"][0]["perplexity"] = value
        (tmp_path / f"long2048/seed0/{kind}").mkdir(parents=True)
        (tmp_path / f"long2048/seed0/{kind}/results.json").write_text(json.dumps(r))
    out = tmp_path / "SECTION.md"
    assert fill.main(["--dir", str(tmp_path), "--out", str(out)]) == 0
    md = out.read_text()
    assert "| Polysketch (learned) | 11.000 (10.800 / 11.200) |" in md
    assert "| Polysketch (learned) | +10.0% (+8.0 / +12.0) |" in md
    assert "| Performer | -2.0% (-5.0 / +1.0) |" in md
    assert "| Performer | 4.75 (1.19x) |" in md and "| Polysketch (learned) | 2.00 (0.50x) |" in md
    assert "+8.0% to +12.0%, mean +10.0%; 1 of 2 inside the paper's 6-10 %" in md
    assert "Performer at 64 faster than softmax (sdpa)" in md
    assert "Non-finite losses or perplexities: Performer @ 64, seed 1." in md
    assert (tmp_path / "ppl_vs_context.png").stat().st_size > 0
    assert "**Trained longer at context 64: 48 steps**" in md
    # seed 0, mean, gap, then the grid's value for the same seed (10.8) next to it
    assert "| Polysketch (learned) | 9.900 | 9.900 | +10.0% | 10.800 |" in md
    assert (tmp_path / "long2048/loss_curves_longer.png").stat().st_size > 0
    # runs with different setups (besides the seed) are not averaged together
    r = json.loads((tmp_path / "seed1/ctx64/results.json").read_text())
    r["setup"]["lr"] = 1.0
    (tmp_path / "seed1/ctx64/results.json").write_text(json.dumps(r))
    with pytest.raises(SystemExit, match="differ in their setup"):
        fill.main(["--dir", str(tmp_path), "--out", str(out)])


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


def test_e2e_speed_gpu_defaults_parse_without_a_gpu():
    """`--device cuda --dtype bfloat16` plans GPT-2 small at 4k..32k for training and decoding (no GPU touched)."""
    mod = _load("e2e_speed")
    args = mod.parse(["--device", "cuda", "--dtype", "bfloat16"], check_device=False)
    assert (args.layers, args.hidden, args.heads) == (12, 768, 12)  # GPT-2 small
    assert args.train_lengths == [4096, 8192, 16384, 32768] and args.decode_lengths == [4096, 8192, 16384, 32768]
    assert (args.dec_layers, args.dec_hidden, args.dec_heads) == (12, 768, 12)
    assert args.dtype == "bfloat16" and args.reps >= 2 and args.kinds == list(mod.TRAIN_KINDS)
    assert Path(args.out) == ROOT / "recipes/results/e2e_speed/cuda-bfloat16"  # never the CPU record
    assert mod.parse(["--device", "cuda"], check_device=False).dtype == "bfloat16"
    quick = mod.parse(["--device", "cuda", "--quick"], check_device=False)
    assert quick.train_lengths == [128, 256] and quick.layers == 1


def test_e2e_speed_cpu_defaults_unchanged():
    mod = _load("e2e_speed")
    args = mod.parse([])
    assert args.train_lengths == [1024, 2048, 4096, 8192] and args.decode_lengths == [512, 1024, 2048, 4096, 8192]
    assert (args.layers, args.hidden, args.heads, args.reps, args.warmup, args.dtype) == (2, 768, 12, 1, 0, "float32")
    assert (args.dec_layers, args.dec_hidden, args.dec_heads, args.dec_steps, args.dec_warmup) == (4, 256, 4, 16, 3)
    assert Path(args.out) == ROOT / "recipes/results/e2e_speed"


@pytest.mark.parametrize("argv, message", [
    (["--train_lengths", "0"], "expected an integer >= 1"),
    (["--reps", "two"], "expected an integer >= 1"),
    (["--dec_hidden", "100", "--dec_heads", "3"], "not a multiple of the 3 heads"),
    (["--kinds", "softmax"], "invalid choice"),
    (["--dtype", "float16"], "invalid choice"),
])
def test_e2e_speed_bad_arguments_exit_2(argv, message, capsys):
    mod = _load("e2e_speed")
    with pytest.raises(SystemExit) as stop:
        mod.parse(argv, check_device=False)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_e2e_speed_cuda_without_gpu_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as stop:
        _load("e2e_speed").parse(["--device", "cuda"])
    assert stop.value.code == 2 and "cuda" in capsys.readouterr().err


def test_e2e_speed_records_oom_and_goes_on(tmp_path, monkeypatch):
    """An out-of-memory error of one kind at one n becomes an OOM cell; the other kinds and lengths still run."""
    import torch

    mod = _load("e2e_speed")
    real = mod.gpt2
    oom_kinds = (mod.TRAIN_KINDS["linear"], mod.DECODE_KINDS["polysketch_local"])

    def gpt2(*a, **kw):
        model = real(*a, **kw)
        if a[5] in oom_kinds:
            forward = model.forward

            def guarded(*fa, **fk):
                ids = fk.get("input_ids", fa[0] if fa else None)
                if ids.shape[1] >= 256:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
                return forward(*fa, **fk)

            model.forward = guarded
        return model

    monkeypatch.setattr(mod, "gpt2", gpt2)
    res = mod.main(["--quick", "--threads", "1", "--kinds", "linear", "performer", "--out", str(tmp_path)])
    small, large = res["train"]["rows"]
    assert small["seconds"]["linear"] > 0 and large["seconds"]["linear"] is None and large["oom"] == ["linear"]
    assert large["seconds"]["performer"] > 0 and large["seconds"]["sdpa"] > 0
    assert large["sdpa_over_kind"]["linear"] is None and large["sdpa_over_kind"]["performer"] > 0
    small, large = res["decode"]["rows"]
    assert large["ms_per_token"]["polysketch_local"] is None and large["oom"] == ["polysketch_local"]
    assert large["ms_per_token"]["polysketch"] > 0 and large["cache_type"]["polysketch_local"] == "OOM"
    md = (tmp_path / "tables.md").read_text()
    assert "| 256 | " in md and md.count("OOM |") >= 2
    assert json.loads((tmp_path / "results.json").read_text())["train"]["rows"][1]["seconds"]["linear"] is None
