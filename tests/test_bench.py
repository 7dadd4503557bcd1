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
