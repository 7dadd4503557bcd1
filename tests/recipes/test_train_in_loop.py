"""recipes/experiments/retrieval/train_in_loop.py: the saved model gets the settings first (`hf-polyattn convert
MODEL --set ... --out OUT/start`), then the retrofit trains that folder (its own settings) into OUT; a failed convert
stops before training."""

from __future__ import annotations

from recipes.experiments.retrieval import train_in_loop


def test_convert_then_retrofit_the_converted_folder(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(train_in_loop, "cli", lambda argv: calls.append(argv) or 0)
    out = str(tmp_path / "row")
    rc = train_in_loop.main(["runs/retrieval/hh/model", "--set", "sparse_cache=512", "--set", "sparse_observe=16",
                             "--out", out, "--data", "demo", "--transfer_steps", "3"])
    assert rc == 0
    assert calls == [
        ["convert", "runs/retrieval/hh/model", "--set", "sparse_cache=512", "--set", "sparse_observe=16", "--out",
         f"{out}/start", "--overwrite"],
        ["retrofit", "--model", f"{out}/start", "--kind", "linear", "--output_dir", out, "--data", "demo",
         "--transfer_steps", "3"],
    ]


def test_a_failed_convert_trains_nothing(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(train_in_loop, "cli", lambda argv: calls.append(argv) or 2)
    assert train_in_loop.main(["m", "--set", "sparse_cache=4", "--out", str(tmp_path)]) == 2
    assert [c[0] for c in calls] == ["convert"]
