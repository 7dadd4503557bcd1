"""The `hf-polyattn` command line: help, version, kinds, convert, eval and its errors (in-process via main(argv))."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hf_polyattn  # noqa: E402
from hf_polyattn import cli  # noqa: E402
from hf_polyattn.config import PolyAttnConfig  # noqa: E402
from hf_polyattn.registry import all_kinds, kind_names  # noqa: E402
from tests.conftest import TEXT  # noqa: E402

WORDS = ("the king and queen of a castle by the sea sang to their people while ships came home "
         "with bread wine and stories from far lands").split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint with its own byte-level BPE tokenizer, and a 200-line text file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cli")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(200)]
    text = root / "text.txt"
    text.write_text("\n".join(lines) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model_dir = root / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {"model": model_dir, "text": text, "root": root}


@pytest.fixture(scope="module")
def converted(tiny):
    out = tiny["root"] / "tiny-polysketch"
    argv = ["convert", str(tiny["model"]), "--kind", "polysketch", "--set", "sketch_size=8", "--set", "block_size=16",
            "--set", "local_exact=true", "--out", str(out)]
    assert cli.main(argv) == 0
    return out


def run(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------------------- help, version


OPTIONS = {
    "kinds": ["--json"],
    "convert": ["MODEL", "--kind", "--set", "--config", "--out", "--task", "--dtype", "--overwrite"],
    "eval": ["MODEL", "--data", "--data-config", "--data-split", "--kind", "--set", "--config",
             "--context", "--stride", "--batch-size", "--eval-fraction",
             "--max-eval-tokens", "--text-column", "--tokenizer", "--device", "--dtype", "--threads", "--json",
             "--contexts", "--passkey", "--passkey-depths", "--passkey-seed", "--baselines", "--base",
             "--streaming-sinks", "--streaming-window", "--out"],
    "score-heads": ["MODEL", "--out", "--num-prompts", "--length", "--top", "--seed", "--data", "--sinks", "--window",
                    "--tokenizer", "--device", "--dtype", "--threads"],
    "bench": ["--device", "--lengths", "--kinds", "--heads", "--head-dim", "--dtype", "--repeats", "--threads",
              "--timeout", "--out", "--quick"],
    "retrofit": ["--preset", "--kind", "--set", "--config", "--model", "--task", "--data", "--data_config",
                 "--data_split", "--streaming", "--max_train_tokens", "--transfer_steps", "--transfer_schedule",
                 "--finetune_steps", "--lora", "--fsdp", "--output_dir", "--no_resume", "--eval_contexts",
                 "--passkey_lengths", "--lm_eval_tasks", "accelerate launch -m hf_polyattn.retrofit",
                 "torchrun --nproc_per_node 2 -m hf_polyattn.retrofit"],
    "presets": ["NAME", "--json"],
    # lm-eval's own top-level help (its commands; `run` holds --model, --tasks, ...), under our name
    "lm-eval": ["run", "ls", "validate", "--model", "--tasks"],
}


@pytest.mark.parametrize("command", list(OPTIONS))
def test_help_of_every_command_lists_its_options(command, capsys):
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: hf-polyattn {command} ")
    for option in OPTIONS[command]:
        assert option in out, (command, option)


def test_every_option_has_help_and_shown_defaults(capsys):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction))
    assert set(sub.choices) == set(OPTIONS)
    for name, p in sub.choices.items():
        assert p.description, name
        for action in p._actions:
            if action.help == cli.argparse.SUPPRESS:
                continue
            assert action.help, (name, action.dest)
    code, out, _ = run(["convert", "--help"], capsys)
    assert "(default: auto)" in out  # --task
    code, out, _ = run(["bench", "--help"], capsys)
    assert "16 on CUDA" in out and "131072" in out and "(default: 64)" in out


def test_top_level_help_lists_the_commands(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and out.startswith("usage: hf-polyattn ")
    for command in OPTIONS:
        assert f"    {command} " in out
    assert "--version" in out


def test_version(capsys, monkeypatch):
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out == f"hf-polyattn {version('hf_polyattn')}\n"

    def missing(name):
        raise cli_metadata.PackageNotFoundError(name)

    import importlib.metadata as cli_metadata

    monkeypatch.setattr(cli_metadata, "version", missing)
    assert cli.package_version() == hf_polyattn.__version__


# ----------------------------------------------------------------------------------------------- kinds


def test_kinds_lists_every_kind_and_option(capsys):
    code, out, _ = run(["kinds"], capsys)
    assert code == 0
    lines = out.splitlines()
    for spec in all_kinds():
        assert f"{spec.name}: {spec.title}" in lines, spec.name  # a heading per kind
        for name, opt in spec.options.items():
            assert f"  {name}: {opt.type.__name__} = {opt.default!r}" in lines, (spec.name, name)
    flat = " ".join(out.split())
    for f in dataclasses.fields(PolyAttnConfig):
        if f.name in ("kind", "options"):
            continue
        assert f"{f.name}: {f.type} = {f.default!r}" in out, f.name
        assert " ".join(f.metadata["help"].split()) in flat, f.name
    # options under the kind that reads them
    polysketch = out[out.index("\npolysketch: "):out.index("\nlinear: ")]
    assert "sketch_size: int = 32" in polysketch and "num_features" not in polysketch


def test_kinds_json_covers_every_field(capsys):
    code, out, _ = run(["kinds", "--json"], capsys)
    data = json.loads(out)
    assert list(data["kinds"]) == list(kind_names())
    shown = {o["name"] for k in data["kinds"].values() for o in k["fields"]} | {o["name"] for o in data["all_kinds"]}
    assert shown == {f.name for f in dataclasses.fields(PolyAttnConfig)} - {"kind", "options"}
    assert data["kinds"]["performer"]["fields"][0] == {"name": "num_features", "type": "int", "default": 256,
                                                       "help": "performer: number of random features m"}
    assert data["kinds"]["sliding_window"]["defaults"] == {"window": 256}


def test_kind_fields_name_real_options():
    names = {f.name for f in dataclasses.fields(PolyAttnConfig)}
    for spec in all_kinds():
        assert set(spec.fields) <= names, spec.name


# ----------------------------------------------------------------------------------------------- --set parsing


def test_set_values_are_parsed_by_field_type():
    cfg = cli.build_config("polynomial", ["degree=6", "alpha=0.5", "beta=2", "poly_coefficients=1,0,0.5",
                                          "learn_coefficients=yes", "exact_path=tensor"])
    assert cfg.degree == 6 and cfg.alpha == 0.5 and cfg.beta == 2.0
    assert cfg.poly_coefficients == (1.0, 0.0, 0.5) and cfg.learn_coefficients is True
    cfg = cli.build_config("linear", ["local_exact=true", "local_kernel=none", "local-kernel=softmax"])
    assert cfg.local_exact is True and cfg.local_kernel == "softmax"  # last one wins; '-' reads as '_'
    assert cli.build_config("polysketch", ["local_kernel=None"]).local_kernel is None


@pytest.mark.parametrize("kind, item, message", [
    ("polysketch", "degree=3", "degree must be a power of two"),
    ("polysketch", "degree=4.5", "--set degree='4.5': expected an int"),
    ("linear", "local_exact=maybe", "--set local_exact='maybe': expected a bool"),
    ("polynomial", "alpha=big", "--set alpha='big': expected a float"),
    ("polysketch", "sketch=fancy", "sketch must be one of"),
    ("polysketch", "nonsense=1", "--set nonsense: unknown attention option"),
    ("polysketch", "kind=linear", "--kind"),
    ("polysketch", "degree", "--set expects FIELD=VALUE"),
    ("polynomial", "poly_coefficients=,", "--set poly_coefficients"),
])
def test_bad_set_values_name_the_parameter(kind, item, message):
    with pytest.raises(cli.UsageError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cli.build_config(kind, [item])


def test_set_softmax_heads(tmp_path):
    """(layer, head) pairs as LAYER:HEAD items, a JSON list, or @FILE (a list, or what score-heads writes)."""
    assert cli.build_config("linear", ["softmax_heads=7:2,6:0"]).softmax_heads == ((6, 0), (7, 2))
    assert cli.build_config("linear", ["softmax_heads=[[1, 0]]"]).softmax_heads == ((1, 0),)
    assert cli.build_config("linear", ["softmax_heads=none"]).softmax_heads is None
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"retrieval": [[0.1, 0.9]], "softmax_heads": [[0, 1]]}))
    assert cli.build_config("linear", [f"softmax_heads=@{scores}"]).softmax_heads == ((0, 1),)
    for item, message in [("softmax_heads=0:x", "expected LAYER:HEAD pairs"), ("softmax_heads=[[0, 1]",
                          "not JSON"), (f"softmax_heads=@{tmp_path / 'none.json'}", "cannot read a JSON file"),
                          ("softmax_heads=0:1,0:1", "pair once")]:
        with pytest.raises(cli.UsageError, match=message):
            cli.build_config("linear", [item])


# ----------------------------------------------------------------------------------------------- convert, eval


def test_convert_saves_a_model_that_reloads_with_the_kind(tiny, converted, capsys):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    assert (converted / "config.json").exists() and (converted / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(converted)
    cfg = hf_polyattn.get_polyattn_config(model)
    assert model.config._attn_implementation == "polysketch"
    assert (cfg.kind, cfg.sketch_size, cfg.block_size, cfg.local_exact) == ("polysketch", 8, 16, True)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        # the same conversion done in Python gives the same model
        ref = hf_polyattn.convert(LlamaForCausalLM.from_pretrained(tiny["model"]), cfg)(ids).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, ref)


def test_convert_task_and_overwrite(tiny, tmp_path, capsys):
    out = tmp_path / "base"
    code, text, _ = run(["convert", tiny["model"], "--kind", "linear", "--task", "base", "--out", out], capsys)
    assert code == 0 and "LlamaModel" in text and "linear (defaults)" in text
    assert json.loads((out / "config.json").read_text())["architectures"] == ["PolyAttnLlamaModel"]
    code, _, err = run(["convert", tiny["model"], "--kind", "performer", "--out", out], capsys)
    assert code == 2 and "not empty" in err
    code, _, _ = run(["convert", tiny["model"], "--kind", "performer", "--out", out, "--overwrite"], capsys)
    assert code == 0 and json.loads((out / "config.json").read_text())["attn_implementation"] == "performer"


def test_eval_prints_perplexity_and_attention(tiny, converted, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn.data import load_text_data
    from hf_polyattn.eval.metrics import perplexity

    code, out, _ = run(["eval", converted, "--data", tiny["text"], "--context", 32, "--json"], capsys)
    assert code == 0
    res = json.loads(out)
    assert res["attention"] == "polysketch (sketch_size=8, local_exact=True, block_size=16), from the checkpoint"
    assert math.isfinite(res["perplexity"]) and res["perplexity"] > 1 and res["tokens"] > 32
    # the number is the project's held-out perplexity of that model on that file
    data = load_text_data(str(tiny["text"]), AutoTokenizer.from_pretrained(converted))
    ref = perplexity(AutoModelForCausalLM.from_pretrained(converted), data.eval_ids, context=32, stride=32)
    assert res["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-5) and res["tokens"] == ref["tokens"]

    code, out, _ = run(["eval", tiny["model"], "--data", tiny["text"], "--context", 32], capsys)
    assert code == 0 and "attention:  softmax (sdpa)" in out and "perplexity: " in out
    ppl = float(out.split("perplexity: ")[1].split()[0])
    assert math.isfinite(ppl) and ppl > 1
    code, out, _ = run(["eval", tiny["model"], "--data", tiny["text"], "--context", 32, "--kind", "linear",
                        "--set", "block_size=16"], capsys)
    assert code == 0 and "attention:  linear (block_size=16), converted for this evaluation" in out


def test_eval_long_context_rows_table_and_plot(tiny, converted, capsys, tmp_path):
    """--contexts switches eval to the long-context evaluation: the model's row beside the baselines, on the base
    checkpoint given by --base (a local converted folder records no Hub base model)."""
    out = tmp_path / "lc"
    argv = ["eval", converted, "--data", tiny["text"], "--contexts", "16,64", "--max-eval-tokens", "200",
            "--baselines", "softmax,streaming", "--streaming-window", "8", "--out", out]
    code, _, err = run(argv, capsys)
    assert code == 2 and "records no base model: pass --base" in err
    code, text, _ = run([*argv, "--base", tiny["model"], "--json"], capsys)
    assert code == 0
    res = json.loads(text)
    assert [r.get("baseline") for r in res["rows"]] == ["softmax", "streaming", None]
    assert [p["context"] for p in res["rows"][2]["perplexity"]] == [16, 64] and res["tokens"] == 200
    assert res["rows"][1]["attention"]["window"] == 8 and res["rows"][2]["attention"]["kind"] == "polysketch"
    assert {p.name for p in out.iterdir()} == {"long_context.json", "long_context.md", "long_context.png"}
    code, _, err = run(["eval", tiny["model"], "--data", tiny["text"], "--contexts", "16", "--passkey", "4096",
                        "--baselines", "none"], capsys)
    assert code == 2 and "positions" in err
    code, _, err = run(["eval", tiny["model"], "--data", tiny["text"], "--contexts", "16,x"], capsys)
    assert code == 2 and "comma-separated ints" in err
    code, _, err = run(["eval", tiny["model"], "--data", tiny["text"], "--passkey", "128", "--baselines", "window"],
                       capsys)
    assert code == 2 and "softmax" in err
    code, _, err = run(["eval", tiny["model"], "--data", tiny["text"], "--passkey", "128", "--passkey-templates",
                        "classic,door"], capsys)
    assert code == 2 and "--passkey-templates" in err and "classic, vault, multi" in err


def test_eval_scores_every_passkey_template(long_tiny, tmp_path, capsys):
    """--passkey-templates: each template's grid in the row (the first as 'passkey') and a column per template."""
    out = tmp_path / "lc"
    code, _, _ = run(["eval", long_tiny, "--data", str(TEXT), "--contexts", "64", "--passkey", "400",
                      "--passkey-depths", "1", "--passkey-templates", "classic,vault,multi", "--baselines", "none",
                      "--out", out, "--json"], capsys)
    assert code == 0
    row = json.loads((out / "long_context.json").read_text())["rows"][0]
    assert [row[k]["template"] for k in ("passkey", "passkey_vault", "passkey_multi")] == ["classic", "vault", "multi"]
    md = (out / "long_context.md").read_text()
    assert "classic @ 400" in md and "vault @ 400" in md and "multi @ 400" in md


