"""The recipes' layout: runnable from any directory, experiment scripts with one convention, results without code,
one model card, sections that regenerate byte for byte from the recorded results."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
EXPERIMENTS = RECIPES / "experiments"
RESULTS = RECIPES / "results"

# every recipe with a command line; those with a --data default must point at an existing file
RECIPES_WITH_DATA = ["train_gpt2_scratch", "paper_tables"]
# retrofit / evaluate: the installed `hf-polyattn retrofit` (--data is the run's choice or its preset's); demo: the
# demo preset through the Python API
RECIPES_WITHOUT_DATA = ["retrofit", "evaluate", "demo", "thesis_reversal", "sketch_accuracy", "benchmark_decode",
                        "benchmark_split_keys", "benchmark_backends", "benchmark_attention", "inspect_triton_sm90",
                        "memory_layers", "time_transfer_step", "benchmark_slot_step"]
# recipes whose --out default is their folder under recipes/results/ (e2e_speed picks it per device, tested apart)
RESULTS_WRITERS = ["benchmark_attention", "benchmark_decode", "benchmark_split_keys", "benchmark_backends",
                   "paper_tables", "thesis_reversal", "sketch_accuracy", "inspect_triton_sm90", "memory_layers",
                   "benchmark_slot_step"]


def _helps(cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([sys.executable, str(RECIPES / f"{name}.py"), "--help"], cwd=cwd, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in RECIPES_WITH_DATA + RECIPES_WITHOUT_DATA}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    """`python <repo>/recipes/NAME.py --help` for every recipe, all started at once from an unrelated directory;
    under pytest-xdist run by the first worker that needs them and read by the other from the session's shared
    folder (each --help imports torch: the 14 took 35 s of each worker's time)."""
    pytest.importorskip("transformers")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        cwd = tmp_path_factory.mktemp("elsewhere")
        return cwd, _helps(cwd)
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # this session's, above each worker's own
    cwd, record = shared / "recipe_helps", shared / "recipe_helps.json"
    with FileLock(str(record) + ".lock"):
        if not record.exists():
            cwd.mkdir()
            record.write_text(json.dumps(_helps(cwd)))
    return cwd, {name: tuple(v) for name, v in json.loads(record.read_text()).items()}


def _option_default(help_text: str, option: str) -> str:
    flat = re.sub(r"\s+", " ", help_text)
    m = re.search(rf"(?:^| ){re.escape(option)} [A-Z_]+ (?:[^-]|-(?!-))*?\(default: ([^()]+?)\)", flat)
    assert m, f"no default shown for {option} in: {flat[:3000]}"
    # argparse wraps long paths after a hyphen ("/work/ci-" / "check/recipes/..."): the default has no spaces
    return m.group(1).replace(" ", "")


@pytest.mark.parametrize("name", RECIPES_WITH_DATA)
def test_help_from_elsewhere_default_data_exists(helps, name):
    cwd, out = helps
    rc, stdout, stderr = out[name]
    assert rc == 0, stderr[-3000:]
    default = _option_default(stdout, "--data")
    assert (cwd / default).is_file(), f"{name}: --data default {default!r} does not exist seen from {cwd}"


@pytest.mark.parametrize("name", RECIPES_WITHOUT_DATA)
def test_help_from_elsewhere(helps, name):
    _, out = helps
    rc, _, stderr = out[name]
    assert rc == 0, stderr[-3000:]


@pytest.mark.parametrize("name", RESULTS_WRITERS)
def test_help_from_elsewhere_results_go_to_the_repository(helps, name):
    """Run from another directory, results land in <repo>/recipes/results/<name>, where build_results.py reads
    them (benchmark_attention.py wrote to ./recipes/results/benchmark_attention of the working directory)."""
    _, out = helps
    rc, stdout, stderr = out[name]
    assert rc == 0, stderr[-3000:]
    assert _option_default(stdout, "--out") == str(RESULTS / name)


def test_boolean_help_is_truthful(helps):
    """--no_resume next to --resume (the negation of a boolean that defaults to True) must not claim
    '(default: False)'; the attention's booleans are PolyAttnConfig fields, set with --set (qk_norm=true)."""
    _, out = helps
    flat = re.sub(r"\s+", " ", out["retrofit"][1])
    assert "--resume false or --no_resume turns it off) (default: True)" in flat
    entries = [re.sub(r"\s+", " ", e).strip() for e in re.split(r"\n  (?=-)", out["retrofit"][1])]
    negations = [m.groups() for e in entries if (m := re.fullmatch(r"--no_(\w+), --no-[\w-]+ (.*)", e))]
    assert {name for name, _ in negations} == {"resume", "eval_before", "save_model", "progress"}
    for name, text in negations:
        assert text == f"same as --{name} false", (name, text)


def _studies() -> list[str]:
    return sorted(p.parent.name for p in EXPERIMENTS.glob("*/rows.py") if p.parent.name != "long_context")


def test_every_study_is_inputs_and_the_runner():
    """PEFT's method_comparison shape: each study folder holds its inputs (rows.py) and its section writer, no shell
    scripts; the runner lists them from any directory."""
    assert _studies() == ["gemma3_270m", "paper_tables_long", "retrieval", "retrofit_kinds", "retrofit_window",
                          "rope_fft", "second_family", "thesis_reversal"]
    assert sorted(EXPERIMENTS.rglob("*.sh")) == []
    for study in _studies():
        assert (EXPERIMENTS / study / "fill_section.py").exists(), study
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "run.py")], cwd="/", capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split() == _studies(), proc.stderr


