"""The attention benchmark runs end to end on a tiny grid and writes its table, JSON and plot."""

import json

from hf_polyattn.bench import main, polysketch_flops
from hf_polyattn.cli import main as cli_main


def test_benchmark_small_grid(tmp_path, capsys):
    assert main(["--lengths", "256", "--kinds", "polysketch-local", "linear-elu", "--repeats", "1",
                 "--heads", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| sdpa | 256 |" in out and "| polysketch-local | 256 |" in out and "GFLOP/s achieved" in out
    data = json.loads((tmp_path / "cpu-fp32.json").read_text())
    kinds = {r["kind"] for r in data["rows"]}
    assert kinds == {"sdpa", "polysketch-local", "linear-elu"}
    assert all(r["seconds"] > 0 for r in data["rows"])
    assert (tmp_path / "cpu-fp32.png").stat().st_size > 1000


def test_flop_count_is_linear_in_n():
    assert polysketch_flops(2048, 4, 64, 32, 256, True) == 2 * polysketch_flops(1024, 4, 64, 32, 256, True)


def test_cli(capsys):
    assert cli_main(["kinds"]) == 0
    assert "polysketch" in capsys.readouterr().out
    assert cli_main(["nope"]) == 2


def test_decode_benchmark_small(tmp_path):
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "benchmark_decode", Path(__file__).resolve().parents[1] / "recipes" / "benchmark_decode.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["benchmark_decode"] = mod  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(mod)
    args = mod.BenchArgs(contexts=[64, 128], steps=2, warmup=1, threads=1, layers=1, hidden=64, heads=2, kv_heads=2,
                         sketch_size=4, out=str(tmp_path))
    rows = mod.main(args)
    assert [r["context"] for r in rows] == [64, 128]
    # the recurrent cache does not grow with the context; the KV cache does
    assert rows[0]["poly_bytes"] == rows[1]["poly_bytes"] and rows[1]["sdpa_bytes"] > rows[0]["sdpa_bytes"]
    assert (tmp_path / "cpu-1threads.md").exists()
