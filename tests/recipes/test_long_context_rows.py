"""The long-context study's rows in the flags of `hf-polyattn retrofit` reproduce the runs recorded in
recipes/results/long_context/: the same attention (PolyAttnConfig field for field), training and evaluation
arguments, read by the command's own parser (a dry run: nothing is trained)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "recipes" / "experiments" / "long_context"
RESULTS = ROOT / "recipes" / "results" / "long_context"
RECORDED = sorted(p.stem for p in RESULTS.glob("*.json") if p.name != "head_scores_smollm2.json")
# what a row records and the new arguments must give back (the old flat names are the new fields' names)
ARGS = ("transfer_steps", "transfer_lr", "transfer_batch_size", "transfer_schedule", "finetune_steps", "finetune_lr",
        "polyattn_lr", "batch_size", "grad_accum", "finetune_schedule", "warmup_steps", "lora", "lora_r", "lora_alpha",
        "context", "seed", "eval_contexts", "passkey_lengths", "passkey_depths", "long_eval_tokens", "eval_before",
        "eval_context", "eval_stride", "max_eval_tokens", "model", "task", "save_model")


@pytest.fixture(scope="module")
def run_rows():
    sys.path.insert(0, str(STUDY))
    try:
        import run_rows

        yield run_rows
    finally:
        sys.path.remove(str(STUDY))


def test_every_recorded_row_is_in_rows_py(run_rows):
    assert RECORDED and set(RECORDED) <= set(run_rows.ROWS)


@pytest.mark.parametrize("name", RECORDED)
def test_row_reproduces_its_recorded_run(run_rows, name, tmp_path):
    from transformers import LlamaConfig

    from hf_polyattn.training.pipeline import resolve_attention

    rec = json.loads((RESULTS / f"{name}.json").read_text())
    args = run_rows.row_args(name, tmp_path)
    flat = args.flat()
    for key in ARGS:
        assert flat[key] == rec["args"][key], (name, key)
    assert args.data.data == "demo" and Path(rec["args"]["data"]).name == "tinyshakespeare_train.txt"
    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    cfg = resolve_attention(args.model.attention, smollm2)
    if rec["polyattn"] is None:
        assert cfg is None and rec["args"]["attention"] == "softmax"
        return
    got = cfg.to_dict()
    assert {k: got.get(k) for k in rec["polyattn"]} == rec["polyattn"]
    if rec["polyattn"].get("sinks") and "sink_position" not in rec["polyattn"]:
        assert got["sink_position"] == "own"  # run before the field existed: the sinks at their own positions


def test_dry_run_prints_the_commands_from_anywhere(tmp_path):
    proc = subprocess.run([sys.executable, str(STUDY / "run_rows.py"), "--dry_run", "softmax",
                           "lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k", "--runs", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("softmax: hf-polyattn retrofit --kind softmax --model smollm2 --data demo ")
    assert "--kind linear --set feature_map=elu" in lines[1] and "--set softmax_heads=6:0,7:2," in lines[1]
    assert not (tmp_path / "softmax").exists()  # nothing ran
