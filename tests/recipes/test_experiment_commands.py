"""The studies' rows call `hf-polyattn retrofit` (as `python -m hf_polyattn.retrofit`) with flags that reproduce the
runs their results record: the runner's dry run (`recipes/experiments/run.py STUDY --dry-run`) prints every row's
command line, and each retrofit command line, read by the command's own parser, gives the attention (PolyAttnConfig
field for field), the stage budgets and the evaluation of the recorded run, row by row of the table it belongs to.
Nothing is trained."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "recipes" / "experiments"
RESULTS = ROOT / "recipes" / "results"
FIXTURES = ROOT / "tests" / "fixtures"

# the studies whose rows are retrofits, and the tables each one's results hold (recipes/results/<study>/<table>.json)
STUDIES = {
    "retrofit_window": ["ablation", "demo_budget", "minilm_sst2_window", "two_stage", "two_stage_kinds"],
    "retrofit_kinds": ["minilm_sst2_kinds", "smollm2_kinds"],
}


def _module(path: Path, name: str):
    """The Python file ``path`` imported as ``name`` (the studies are not a package path)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(study: str):
    """The study's ``rows.py`` (its TABLES: the rows of each table, in the order compare_runs wrote them)."""
    return _module(EXPERIMENTS / study / "rows.py", f"rows_{study}")


def _commands(study: str, tmp_path: Path) -> list[list[str]]:
    """The retrofit command lines the runner prints for ``study`` (everything after ``-m hf_polyattn.retrofit``),
    run from an unrelated directory as a user would."""
    env = {**os.environ, "HF_POLYATTN_SST2": str(FIXTURES / "tiny_sst2.tsv")}
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "run.py"), study, "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [shlex.split(line) for line in proc.stdout.splitlines()]
    return [c[c.index("hf_polyattn.retrofit") + 1:] for c in calls if "hf_polyattn.retrofit" in c]


def _config(args):
    from transformers import BertConfig, LlamaConfig

    from hf_polyattn.training.pipeline import resolve_attention

    shape = (BertConfig(hidden_size=384, num_attention_heads=12) if args.model.task == "classification"
             else LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3))
    return resolve_attention(args.model.attention, shape)


@pytest.mark.parametrize("study", list(STUDIES))
def test_rows_reproduce_their_recorded_runs(study, tmp_path):
    from hf_polyattn import cli

    tables = _rows(study).TABLES
    assert sorted(tables) == sorted(STUDIES[study])
    commands = _commands(study, tmp_path)
    assert len(commands) == sum(len(rows) for rows in tables.values()), f"{study}: a row runs no retrofit"
    checked = set()
    for argv in commands:
        args = cli.retrofit_args(cli.build_parser().parse_args(["retrofit", *argv]))
        out = Path(args.train.output_dir)
        assert out.parts[:2] == ("runs", study), argv
        row = f"{out.parent.name}/{out.name}"
        table = json.loads((RESULTS / study / f"{out.parent.name}.json").read_text())
        assert len(table["rows"]) == len(tables[out.parent.name]), (study, out.parent.name)
        rec = table["rows"][tables[out.parent.name].index(row)]
        assert rec["attention"] == args.model.kind, (study, row)
        cfg = _config(args)
        polyattn = rec.get("polyattn")
        if polyattn is None:
            assert cfg is None, (study, row)
        else:
            got = cfg.to_dict()
            assert {k: got.get(k) for k in polyattn} == polyattn, (study, row)
        flat = args.flat()
        assert (flat["transfer_steps"], flat["finetune_steps"]) == (rec["transfer_steps"], rec["finetune_steps"])
        assert (flat["model"], flat["task"]) == (table["model"], table["task"]), (study, row)
        if table["task"] == "causal_lm":  # the held-out tokens and the windows that scored them
            assert flat["max_eval_tokens"] == table["data"]["eval_tokens"], (study, row)
            assert (flat["eval_context"], flat["eval_stride"]) == (table["eval"]["context"], table["eval"]["stride"])
        else:
            assert flat["num_eval"] == table["data"]["eval_rows"] == table["eval"]["examples"], (study, row)
        checked.add(row)
    assert checked == {r for rows in tables.values() for r in rows}, study


@pytest.mark.parametrize("study", _module(EXPERIMENTS / "run.py", "experiments_run").studies())
def test_every_retrofit_row_is_a_valid_command(study, tmp_path):
    """Every study's retrofit rows, not only the tabulated ones, still parse and validate as the command would before
    training (a preset's reconfigure merged with the row's own: the retrieval study's ``--reconfigure
    sparse_cache=0`` once met the linear-only preset's sparse_score='attention', which needs a cache, and the row
    failed at its first line)."""
    from hf_polyattn import cli

    for argv in _commands(study, tmp_path):
        cli.retrofit_args(cli.build_parser().parse_args(["retrofit", *argv]))