@pytest.mark.parametrize("study", _studies())
def test_study_commands_name_what_exists(study, tmp_path):
    """The runner's dry run (from an unrelated directory) prints one command per row and then AFTER; every script
    and module a command names exists in the checkout, every row writes under runs/ or recipes/results/."""
    env = {**os.environ, "HF_POLYATTN_SST2": str(ROOT / "tests" / "fixtures" / "tiny_sst2.tsv")}
    run = [sys.executable, str(EXPERIMENTS / "run.py"), study]
    rows = subprocess.run([*run, "--list"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert rows.returncode == 0, rows.stderr
    names = rows.stdout.split()
    proc = subprocess.run([*run, "--dry-run"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) >= len(names) > 0
    for line in lines:
        words = line.split()
        words = words[next(i for i, w in enumerate(words) if w == "python") + 1:]
        if words[0] == "-m":
            module = ROOT / (words[1].replace(".", "/") + ".py")
            assert module.exists() or words[1] == "torch.distributed.run", line
        else:
            assert (ROOT / words[0]).is_file(), line
        for flag in ("--out", "--output_dir"):
            if flag in words:
                assert words[words.index(flag) + 1].startswith(("runs/", "recipes/results/")), line
        assert not re.search(r"\{(out|results|sst2)\}", line) and "../" not in line, line


def test_runner_refuses_unknown_study_and_row():
    run = [sys.executable, str(EXPERIMENTS / "run.py")]
    bad = subprocess.run([*run, "no_such_study"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown study 'no_such_study'" in bad.stderr
    bad = subprocess.run([*run, "rope_fft", "no_such_row"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown rows ['no_such_row']" in bad.stderr


def test_sst2_rows_need_the_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_POLYATTN_SST2"}
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "run.py"), "retrofit_kinds", "--dry-run"],
                          cwd=tmp_path, capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "HF_POLYATTN_SST2" in proc.stderr


def test_results_hold_no_code():
    code = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.suffix in (".py", ".sh"))
    assert code == [], f"code under recipes/results/ (belongs in recipes/experiments/): {code}"
    assert not [p for p in RESULTS.rglob("scripts") if p.is_dir()]


def test_results_hold_data_and_generated_text_only():
    """No archive of superseded runs, no captured test logs, no hand-written readings inside a study's folder (a
    reading is a SECTION_*.md beside them, assembled into RESULTS.md)."""
    assert not (RESULTS / "archive").exists() and not (RESULTS / "cuda_tests").exists()
    readmes = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("README.md"))
    assert readmes == [], readmes


def test_no_path_hacks_nor_private_recipe_modules():
    """Scripts import the package and their sibling modules, not sys.path edits or the recipes' private helpers;
    paper_tables.py and sketch_accuracy.py still read their data paths from recipes/_defaults.py, and long_context/
    is its own runner's."""
    allowed = {"paper_tables.py", "sketch_accuracy.py", "experiments/long_context/run_rows.py",
               "experiments/long_context/fill_section.py"}
    for path in RECIPES.rglob("*.py"):
        name = str(path.relative_to(RECIPES))
        text = path.read_text()
        if name not in allowed:
            assert "sys.path.insert" not in text, name
        assert not re.search(r"\b_(kinds|machine)\b", text), name


def test_single_model_card():
    """One model-card template, the one the package ships; no stale copy elsewhere in the repository."""
    template = ROOT / "hf_polyattn" / "model_card_template.md"
    text = template.read_bytes()
    skip = {".git", ".venv", "runs", "node_modules", "build", "dist", "__pycache__"}
    copies = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        for f in filenames:
            p = Path(dirpath) / f
            if f.endswith(".md") and p != template and p.stat().st_size == len(text) and p.read_bytes() == text:
                copies.append(str(p.relative_to(ROOT)))
    assert copies == [], f"copies of {template.relative_to(ROOT)}: {copies}"
    from hf_polyattn.integration import hub

    assert Path(hub.template_path()).resolve() == template.resolve()
    # the docs name the file that exists
    for doc in (ROOT / "docs").glob("*.md"):
        for ref in re.findall(r"`([\w/.-]*model_card[\w/.-]*\.md)`", doc.read_text()):
            assert (ROOT / ref).is_file(), f"{doc.name} names {ref}, which does not exist"


def _run_module(module: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_thesis_section_regenerates_byte_identical(tmp_path):
    out = tmp_path / "SECTION_thesis.md"
    _run_module("recipes.experiments.thesis_reversal.fill_section",
                str(EXPERIMENTS / "thesis_reversal/SECTION_thesis.template.md"), str(out))
    assert out.read_bytes() == (RESULTS / "SECTION_thesis.md").read_bytes()


def test_paper_tables_long_section_regenerates_byte_identical(tmp_path):
    pytest.importorskip("matplotlib")
    # a copy of the results folder: the script also redraws its plots next to the results it reads
    folder = tmp_path / "paper_tables_long"
    shutil.copytree(RESULTS / "paper_tables_long", folder)
    out = tmp_path / "SECTION_paper_tables_long.md"
    _run_module("recipes.experiments.paper_tables_long.fill_section", "--dir", str(folder), "--out", str(out))
    assert out.read_bytes() == (RESULTS / "SECTION_paper_tables_long.md").read_bytes()


def test_retrofit_window_section_regenerates_byte_identical(tmp_path):
    out = tmp_path / "SECTION_retrofit_window.md"
    _run_module("recipes.experiments.retrofit_window.fill_section", "--out", str(out))
    assert out.read_bytes() == (RESULTS / "SECTION_retrofit_window.md").read_bytes()


def test_second_family_section_regenerates_byte_identical(tmp_path):
    out = tmp_path / "SECTION_second_family.md"
    _run_module("recipes.experiments.second_family.fill_section", "--out", str(out))
    assert out.read_bytes() == (RESULTS / "SECTION_second_family.md").read_bytes()


def test_gemma3_270m_section_regenerates_byte_identical(tmp_path):
    out = tmp_path / "SECTION_gemma3_270m.md"
    _run_module("recipes.experiments.gemma3_270m.fill_section", "--out", str(out))
    assert out.read_bytes() == (RESULTS / "SECTION_gemma3_270m.md").read_bytes()


def test_gemma3_270m_collect_copies_what_the_rows_wrote(tmp_path, capsys):
    """collect.py puts each row's output where fill_section reads it and names what a row did not write."""
    from recipes.experiments.gemma3_270m import collect

    runs, results = tmp_path / "runs", tmp_path / "results"
    for name, source in collect.COPIES.items():
        (runs / source).parent.mkdir(parents=True, exist_ok=True)
        (runs / source).write_text(name)
    assert collect.main(["--runs", str(runs), "--results", str(results)]) == 0
    assert {p.name: p.read_text() for p in results.iterdir()} == {name: name for name in collect.COPIES}
    (runs / collect.COPIES["demo.json"]).unlink()
    (results / "demo.json").write_text("kept")
    capsys.readouterr()
    assert collect.main(["--runs", str(runs), "--results", str(results)]) == 0
    assert (results / "demo.json").read_text() == "kept"
    assert "not written (row failed or not run): " in capsys.readouterr().out


def test_second_family_collect_copies_what_the_rows_wrote(tmp_path):
    """collect.py puts each row's output where fill_section reads it; convert.txt is the conversion's report from
    the row's log, without the loading progress bars before it."""
    from recipes.experiments.second_family import collect

    runs, results = tmp_path / "runs", tmp_path / "results"
    for name, source in collect.COPIES.items():
        (runs / source).parent.mkdir(parents=True, exist_ok=True)
        (runs / source).write_text(name)
    report = (RESULTS / "second_family" / "convert.txt").read_text()
    (runs / collect.CONVERT_LOG).write_text("Loading weights: 100%|##########| 80/80\n" + report)
    assert collect.main(["--runs", str(runs), "--results", str(results)]) == 0
    assert (results / "convert.txt").read_text() == report
    for name in collect.COPIES:
        assert (results / name).read_text() == name
    (runs / collect.CONVERT_LOG).write_text("Traceback (most recent call last):\n")
    (runs / collect.COPIES["train.json"]).unlink()
    assert collect.main(["--runs", str(runs), "--results", str(results)]) == 1
    assert (results / "convert.txt").read_text() == report and (results / "train.json").read_text() == "train.json"


def test_results_md_assembles_from_sections(tmp_path):
    """build_results.py's output equals the committed RESULTS.md (run on a copy of recipes/, from elsewhere)."""
    copy = tmp_path / "recipes"
    copy.mkdir()
    shutil.copy(RECIPES / "build_results.py", copy / "build_results.py")
    (copy / "results").mkdir()
    for p in RESULTS.glob("SECTION_*.md"):
        shutil.copy(p, copy / "results" / p.name)
    for last in ("PENDING.md", "REMOVED.md"):
        if (RESULTS / last).exists():
            shutil.copy(RESULTS / last, copy / "results" / last)
    for folder in [*RESULTS.glob("benchmark_*"), RESULTS / "decode_floor"]:  # the tables build_results.py reads
        shutil.copytree(folder, copy / "results" / folder.name, ignore=shutil.ignore_patterns("*.png", "*.json"))
    subprocess.run([sys.executable, str(copy / "build_results.py")], cwd=tmp_path, check=True, capture_output=True)
    assert (copy / "RESULTS.md").read_bytes() == (RECIPES / "RESULTS.md").read_bytes()
