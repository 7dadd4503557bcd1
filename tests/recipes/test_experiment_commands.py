"""The studies' shell scripts call `hf-polyattn retrofit` (as `python -m hf_polyattn.retrofit`) with flags that
reproduce the runs their results record: each script runs with a stub python that only writes down its command
lines, and each retrofit command line, read by the command's own parser, gives the attention (PolyAttnConfig field
for field) and the stage budgets of the recorded run. Nothing is trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "recipes" / "experiments"
RESULTS = ROOT / "recipes" / "results"
FIXTURES = ROOT / "tests" / "fixtures"

# compare tables: the rows in the order the script's names list them (compare_runs keeps that order)
TABLES = {
    "retrofit_window/ablation.json": ["softmax", "polysketch_r32_window128_proj", "polysketch_window0_proj",
                                      "polysketch_window128", "linear_window128_proj", "polysketch_window16_proj",
                                      "polynomial4_proj"],
    "retrofit_window/demo_budget.json": ["softmax", "polysketch_blocks64", "polysketch_window64",
                                         "polysketch_window64_proj", "polysketch_window64_proj_mix",
                                         "polysketch_window128_proj"],
    "retrofit_window/minilm_sst2_window.json": ["softmax", "linear_window16", "polysketch_window16"],
    "retrofit_window/two_stage.json": ["softmax", "polysketch_window128_proj"],
    "retrofit_window/two_stage_kinds.json": ["softmax", "linear_window128_proj", "polynomial4_proj",
                                             "performer_window128_proj"],
    "retrofit_kinds/smollm2_kinds.json": ["softmax", "bigbird16", "reformer8x32", "taylor_window128_proj"],
    "retrofit_kinds/minilm_sst2_kinds.json": ["softmax", "linformer", "nystrom", "fnet", "bigbird", "reformer"],
}
SCRIPTS = {
    "retrofit_window/run_ablation.sh": "retrofit_window/ablation.json",
    "retrofit_window/run_demo_budget.sh": "retrofit_window/demo_budget.json",
    "retrofit_window/run_demo_budget_more.sh": "retrofit_window/demo_budget.json",
    "retrofit_window/run_minilm_sst2_window.sh": "retrofit_window/minilm_sst2_window.json",
    "retrofit_window/run_smollm2_two_stage.sh": "retrofit_window/two_stage.json",
    "retrofit_window/run_smollm2_two_stage_kinds.sh": "retrofit_window/two_stage_kinds.json",
    "retrofit_kinds/run_smollm2_kinds.sh": "retrofit_kinds/smollm2_kinds.json",
    "retrofit_kinds/run_minilm_sst2_kinds.sh": "retrofit_kinds/minilm_sst2_kinds.json",
    # the runs of these record their whole results.json: recipes/results/retrofit/<name>_results.json
    "retrofit/run_smollm2_tinyshakespeare.sh": "retrofit",
    "retrofit/run_smollm2_linear_local.sh": "retrofit",
    "retrofit/run_minilm_sst2.sh": "retrofit",
    "retrofit/run_minilm_sst2_softmax.sh": "retrofit",
    "retrofit/run_gpt2_scratch_sketch_transfer_minilm_paired.sh": "retrofit",
    "retrofit/run_smollm2_pilot_local_kernel_and_minilm_linear_local.sh": "retrofit",
    "fsdp/run_smollm2_2proc.sh": "fsdp/smollm2-2proc.json",
}
# the stage budgets a full results.json records and the new arguments must give back
BUDGET = ("transfer_steps", "transfer_lr", "transfer_batch_size", "finetune_steps", "finetune_lr", "polyattn_lr",
          "batch_size", "warmup_steps", "lora", "lora_r", "lora_alpha", "context", "eval_context", "eval_stride",
          "max_eval_tokens", "eval_before", "model", "task", "max_length", "num_eval", "fsdp")

STUB = """import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _commands(script: str, tmp_path: Path) -> list[list[str]]:
    """The retrofit command lines ``script`` runs (everything after ``-m hf_polyattn.retrofit``)."""
    stub, log = tmp_path / "stub.py", tmp_path / "log.jsonl"
    stub.write_text(STUB)
    text = (EXPERIMENTS / script).read_text()
    text = text.replace('cd "$(dirname "${BASH_SOURCE[0]}")/../../.."', f'cd "{ROOT}"', 1)
    text = text.replace("P=.venv/bin/python", f'P="{sys.executable} {stub}"', 1)
    copy = tmp_path / "script.sh"
    copy.write_text(text)
    env = {**os.environ, "STUB_LOG": str(log), "OUT": str(tmp_path / "out"),
           "HF_POLYATTN_SST2": str(FIXTURES / "tiny_sst2.tsv")}
    # a script may stop at a later command that reads what the stub did not write (cp of results.json)
    subprocess.run(["bash", str(copy)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [c[c.index("hf_polyattn.retrofit") + 1:] for c in calls if "hf_polyattn.retrofit" in c]


def _recorded(source: str, name: str) -> dict:
    if source == "retrofit":
        return json.loads((RESULTS / "retrofit" / f"{name}_results.json").read_text())
    if source.endswith("smollm2-2proc.json"):
        return json.loads((RESULTS / source).read_text())
    rows = json.loads((RESULTS / source).read_text())["rows"]
    return rows[TABLES[source].index(name)]


def _config(args):
    from transformers import BertConfig, LlamaConfig

    from hf_polyattn.training.pipeline import resolve_attention

    shape = (BertConfig(hidden_size=384, num_attention_heads=12) if args.model.task == "classification"
             else LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3))
    return resolve_attention(args.model.attention, shape)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_reproduces_its_recorded_runs(script, tmp_path):
    from hf_polyattn import cli

    commands = _commands(script, tmp_path)
    assert commands, f"{script} runs no `-m hf_polyattn.retrofit`"
    checked = 0
    for argv in commands:
        args = cli.retrofit_args(cli.build_parser().parse_args(["retrofit", *argv]))
        name = Path(args.train.output_dir).name
        source = SCRIPTS[script]
        if source == "retrofit" and not (RESULTS / "retrofit" / f"{name}_results.json").exists():
            continue  # runs whose results live elsewhere (the pilot's table, the sketch transfers)
        rec = _recorded(source, name)
        cfg = _config(args)
        polyattn = rec.get("polyattn")
        if polyattn is None:
            assert cfg is None, (script, name)
        else:
            got = cfg.to_dict()
            assert {k: got.get(k) for k in polyattn} == polyattn, (script, name)
        flat = args.flat()
        if "args" in rec:  # a whole results.json
            for key in (k for k in BUDGET if k in rec["args"]):  # the older runs predate some fields (fsdp)
                assert flat[key] == rec["args"][key], (script, name, key)
        else:
            assert (flat["transfer_steps"], flat["finetune_steps"]) == (rec["transfer_steps"], rec["finetune_steps"])
        checked += 1
    assert checked, f"{script}: no command matched a recorded run"