# ----------------------------------------------------------------------------------------------- bad input


def _bad_inputs(tiny, converted, missing):
    model, text = str(tiny["model"]), str(tiny["text"])
    cases = [
        ([], "the following arguments are required: COMMAND"),
        (["nope"], "invalid choice: 'nope'"),
        (["kinds", "--bogus"], "unrecognized arguments: --bogus"),
        (["convert"], "the following arguments are required: MODEL, --out"),
        (["convert", model, "--out", missing], "convert needs the attention: --kind KIND"),
        (["convert", model, "--config", str(Path(missing) / "c.json"), "--out", missing], "cannot read it"),
        (["convert", model, "--config", text, "--out", missing], "not JSON"),
        (["convert", model, "--kind", "linear", "--set", "feature_proj=head_dim", "--out", missing],
         "feature_proj=head_dim is resolved when a run loads its model"),
        (["convert", model, "--kind", "softmaxx", "--out", missing], "argument --kind: invalid choice: 'softmaxx'"),
        (["convert", str(Path(missing) / "no-model"), "--kind", "linear", "--out", missing], "does not exist"),
        (["convert", text, "--kind", "linear", "--out", missing], "is a file"),
        (["convert", model, "--kind", "polysketch", "--set", "degree=3", "--out", missing], "degree must be"),
        (["convert", model, "--kind", "polysketch", "--set", "degree=four", "--out", missing], "--set degree="),
        (["convert", model, "--kind", "polysketch", "--set", "speed=9", "--out", missing], "--set speed"),
        (["convert", model, "--kind", "polysketch", "--task", "vision", "--out", missing], "--task: invalid choice"),
        (["eval", model], "the following arguments are required: --data"),
        (["eval", model, "--data", str(Path(missing) / "no.txt")], "does not exist"),
        (["eval", model, "--data", text, "--context", "1"], "argument --context: expected an integer >= 2"),
        (["eval", model, "--data", text, "--context", "4096"], "longer than the model's 128 positions"),
        (["eval", model, "--data", text, "--context", "32", "--stride", "64"], "--stride 64 must be <= --context 32"),
        (["eval", model, "--data", text, "--context", "32", "--set", "degree=2"],
         "--set without --kind changes a polyattn checkpoint"),
        (["convert", model, "--set", "sparse_cache=4", "--out", missing], "--set without --kind changes a polyattn"),
        (["eval", str(converted), "--data", text, "--context", "32", "--set", "sketch_size=4"],
         "change the tensors of"),
        (["eval", model, "--data", text, "--kind", "linear", "--set", "softmax_heads=auto"],
         "scoring the heads is part of `hf-polyattn retrofit`"),
        (["eval", str(converted), "--data", text, "--context", "32", "--kind", "linear"], "already uses polysketch"),
        (["eval", model, "--data", text, "--eval-fraction", "1.5"], "--eval-fraction: expected a number in (0, 1)"),
        (["convert", model, "--kind", "linear", "--set", "softmax_heads=5:0", "--out", missing],
         "softmax_heads names (5, 0): LlamaForCausalLM has 2 layers"),
        (["score-heads", model], "the following arguments are required: --out"),
        (["score-heads", model, "--out", missing, "--length", "4096"], "longer than the model's 128 positions"),
        (["score-heads", model, "--out", missing, "--length", "100"], "length must leave room for the filler"),
        (["score-heads", model, "--out", str(Path(missing) / "scores.json")], "does not exist"),
        (["score-heads", model, "--out", missing, "--num-prompts", "0"], "argument --num-prompts: expected an integer"),
        (["retrofit", "--model", model, "--data", text], "no attention given: name a preset"),
        (["retrofit", "--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
        (["retrofit", "--kind", "softmax", "--set", "window=8"], "--kind softmax is the checkpoint's own attention"),
        (["retrofit", "--kind", "linear", "--set", "window=-1"], "window must be an int >= 0"),
        (["retrofit", "--kind", "linear", "--set", "softmax_heads=auto:x"], "softmax_heads must be 'auto'"),
        (["retrofit", "--kind", "linear", "--transfer_steps", "x"], "argument --transfer_steps: expected int"),
        (["retrofit", "--kind", "linear", "--lora", "maybe"], "argument --lora: expected a bool"),
        (["retrofit", "--kind", "linear", "--transfer_steps", "3", "--transfer_schedule", "16:2"],
         "transfer_schedule '16:2' has 2 steps, transfer_steps is 3"),
        (["retrofit", "--model", model, "--kind", "linear", "--data", str(Path(missing) / "no.txt"),
          "--output_dir", missing], "DataError: data file"),
        (["retrofit", "--model", str(Path(missing) / "no-model"), "--kind", "linear", "--data", text,
          "--output_dir", missing], "CheckpointError: checkpoint directory"),
        (["presets", "nope"], "unknown preset 'nope'"),
        (["bench", "--kinds", "nope"], "argument --kinds: invalid choice: 'nope'"),
        (["bench", "--lengths", "0"], "argument --lengths: expected an integer >= 1"),
    ]
    if not torch.cuda.is_available():
        cases.append((["bench", "--device", "cuda"], "--device cuda: no CUDA device"))
    return cases


def test_bad_input_is_a_usage_error(tiny, converted, tmp_path, capsys):
    missing = tmp_path / "not-written"
    for argv, message in _bad_inputs(tiny, converted, str(missing)):
        code, out, err = run(argv, capsys)
        assert code == 2, (argv, code, err)
        assert message in err, (argv, err)
        assert "usage: hf-polyattn" in err and "Traceback" not in err, argv
        assert not missing.exists(), argv  # nothing written on bad input


def test_console_script(tmp_path):
    script = shutil.which("hf-polyattn", path=str(Path(sys.executable).parent))
    assert script, "the hf-polyattn console script is not installed next to this Python"
    res = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "convert" in res.stdout and "eval" in res.stdout
    res = subprocess.run([script, "convert", str(tmp_path / "nope"), "--kind", "linear", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr


# ----------------------------------------------------------------------------------------------- retrofit


def test_retrofit_with_a_preset_writes_a_folder_that_reloads(tiny_dirs, text_file, tmp_path, capsys):
    """`hf-polyattn retrofit --preset long-context` on a tiny Llama (hidden 32, 4 heads, 2 kv heads), its budget cut
    by flags: the preset's attention resolved for this model (feature_proj = its head size 8, softmax heads scored:
    auto:1), LoRA from the preset,
    the flags' schedules; the folder reloads with that attention and the record names the preset."""
    out = tmp_path / "run"
    code, stdout, err = run(["retrofit", "--model", tiny_dirs["llama"], "--data", text_file, "--preset", "long-context",
                             "--set", "softmax_heads=auto:1", "--transfer_steps", "1", "--transfer_schedule", "32:1",
                             "--finetune_steps", "1", "--finetune_schedule", "32:1", "--eval_context", "32",
                             "--eval_stride", "32", "--max_eval_tokens", "64", "--progress", "false", "--output_dir",
                             out], capsys)
    assert code == 0, err[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["args"]["preset"] == "long-context" and results["args"]["lora"] is True
    assert [results["stages"][s]["steps"] for s in ("transfer", "finetune")] == [1, 1]
    c = results["polyattn"]
    assert (c["kind"], c["feature_map"], c["window"], c["sinks"], c["decay_horizon"], c["feature_proj"]) == (
        "linear", "elu", 128, 4, 256.0, 8)
    assert len(c["softmax_heads"]) == 1 and "[softmax heads] 1 of 4 kv heads" in stdout
    assert "Hub-ready folder" in stdout and "Retrofitted: every attention layer -> linear" in stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    cfg = hf_polyattn.get_polyattn_config(model)
    assert cfg.to_dict() == c and not any("lora" in n for n, _ in model.named_parameters())
    # the same folder, evaluated with no stage: the saved attention is used, its kind must match
    code, _, err = run(["retrofit", "--model", out / "model", "--data", text_file, "--kind", "polysketch",
                        "--eval_context", "32", "--output_dir", tmp_path / "again"], capsys)
    assert code == 2 and "was converted to attention 'linear'; pass --kind linear" in err


def test_retrofit_reconfigure_flags_merge_over_the_preset():
    """--reconfigure FIELD=VALUE (repeatable), parsed by the field's type, over the preset's own; refused without
    a polyattn attention and for a setting that does not validate."""
    from hf_polyattn.cli import UsageError, build_parser, retrofit_args
    from hf_polyattn.presets import get_preset

    def args(*extra):
        return retrofit_args(build_parser().parse_args(["retrofit", "--model", "x", "--data", "y", *extra]))

    got = args("--kind", "linear", "--set", "window=8", "--reconfigure", "sparse_cache=4", "--reconfigure",
               "sparse_observe=2").model.reconfigure
    assert got == {"sparse_cache": 4, "sparse_observe": 2}
    preset = get_preset("linear-only")
    assert args("--preset", "linear-only").model.reconfigure == (preset.reconfigure or None)
    merged = args("--preset", "linear-only", "--reconfigure", "sparse_cache=128", "--reconfigure",
                  "sparse_value_keys=96").model.reconfigure
    assert merged == {**preset.reconfigure, "sparse_cache": 128, "sparse_value_keys": 96}
    # the preset's |v| reserve (1,536 keys) no longer fits a smaller cache: refused, not shrunk behind the user's back
    assert preset.reconfigure["sparse_value_keys"] > 128
    with pytest.raises(UsageError, match="sparse_value_keys must be at most sparse_cache=128"):
        args("--preset", "linear-only", "--reconfigure", "sparse_cache=128")
    assert args("--preset", "linear-only", "--kind", "softmax", "--transfer_steps", "0").model.reconfigure is None
    with pytest.raises(UsageError, match="--reconfigure changes a polyattn attention"):
        args("--kind", "softmax", "--reconfigure", "sparse_cache=4")
    with pytest.raises(UsageError, match="sparse_observe=2 needs sparse_cache > 0"):
        args("--kind", "linear", "--set", "window=8", "--reconfigure", "sparse_observe=2")


def test_python_m_hf_polyattn_retrofit_is_the_command(tmp_path):
    """The module entry that accelerate launch -m / torchrun -m start: the same parser, the same errors."""
    res = subprocess.run([sys.executable, "-m", "hf_polyattn.retrofit", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("usage: hf-polyattn retrofit ")
    res = subprocess.run([sys.executable, "-m", "hf_polyattn.retrofit", "--kind", "linear", "--set", "window=-1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "window must be an int >= 0" in res.stderr and "Traceback" not in res.stderr


# ----------------------------------------------------------------------------------------------- no tokenizer


@pytest.fixture(scope="module")
def without_tokenizer(tmp_path_factory):
    """A tiny BERT and a tiny GPT-2 saved without tokenizer files."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("no-tokenizer")
    BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(root / "bert")
    GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(root / "gpt2")
    return root


def test_convert_copies_no_special_tokens_only_tokenizer(without_tokenizer, tmp_path, capsys):
    """transformers builds a BERT tokenizer of its 5 special tokens from a folder without tokenizer files;
    convert used to save it as 'tokenizer copied', and every word would have become [UNK] later."""
    out = tmp_path / "out"
    code, text, _ = run(["convert", without_tokenizer / "bert", "--kind", "linear", "--out", out], capsys)
    assert code == 0 and "(no tokenizer in MODEL: none copied)" in text
    assert not [p.name for p in out.iterdir() if "tokenizer" in p.name or p.name in ("vocab.txt", "vocab.json")]


def test_eval_without_tokenizer_files_is_a_usage_error(without_tokenizer, tiny, capsys):
    """A GPT-2 folder without tokenizer files gave a 1-token tokenizer and 'need at least 2 tokens, got 0'."""
    code, _, err = run(["eval", without_tokenizer / "gpt2", "--data", tiny["text"], "--context", 32], capsys)
    assert code == 2
    assert "no tokenizer for" in err and "pass --tokenizer DIR" in err and "only special tokens" in err


# ----------------------------------------------------------------------------------------------- pipes


def test_output_into_a_closed_pipe_is_no_traceback():
    """`hf-polyattn kinds | head -1`: the reader closes the pipe; a BrokenPipeError traceback used to follow."""
    script = shutil.which("hf-polyattn", path=str(Path(sys.executable).parent))
    assert script
    for argv in (["kinds"], ["kinds", "--json"], ["--help"]):
        res = subprocess.run(["bash", "-c", f'"{script}" {" ".join(argv)} | head -1; exit "${{PIPESTATUS[0]}}"'],
                             capture_output=True, text=True, timeout=120)
        assert len(res.stdout.splitlines()) == 1, argv
        assert "Traceback" not in res.stderr and "BrokenPipeError" not in res.stderr, (argv, res.stderr)
        assert res.returncode in (0, 141), (argv, res.returncode)


# ----------------------------------------------------------------------------------------------- score-heads


@pytest.fixture(scope="module")
def long_tiny(tiny):
    """The tiny Llama with 1024 positions (passkey prompts of 400 tokens) and the same tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    out = tiny["root"] / "tiny-llama-1024"
    LlamaForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_score_heads_writes_scores_and_pairs(tiny, long_tiny, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn.eval.heads import score_heads

    out = tmp_path / "scores.json"
    code, text, _ = run(["score-heads", long_tiny, "--out", out, "--num-prompts", 2, "--length", 400, "--seed", 3,
                         "--data", tiny["text"], "--sinks", 2, "--window", 32], capsys)
    assert code == 0, text
    res = json.loads(out.read_text())
    assert res["top"] == 1 and len(res["softmax_heads"]) == 1  # a quarter of 2 layers x 2 kv heads
    assert len(res["retrieval"]) == 2 and len(res["retrieval"][0]) == 2 and res["text_windows"] == 2
    layer, head = res["softmax_heads"][0]
    assert res["retrieval"][layer][head] == max(max(row) for row in res["retrieval"])
    assert f"top 1 (softmax_heads): {layer}:{head}" in text and f"--set softmax_heads=@{out}" in text
    # the library function on the same model and data gives the same numbers
    tokenizer = AutoTokenizer.from_pretrained(long_tiny)
    from hf_polyattn.data import load_text_data

    ids = load_text_data(str(tiny["text"]), tokenizer).train_ids[:800]
    ref = score_heads(AutoModelForCausalLM.from_pretrained(long_tiny), tokenizer, num_prompts=2, length=400, seed=3,
                      text_ids=ids, sinks=2, window=32)
    assert res["retrieval"] == ref.retrieval.tolist() and res["beyond_window"] == ref.beyond_window.tolist()
    # the pairs go straight into a conversion
    converted = tmp_path / "hybrid"
    code, text, _ = run(["convert", long_tiny, "--kind", "linear", "--set", f"softmax_heads=@{out}", "--out",
                         converted], capsys)
    assert code == 0 and f"softmax_heads=[[{layer}, {head}]]" in text
    code, _, _ = run(["score-heads", long_tiny, "--out", tmp_path / "all.json", "--num-prompts", 1, "--length", 400,
                      "--top", 4], capsys)
    assert code == 0 and len(json.loads((tmp_path / "all.json").read_text())["softmax_heads"]) == 4
    code, _, err = run(["score-heads", long_tiny, "--out", tmp_path / "x.json", "--length", 400, "--top", 5], capsys)
    assert code == 2 and "--top 5: the model has 4 kv heads (2 layers x 2)" in err


# ----------------------------------------------------------------------------------------------- bench --engine


def test_bench_engine_names_the_allowed_engines(capsys):
    code, _, err = run(["bench", "--engine", "tgi", "--model", "x"], capsys)
    assert code == 2 and "--engine must be one of transformers, vllm, got 'tgi'" in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_bench_engine_vllm_without_vllm_says_where_to_run_it(capsys):
    code, _, err = run(["bench", "--engine=vllm", "--model", "x", "--base", "y"], capsys)
    assert code == 2 and "--engine vllm needs vLLM in this environment: pip install 'hf_polyattn[vllm]'" in err
    assert "make install-vllm" in err
