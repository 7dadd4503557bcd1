"""--speed_lengths (``Retrofit.evaluate_speed``): the whole-model bench of the retrofit against its base checkpoint at
the end of a run, the row ``make demo`` prints."""

from __future__ import annotations

import json

import pytest

import hf_polyattn  # noqa: F401  (registers the kinds)
from hf_polyattn.training.pipeline import RetrofitArgs, run


def test_speed_stage_writes_and_prints_the_rows(tiny_dirs, text_file, tmp_path, capsys):
    out = tmp_path / "run"
    res = run(RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file,
                                 attention={"kind": "linear", "window": 8, "sinks": 2, "decay": "gate"},
                                 context=32, eval_context=32, eval_stride=32, max_eval_tokens=64, transfer_steps=1,
                                 eval_before=False, progress=False, speed_lengths="48,96", output_dir=str(out)))
    rows = res["speed"]
    assert [r["length"] for r in rows] == [48, 96]
    for r in rows:
        for name in ("base", "retrofit"):
            assert r[name]["decode_median_ms"] > 0 and r[name]["prefill_best_s"] > 0, (r["length"], name)
        # the retrofit's cache is its window and state, the base's every key: smaller, and not growing with n
        assert r["retrofit"]["cache_bytes"] < r["base"]["cache_bytes"]
    assert rows[0]["retrofit"]["cache_bytes"] == rows[1]["retrofit"]["cache_bytes"]
    assert rows[1]["base"]["cache_bytes"] == 2 * rows[0]["base"]["cache_bytes"]
    md = (out / "speed.md").read_text()
    assert "| 1 | 48 |" in md and "| 1 | 96 |" in md and "SDPA + DynamicCache" in md
    assert [r["length"] for r in json.loads((out / "speed.json").read_text())["rows"]] == [48, 96]
    printed = capsys.readouterr().out
    assert "speed at 96 tokens against the base checkpoint: prefill" in printed
    assert json.loads((out / "results.json").read_text())["speed"][1]["length"] == 96


@pytest.mark.parametrize("value", ["4k", "0", "", "1024,-1"])
def test_speed_lengths_refuses_what_is_not_lengths(tiny_dirs, text_file, value):
    with pytest.raises(ValueError, match="--speed_lengths must be comma-separated prompt lengths"):
        RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file, attention="linear", speed_lengths=value)


def test_speed_lengths_needs_a_retrofitted_causal_lm(tiny_dirs, text_file):
    with pytest.raises(ValueError, match="--speed_lengths times a retrofitted causal LM"):
        RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file, attention="softmax", transfer_steps=0,
                           speed_lengths="64")


def test_speed_lengths_refuses_a_sharded_run(tiny_dirs, text_file):
    with pytest.raises(ValueError, match="--speed_lengths with --fsdp"):
        RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file, attention="linear", speed_lengths="64",
                           fsdp=True)
