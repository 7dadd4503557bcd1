"""The attention benchmark runs end to end on a tiny grid and writes its table, JSON and plot."""

import importlib.util
import json
import os
import subprocess

import pytest
import torch

from hf_polyattn import bench
from hf_polyattn.bench import causal_flops, kind_rows, main
from hf_polyattn.cli import main as cli_main


def test_benchmark_small_grid(tmp_path, capsys):
    assert main(["--lengths", "256", "--kinds", "polysketch-local", "linear-elu", "--repeats", "1",
                 "--heads", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| sdpa | 256 |" in out and "| polysketch-local | 256 |" in out and "GFLOP/s achieved" in out
    data = json.loads((tmp_path / "cpu-fp32.json").read_text())
    kinds = {r["kind"] for r in data["rows"]}
    assert kinds == {"sdpa", "polysketch-local", "linear-elu"}
    assert (data["complete"], data["cells_done"], data["cells_planned"]) == (True, 3, 3)
    assert all(r["seconds"] > 0 for r in data["rows"])
    assert (tmp_path / "cpu-fp32.png").stat().st_size > 1000
    # the roofline rows: both paths counted, from this run's time and torch.mm's GFLOP/s
    roofline = out.split("Roofline")[1]
    assert "| linear-elu | 256 |" in roofline and "| polysketch-local | 256 |" in roofline
    for r in data["rows"]:
        if r["kind"] == "sdpa":
            assert "gflops" not in r
            continue
        assert r["gflop"] == causal_flops(kind_rows()[r["kind"]], 256, 2, 64) / 1e9
        assert r["gflops"] == pytest.approx(r["gflop"] / r["seconds"], rel=1e-12)
        assert r["mm_share"] == pytest.approx(r["gflops"] / data["mm_gflops"], rel=1e-12)


def test_flop_counts():
    rows = kind_rows()
    local, plain, linear = rows["polysketch-local"], rows["polysketch"], rows["linear-elu"]
    assert causal_flops(local, 2048, 4, 64) == 2 * causal_flops(local, 1024, 4, 64) == 2 * 2 * causal_flops(
        local, 1024, 2, 64)
    # r = 32: F = 528 features, e = 65 value columns, b = 256: state 7 x 2Fe, sketch 3 x 2 x 2 x 2dr, exact local
    # blocks 3 x (2bd + 2be) (the count the benchmark printed for polysketch-local before the other rows joined it)
    assert causal_flops(local, 1, 1, 64) == (7 * 2 * 528 * 65 + 3 * 2 * 2 * 2 * 64 * 32
                                             + 3 * (2 * 256 * 64 + 2 * 256 * 65))
    # without local blocks the diagonal blocks go through the features: 3 x (2bF + 2be)
    assert causal_flops(plain, 1, 1, 64) - causal_flops(local, 1, 1, 64) == 3 * 2 * 256 * (528 - 64)
    # elu + 1: F = d, no feature matmul
    assert causal_flops(linear, 1, 1, 64) == 7 * 2 * 64 * 65 + 3 * (2 * 256 * 64 + 2 * 256 * 65)
    # a 128-token window adds its tiles of 2w candidate keys, 3 x (2 x 2wd + 2 x 2we)
    assert causal_flops(rows["linear-window128"], 1, 1, 64) - causal_flops(linear, 1, 1, 64) == 3 * 4 * 128 * 129
    # the demo's recipe: its 4 sinks add 3 x (2 x 4d + 2 x 4e); decay, qk_norm, window_mix are elementwise
    recipe = rows["linear-elu-window128-gate"]
    plain = {"kind": "linear", "feature_map": "elu", "window": 128, "block_size": recipe["block_size"]}
    assert causal_flops(recipe, 1, 1, 64) - causal_flops(plain, 1, 1, 64) == 3 * (2 * 4 * 64 + 2 * 4 * 65)
    for kind in ("performer", "taylor", "polysketch-cumsum", "polynomial-exact", "sliding-window128",
                 "delta-window128"):
        assert causal_flops(rows[kind], 1024, 4, 64) is None, kind


def test_cli(capsys):
    assert cli_main(["kinds"]) == 0
    assert "polysketch" in capsys.readouterr().out
    assert cli_main(["nope"]) == 2


def test_decode_benchmark_small(tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    monkeypatch.syspath_prepend(str(recipes))  # the recipes import their siblings (_defaults, _machine, ...)
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


# ----------------------------------------------------------------------------------------------- GPU defaults


def _resolved(argv):
    return bench.resolve(bench.build_parser().parse_args(argv))


def test_cuda_defaults():
    args = _resolved(["--device", "cuda"])
    assert (args.dtype, args.heads, args.head_dim) == ("bf16", 16, 64)
    assert args.lengths == [2**k for k in range(11, 18)]  # 2k .. 128k
    assert args.kinds[0] == "sdpa" and set(args.kinds) == {*bench.kind_rows(), "fla-linear-elu"}
    assert bench.output_tag(args) == "cuda-bf16" and args.out == bench.DEFAULT_OUT
    assert args.repeats > 1  # best of N
    cells = bench.plan(args)
    assert ("polysketch-local", 131072) in [(k, n) for n, k in cells]
    assert max(n for n, k in cells if k == "polynomial-exact") == bench.MAX_LEN["polynomial-exact"]


def test_cpu_defaults_unchanged():
    args = _resolved([])
    assert (args.dtype, args.heads, args.head_dim, args.repeats, args.threads) == ("fp32", 4, 64, 3, 2)
    assert args.lengths == [1024, 2048, 4096, 8192, 16384, 32768]
    assert args.kinds == list(bench.kind_rows())  # no fla row on CPU
    assert bench.output_tag(args) == "cpu-fp32"
    quick = _resolved(["--quick"])
    assert quick.lengths == [1024, 2048] and quick.repeats == 1


def test_cuda_without_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as stop:
        main(["--device", "cuda", "--out", "/nonexistent/never-written"])
    assert stop.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_worker_records_oom(monkeypatch):
    import argparse

    args = argparse.Namespace(threads=1, device="cpu", dtype="fp32", heads=2, head_dim=8, repeats=1)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", oom)
    row = bench.worker("sdpa", 64, args)
    assert row["oom"] and "seconds" not in row and "Tried to allocate" in row["error"]

    def broken(*a, **k):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # only OOM becomes a row
        bench.worker("sdpa", 64, args)


def test_grid_goes_on_after_oom_and_writes_the_cuda_files(tmp_path):
    """The GPU output path without a GPU: cells come from a stand-in, the table, JSON and plot are real."""
    args = _resolved(["--device", "cuda", "--lengths", "2048", "4096", "8192",
                      "--kinds", "polysketch", "performer", "fla-linear-elu", "--out", str(tmp_path)])
    ms = {"sdpa": 10.0, "polysketch": 4.0, "performer": 8.0}  # stand-in times, in ms
    calls = []

    def cell(kind, n, a):
        calls.append((kind, n))
        if kind == "fla-linear-elu":
            return bench.run_cell(kind, n, a)  # the real guard: no fla here, no subprocess
        if kind == "performer" and n == 4096:
            return {"kind": kind, "n": n, "oom": True, "error": "OOM: CUDA out of memory"}
        return {"kind": kind, "n": n, "seconds": ms[kind] * n / 2048 / 1e3, "peak_bytes": {"sdpa": 2, "polysketch": 1,
                                                                                         "performer": 4}[kind] * 2**20}

    rows = bench.run_grid(args, cell=cell, progress=False)
    assert ("performer", 8192) not in calls  # not run after its OOM at 4096 ...
    assert ("sdpa", 8192) in calls and ("polysketch", 8192) in calls  # ... while the others go on
    by = {(r["kind"], r["n"]): r for r in rows}
    assert by[("polysketch", 4096)]["sdpa_over_kind"] == pytest.approx(10.0 / 4.0)
    assert by[("performer", 2048)]["memory_over_sdpa"] == 2.0
    assert by[("polysketch", 2048)]["ms"] == pytest.approx(4.0)
    assert by[("performer", 8192)]["oom"] and "OOM at n=4096" in by[("performer", 8192)]["error"]
    info = {"gpu": "(no GPU: test stand-in)", "torch": "x", "cuda": "y"}
    bench.write_outputs(rows, args, where="test stand-in, no GPU", info=info, gflops_mm=1.0, command="test")
    md = (tmp_path / "cuda-bf16.md").read_text()
    assert "| kind | n | time (ms) | SDPA time / time | peak memory (MiB) | memory / SDPA memory |" in md
    assert "| polysketch | 4096 | 8.00 | 2.50x | 1 | 0.50 |" in md
    assert "| performer | 4096 | OOM | | | |" in md
    assert "| performer | 8192 | OOM (not run: OOM at n=4096) | | | |" in md
    if importlib.util.find_spec("fla") is None:
        assert "| fla-linear-elu | 2048 | not installed (pip install fla-core) | | | |" in md
    data = json.loads((tmp_path / "cuda-bf16.json").read_text())
    assert data["machine_info"] == info and data["settings"]["heads"] == 16 and data["settings"]["dtype"] == "bf16"
    assert {r["kind"] for r in data["rows"]} == {"sdpa", "polysketch", "performer", "fla-linear-elu"}
    assert (tmp_path / "cuda-bf16.png").stat().st_size > 1000
    assert not (tmp_path / "cpu-fp32.md").exists()


def test_bench_never_imports_the_cli():
    """The CLI depends on bench, never the reverse: building bench's own parser leaves hf_polyattn.cli unimported."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sys, hf_polyattn.bench as b; b.build_parser('bench').format_help(); "
            "print('hf_polyattn.cli' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------- stopped runs

# the keys of a complete run's JSON before the files were written after every cell; the new ones say how much of
# the grid they hold
JSON_KEYS = {"machine", "machine_info", "date", "command", "settings", "batch", "mm_gflops", "rows"}
PROGRESS_KEYS = {"complete", "cells_done", "cells_planned"}


def _stand_in(monkeypatch, stop_at=None):
    """Cells from a stand-in (no worker processes): each (kind, n) gets n / 1e4 s; the ``stop_at``-th cell raises
    KeyboardInterrupt, as Ctrl-C in the middle of a cell does."""
    calls = []

    def cell(kind, n, args):
        calls.append((kind, n))
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return {"kind": kind, "n": n, "seconds": n / 1e4, "all_seconds": [n / 1e4], "peak_bytes": n * 1024}

    monkeypatch.setattr(bench, "run_cell", cell)
    monkeypatch.setattr(bench, "mm_gflops", lambda args: 1.0)
    return calls


def test_a_stopped_grid_keeps_every_cell_it_measured(tmp_path, monkeypatch, capsys):
    argv = ["--lengths", "64", "128", "--kinds", "linear-elu", "--repeats", "1", "--out", str(tmp_path)]
    (tmp_path / "cpu-fp32.png").write_bytes(b"an earlier run's plot")
    _stand_in(monkeypatch, stop_at=4)  # of the 4 cells: sdpa and linear-elu at 64, then at 128
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert "stopped after 3 of 4 cells" in capsys.readouterr().err
    data = json.loads((tmp_path / "cpu-fp32.json").read_text())
    assert set(data) == JSON_KEYS | PROGRESS_KEYS
    assert (data["complete"], data["cells_done"], data["cells_planned"]) == (False, 3, 4)
    assert [(r["kind"], r["n"]) for r in data["rows"]] == [("sdpa", 64), ("linear-elu", 64), ("sdpa", 128)]
    linear = data["rows"][1]
    assert linear["sdpa_over_kind"] == 1.0 and linear["gflops"] > 0  # ratios and roofline of the partial rows too
    md = (tmp_path / "cpu-fp32.md").read_text()
    assert "Partial: 3 of 4 cells done; the run did not finish" in md
    assert "| sdpa | 128 | 0.013 |" in md and "| linear-elu | 128 |" not in md
    assert not (tmp_path / "cpu-fp32.png").exists()  # the earlier run's plot is not left beside this table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu-fp32.json", "cpu-fp32.md"]  # no temporary files

    _stand_in(monkeypatch)  # the same run, finished: the files say complete
    assert main(argv) == 0
    data = json.loads((tmp_path / "cpu-fp32.json").read_text())
    assert set(data) == JSON_KEYS | PROGRESS_KEYS
    assert (data["complete"], data["cells_done"], data["cells_planned"]) == (True, 4, 4) and len(data["rows"]) == 4
    assert "Partial" not in (tmp_path / "cpu-fp32.md").read_text()
    assert (tmp_path / "cpu-fp32.png").stat().st_size > 1000


def test_files_are_written_after_every_cell(tmp_path, monkeypatch):
    """What is on disk when each cell starts: the cells before it, never more, never fewer."""
    args = _resolved(["--lengths", "64", "128", "--kinds", "linear-elu", "--out", str(tmp_path)])
    seen = []

    def cell(kind, n, a):
        path = tmp_path / "cpu-fp32.json"
        seen.append(json.loads(path.read_text())["cells_done"] if path.exists() else 0)
        return {"kind": kind, "n": n, "seconds": 1.0, "peak_bytes": 1}

    monkeypatch.setattr(bench, "run_cell", cell)
    monkeypatch.setattr(bench, "mm_gflops", lambda args: 1.0)
    assert bench.run(args, command="test") == 0
    assert seen == [0, 1, 2, 3]
    assert json.loads((tmp_path / "cpu-fp32.json").read_text())["complete"] is True


def test_an_interrupted_write_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    bench.write_atomic(path, "old")

    def stop(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.os, "replace", stop)
    with pytest.raises(KeyboardInterrupt):
        bench.write_atomic(path, "new, never complete")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["t.json"]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:  # no /proc children list here
        return []


def test_sigterm_leaves_a_parseable_partial_json_and_exits_non_zero(tmp_path):
    """`timeout` sends SIGTERM: the real benchmark on the CPU, stopped once its first cell is on disk."""
    import os
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "cpu-fp32.json"
    proc = subprocess.Popen([sys.executable, "-m", "hf_polyattn.bench", "--lengths", "16", "32", "64", "--kinds",
                             "linear-elu", "--repeats", "1", "--heads", "1", "--head-dim", "8", "--threads", "1",
                             "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.exists(), proc.communicate(timeout=60)
        workers = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]  # not swallowed: the exit status of a SIGTERM
    data = json.loads(path.read_text())
    assert data["complete"] is False and data["cells_planned"] == 6
    assert 1 <= data["cells_done"] == len(data["rows"]) < 6 and all(r["seconds"] > 0 for r in data["rows"])
    assert "Partial:" in (tmp_path / "cpu-fp32.md").read_text() and "stopped after" in err
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    for pid in workers:  # the running cell's worker went with it
        assert not os.path.exists(f"/proc/{pid}") or b"--worker" not in open(f"/proc/{pid}/cmdline", "rb").read()


def test_the_machine_line_states_the_allocator(monkeypatch):
    """glibc's MALLOC_* settings and a preloaded allocator change CPU times (large temporaries' page faults): a run
    states them, or that it ran on the default."""
    import argparse

    from hf_polyattn import bench

    for key in [k for k in __import__("os").environ if k.startswith("MALLOC_") or k == "LD_PRELOAD"]:
        monkeypatch.delenv(key)
    args = argparse.Namespace(device="cpu", threads=2, dtype="fp32")
    assert bench.machine(args).endswith("; allocator: default")
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "68719476736")
    assert bench.machine(args).endswith("; allocator: MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=68719476736")


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_stop_while_the_worker_starts_kills_the_worker(monkeypatch, request, signum):
    """A SIGTERM or Ctrl-C that arrives while Popen starts the worker (here: right after the real Popen, before it
    returns) stops the run once the worker is owned, and the worker goes with it instead of running on."""
    import signal
    import sys
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")

    started = []
    real_popen = subprocess.Popen

    def popen(*a, **kw):
        proc = real_popen(*a, **kw)
        started.append(proc)
        signal.raise_signal(getattr(signal, signum))  # what the OS delivers in that window
        return proc

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    # a process started in the background (nohup, `&` in a script) ignores Ctrl-C: give this one Python's own
    # handler, as an interactive run has it (the full suite run so failed here), and the previous one back after
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, before))
    expected = SystemExit if signum == "SIGTERM" else KeyboardInterrupt
    with bench.sigterm_exits(), pytest.raises(expected) as info:
        bench.run_worker([sys.executable, "-c", "import time; time.sleep(120)"], env=dict(os.environ), timeout=200)
    if signum == "SIGTERM":
        assert info.value.code == 128 + signal.SIGTERM
    (proc,) = started
    assert proc.wait(timeout=30) == -signal.SIGKILL  # killed, not left to sleep its 120 s
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are given back


def test_run_worker_returns_what_subprocess_run_returns():
    import sys

    res = bench.run_worker([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                            "sys.exit(3)"], env=dict(os.environ), timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (3, "out\n", "err\n")
    with pytest.raises(subprocess.TimeoutExpired):
        bench.run_worker([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ), timeout=1)
