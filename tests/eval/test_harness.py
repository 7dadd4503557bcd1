"""lm-eval with hf_polyattn models (hf_polyattn/eval/harness.py): lm-eval's own CLI on a saved folder (through the
folder's loader, trust_remote_code=True), `hf-polyattn lm-eval`, and the offline tasks shipped in the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import hf_polyattn  # noqa: E402
from hf_polyattn.eval import harness  # noqa: E402
from hf_polyattn.eval.lm_eval_tasks import hf_polyattn_tasks as tasks  # noqa: E402
from tests.conftest import TEXT, TSV, build_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASK = "polyattn_tinyshakespeare"
METADATA = {"tinyshakespeare_file": str(TEXT)}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny Llama with polysketch (learned sketch, window 8, off its initial values) saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("lm_eval") / "model"
    torch.manual_seed(0)
    tok = build_tokenizer(folder)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig(kind="polysketch", sketch="learned", sketch_size=8,
                                                          window=8, block_size=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".polyattn." in name:
                p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def _lm_eval_cli(folder: Path, out: Path, *extra_model_args: str) -> subprocess.CompletedProcess:
    """lm-eval's own entry point (`python -m lm_eval`) in a fresh process that imports no hf_polyattn itself."""
    model_args = ",".join([f"pretrained={folder}", "dtype=float32", *extra_model_args])
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(harness.TASKS_DIR), "--limit", "2", "--device", "cpu", "--metadata",
           json.dumps(METADATA), "--output_path", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=str(ROOT), HF_MODULES_CACHE=str(out.parent / "modules"))
    return subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)


def _cli_scores(out: Path) -> dict[str, float]:
    (results,) = out.rglob("results_*.json")
    values = json.loads(results.read_text())["results"][TASK]
    return {k: v for k, v in values.items() if "," in k and "_stderr" not in k}


@pytest.mark.slow(seconds=68)  # two lm-eval CLI processes
def test_lm_eval_cli_scores_a_saved_folder_like_the_plugin_in_process(saved_model, tmp_path):
    """lm-eval's own CLI with trust_remote_code=True on the saved folder gives the number lm-eval gives in this
    process on the model loaded with the plugin; without trust_remote_code (and no import) it refuses to load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    here = harness.evaluate(model, AutoTokenizer.from_pretrained(saved_model), [TASK], limit=2, metadata=METADATA)
    assert 0 < here[TASK]["bits_per_byte,none"] < 20
    proc = _lm_eval_cli(saved_model, tmp_path / "trusted", "trust_remote_code=True")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cli = _cli_scores(tmp_path / "trusted")
    assert cli.keys() == here[TASK].keys()
    for metric, value in here[TASK].items():
        assert cli[metric] == pytest.approx(value, rel=1e-9), metric
    refused = _lm_eval_cli(saved_model, tmp_path / "untrusted")
    assert refused.returncode != 0 and '`attn_implementation="polysketch"` is not supported' in refused.stderr


def test_hf_polyattn_lm_eval_registers_the_kinds_and_ships_the_tasks(saved_model, tmp_path, capsys):
    """`hf-polyattn lm-eval ARGS` = lm-eval's CLI with the kinds registered (no trust_remote_code) and the shipped
    tasks on the include path (no --include_path)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn.cli import main

    out = tmp_path / "ours"
    code = main(["lm-eval", "--model", "hf", "--model_args", f"pretrained={saved_model},dtype=float32", "--tasks",
                 TASK, "--limit", "1", "--device", "cpu", "--metadata", json.dumps(METADATA), "--output_path",
                 str(out)])
    assert code == 0
    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    here = harness.evaluate(model, AutoTokenizer.from_pretrained(saved_model), [TASK], limit=1, metadata=METADATA)
    assert _cli_scores(out)["bits_per_byte,none"] == pytest.approx(here[TASK]["bits_per_byte,none"], rel=1e-9)
    assert main(["lm-eval", "--tasks"]) == 2  # lm-eval's own usage error, its exit code


def test_tiny_shakespeare_documents_are_the_pipelines_held_out_text():
    """The task's documents, joined, are the text the retrofit pipeline holds out (its last 10% of the lines)."""
    from hf_polyattn.data import load_text_data

    class Chars:  # a tokenizer of code points: the held-out ids decode to the held-out text
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    docs = tasks.tiny_shakespeare(**METADATA)["test"]["text"]
    held_out = "".join(map(chr, load_text_data(str(TEXT), Chars()).eval_ids.tolist()))
    assert "\n".join(docs) == held_out
    assert len(docs) == -(-len(held_out.splitlines()) // tasks.LINES_PER_DOCUMENT)


def test_sst2_validation_is_the_pipelines_seeded_split():
    from hf_polyattn.data import load_classification_data

    data = tasks.sst2(sst2_file=str(TSV), sst2_num_eval=50, sst2_seed=3)
    want = load_classification_data(str(TSV), num_eval=50, seed=3)
    assert data["validation"]["sentence"] == want.eval["sentence"]
    assert data["validation"]["label"] == want.eval["label"] and len(data["train"]) == len(want.train)


def test_sst2_is_scored_as_multiple_choice(saved_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    res = harness.evaluate(model, AutoTokenizer.from_pretrained(saved_model), ["polyattn_sst2"], limit=4,
                           metadata={"sst2_file": str(TSV), "sst2_num_eval": 50})
    assert res["polyattn_sst2"]["acc,none"] in (0.0, 0.25, 0.5, 0.75, 1.0)


def test_tiny_shakespeare_defaults_to_the_bundled_text_sst2_needs_its_file(monkeypatch):
    """Without a file named, the Tiny Shakespeare task reads the text bundled with the package (what --data demo
    holds out); SST-2 is not bundled, and its task says so."""
    from hf_polyattn.data import demo_text_path

    monkeypatch.delenv("HF_POLYATTN_TINYSHAKESPEARE", raising=False)
    monkeypatch.delenv("HF_POLYATTN_SST2", raising=False)
    docs = tasks.tiny_shakespeare()["test"]["text"]
    assert docs == tasks.held_out_documents(demo_text_path().read_text(encoding="utf-8").splitlines())
    assert docs[0] and len(docs) == 36  # 3,600 held-out lines of the 36,000, 100 a document
    with pytest.raises(FileNotFoundError, match="SST-2 is not bundled.*sst2_file"):
        tasks.sst2()


def test_a_task_file_named_but_missing_is_an_error_not_the_checkouts_copy(monkeypatch, tmp_path):
    with pytest.raises(FileNotFoundError, match="metadata 'tinyshakespeare_file' = .* is not a file"):
        tasks.tiny_shakespeare(tinyshakespeare_file=str(tmp_path / "nope.txt"))
    monkeypatch.setenv("HF_POLYATTN_SST2", str(tmp_path / "nope.tsv"))
    with pytest.raises(FileNotFoundError, match=r"\$HF_POLYATTN_SST2 = .* is not a file"):
        tasks.sst2()


def test_without_lm_eval_the_command_says_what_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["lm_eval"] = None  # as if not installed
        from hf_polyattn.cli import main
        sys.exit(main(["lm-eval", "--tasks", "x"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and 'pip install "hf_polyattn[eval]"' in proc.stderr
