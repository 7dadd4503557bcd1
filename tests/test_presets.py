"""The presets (hf_polyattn/presets.py): every figure is the one in the result file it names, every setting the one
that run recorded; a preset plus explicit fields builds the arguments the command line builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_polyattn import PolyAttnConfig
from hf_polyattn.presets import PRESETS, attention_spec, get_preset, scale_schedule
from hf_polyattn.training.pipeline import RetrofitArgs, TrainArgs, resolve_attention

ROOT = Path(__file__).resolve().parents[1]
# the training fields a result file records (the old flat arguments) and a preset may set; the others left unset in
# a preset must have been at TrainArgs' default in the run
TRAIN_FIELDS = ("transfer_steps", "transfer_lr", "transfer_batch_size", "transfer_schedule", "attn_ce_weight",
                "finetune_steps", "finetune_lr", "polyattn_lr", "batch_size", "grad_accum", "finetune_schedule",
                "warmup_steps", "lora", "lora_r", "lora_alpha", "context", "seed", "mixed_precision")
# PolyAttnConfig fields added after the presets' runs were recorded (short_conv: the delta work; sliding_layers: the
# sliding-window layers; sparse_cache, sparse_chunk: the sparse cache; softcap_mode: Gemma 2's soft-capping). A record
# without one ran before it existed, i.e. with what its default computes: no short convolution, no sparse cache (nor
# its re-choice by a prompt's last queries: sparse_observe, sparse_observe_pool, nor its ranking: sparse_score, nor
# the keys of largest |v|: sparse_value_keys, sparse_value_pool), no
# bound on the decay's memory
# (decay_max_horizon), the sinks' span at w + s - 1 (sink_span 0: issue 32), and SmolLM2 has no sliding layers and
# no soft-capping.
ADDED_SINCE = {"short_conv", "sliding_layers", "sparse_cache", "sparse_chunk", "softcap_mode", "decay_max_horizon",
               "sparse_observe", "sparse_observe_pool", "sparse_score", "sink_span", "sparse_value_keys",
               "sparse_value_pool"}


def smollm2_config():
    """SmolLM2-135M's attention shape (hidden 576, 9 query heads, 3 kv heads: head_dim 64), without its weights."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)


def _row(preset):
    return json.loads((ROOT / preset.source).read_text())


def _passkey(hits: list[list[int]], lengths: list[int]) -> dict[int, str]:
    return {n: f"{sum(h)}/{len(h)}" for n, h in zip(lengths, hits)}


def _resolved(preset, recorded_heads):
    """The preset's attention for SmolLM2, its 'auto' heads replaced by the ones the measured run used."""
    spec = dict(preset.attention)
    if spec.get("softmax_heads") == "auto":
        spec["softmax_heads"] = recorded_heads
    return resolve_attention(spec, smollm2_config())


def _assert_is_recorded(config: PolyAttnConfig, recorded: dict) -> None:
    """``config`` is the recorded attention field for field: every field the record holds has its value, and the
    fields it lacks are the ones added since (ADDED_SINCE), at the defaults the recorded run computed with."""
    got = config.to_dict()
    assert set(recorded) <= set(got) and set(got) - set(recorded) <= ADDED_SINCE, sorted(set(got) ^ set(recorded))
    assert {k: got[k] for k in recorded} == recorded
    assert got == PolyAttnConfig.from_dict(recorded).to_dict()


LONG_CONTEXT = [p for p in PRESETS.values() if p.source.startswith("recipes/results/long_context/")]


def test_every_preset_names_a_result_file_and_a_command():
    assert {"long-context", "linear-only", "demo"} <= set(PRESETS)
    for p in PRESETS.values():
        assert (ROOT / p.source).is_file(), (p.name, p.source)
        assert p.command and p.setting and p.summary and p.figures, p.name
        if "run_rows.py " in p.command:  # the row it runs is the row whose file holds the figure
            assert Path(p.source).stem == p.command.split()[-1], p.name


@pytest.mark.parametrize("preset", LONG_CONTEXT, ids=lambda p: p.name)
def test_long_context_presets_are_their_rows(preset):
    """Figures to the printed digit, the attention field for field (PolyAttnConfig.to_dict of the run), and the
    training budget as the run recorded it."""
    r = _row(preset)
    contexts = [p["context"] for p in r["perplexity"]]
    assert preset.figures["perplexity"] == {c: round(p["perplexity"], 2) for c, p in zip(contexts, r["perplexity"])}
    if r.get("passkey"):
        assert preset.figures["passkey"] == _passkey(r["passkey"]["hits"], r["passkey"]["lengths"])
    soft = json.loads((ROOT / "recipes/results/long_context/softmax.json").read_text())
    assert preset.figures["softmax"]["perplexity"] == {p["context"]: round(p["perplexity"], 2)
                                                        for p in soft["perplexity"]}
    cpu = sum(s.get("cpu_s", 0) for s in r["stages"].values())
    if cpu:
        assert f"{preset.figures['train_cpu_s']}" == f"{cpu:.0f}"
    _assert_is_recorded(_resolved(preset, r["polyattn"]["softmax_heads"]), r["polyattn"])
    defaults = TrainArgs()
    for name in TRAIN_FIELDS:
        want = preset.train.get(name, getattr(defaults, name))
        assert r["args"][name] == want, (preset.name, name)
    assert r["args"]["model"] == preset.model and r["args"]["task"] == preset.task


RETRIEVAL = [p for p in PRESETS.values() if p.source.startswith("recipes/results/retrieval/")]


@pytest.mark.parametrize("preset", RETRIEVAL, ids=lambda p: p.name)
def test_retrieval_presets_are_their_rows(preset):
    """A preset measured by the retrieval study (its trained row, then the row that evaluates the saved model with
    the preset's ``reconfigure``): figures to the printed digit (perplexity, passkey on both templates, training CPU
    seconds of the trained row), the attention after reconfigure field for field, and the trained row's command is
    the preset's."""
    r = _row(preset)
    row = r["rows"][0]
    assert preset.figures["perplexity"] == {p["context"]: round(p["perplexity"], 2) for p in row["perplexity"]}
    assert preset.figures["passkey"] == _passkey(row["passkey"]["hits"], row["passkey"]["lengths"])
    assert preset.figures["passkey_vault"] == _passkey(row["passkey_vault"]["hits"], row["passkey_vault"]["lengths"])
    trained_name = preset.command.split()[-2]  # run.py retrieval TRAINED ROW
    trained = json.loads((ROOT / "recipes/results/retrieval" / f"{trained_name}.json").read_text())
    assert preset.figures["train_cpu_s"] == trained["train_cpu_s"]
    assert f"--preset {preset.name}" in trained["command"] and f"runs/retrieval/{trained_name}/model" in r["command"]
    for name, value in preset.reconfigure.items():
        assert f"--set {name}={value:g}" in r["command"] if isinstance(value, float) else \
            f"--set {name}={value}" in r["command"], name
    spec = {**preset.attention, **preset.reconfigure}
    _assert_is_recorded(resolve_attention(spec, smollm2_config()), row["attention"])
    soft = json.loads((ROOT / "recipes/results/long_context/softmax.json").read_text())
    assert preset.figures["softmax"]["perplexity"] == {p["context"]: round(p["perplexity"], 2)
                                                        for p in soft["perplexity"]}


def test_demo_preset_is_the_demo_run():
    p = get_preset("demo")
    r = _row(p)
    soft, row = r["rows"][0], r["rows"][-1]
    assert soft["baseline"] == "softmax" and "baseline" not in row
    assert p.figures["perplexity"] == {x["context"]: round(x["perplexity"], 2) for x in row["perplexity"]}
    assert p.figures["softmax"]["perplexity"] == {x["context"]: round(x["perplexity"], 2) for x in soft["perplexity"]}
    assert p.figures["passkey"] == _passkey(row["passkey"]["hits"], row["passkey"]["lengths"])
    _assert_is_recorded(_resolved(p, row["attention"]["softmax_heads"]), row["attention"])
    s = r["settings"]
    e = p.eval
    assert ",".join(map(str, s["contexts"])) == e["eval_contexts"]
    assert ",".join(map(str, s["passkey_lengths"])) == e["passkey_lengths"]
    assert (s["passkey_depths"], s["max_tokens"], ",".join(s["baselines"])) == (
        e["passkey_depths"], e["long_eval_tokens"], e["long_eval_baselines"])
    section = " ".join((ROOT / "recipes/results/SECTION_demo.md").read_text().split())
    assert f"{p.train['transfer_steps']} attention-transfer steps of one 1,024-token sequence" in section
    assert p.train["transfer_schedule"] == f"1024:{p.train['transfer_steps']}:1"


@pytest.mark.parametrize("name", ["linear-encoder", "polysketch-encoder", "bigbird-encoder", "nystrom-encoder"])
def test_encoder_presets_are_their_rows(name):
    p = get_preset(name)
    table = _row(p)
    rows = {r["attention"]: r for r in table["rows"]}
    row, soft = rows[p.attention["kind"]], rows["softmax"]
    assert (p.figures["accuracy"], p.figures["softmax"]["accuracy"]) == (row["final"], soft["final"])
    recorded = row["polyattn"]
    got = PolyAttnConfig.for_kind(p.attention["kind"], **{k: v for k, v in p.attention.items() if k != "kind"})
    got = got.to_dict()
    assert {k: got.get(k) for k in recorded} == recorded
    for stage in ("transfer_steps", "finetune_steps"):
        assert row[stage] == p.train.get(stage, 0), (name, stage)
    assert table["task"] == p.task == "classification" and table["eval"]["examples"] == p.data["num_eval"]


def test_every_preset_builds_and_describes_itself():
    for p in PRESETS.values():
        args = RetrofitArgs.build(preset=p.name, data="y")
        assert args.preset == p.name and args.model.task == p.task and args.model.model == p.model
        for name, value in p.train.items():
            assert getattr(args.train, name) == value, (p.name, name)
        text = p.describe()
        assert ("perplexity" in text) == ("perplexity" in p.figures), p.name


def test_explicit_fields_win_and_steps_scale_the_schedule():
    args = RetrofitArgs.build(preset="long-context", model="m", data="demo", transfer_steps=2, lora=False,
                              finetune_steps=0)
    t = args.train
    assert (t.transfer_steps, t.transfer_schedule, t.lora, t.finetune_steps, t.finetune_schedule) == (
        2, "1024:2:2", False, 0, None)
    assert any("scaled to '1024:2:2'" in n for n in args.notes)
    mine = RetrofitArgs.build(preset="long-context", data="demo", transfer_steps=4, transfer_schedule="256:4")
    assert mine.train.transfer_schedule == "256:4"  # a schedule given is kept as given
    assert RetrofitArgs.build(preset="long-context", data="demo").train.finetune_schedule == "1024:20:1,2048:20:1"
    with pytest.raises(ValueError, match="unknown retrofit arguments \\['windw'\\]"):
        RetrofitArgs.build(preset="long-context", windw=3)
    with pytest.raises(ValueError, match="unknown preset 'fast'"):
        RetrofitArgs.build(preset="fast")


def test_scale_schedule():
    assert scale_schedule("1024:60:2", 2) == "1024:2:2"
    assert scale_schedule("1024:20:1,2048:20:1", 2) == "1024:1:1,2048:1:1"
    assert scale_schedule("1024:20:1,2048:20:1", 3) == "1024:2:1,2048:1:1"
    assert scale_schedule("1024:20:1,2048:20:1", 1) == "1024:1:1"
    assert scale_schedule("256:10,1024:30:1", 8) == "256:2,1024:6:1"
    assert scale_schedule("1024:60:2", 0) is None and scale_schedule(None, 5) is None


def test_attention_spec_order_and_kind_switch():
    """preset -> config -> kind -> overrides, later wins; another kind keeps what it reads and says what it left."""
    notes: list[str] = []
    spec = attention_spec("long-context", config={"window": 64}, kind="polysketch", overrides={"sketch_size": 16},
                          notes=notes)
    assert spec["kind"] == "polysketch" and spec["window"] == 64 and spec["sketch_size"] == 16
    assert "feature_map" not in spec and spec["softmax_heads"] == "auto" and spec["decay_horizon"] == 256.0
    assert len(notes) == 1 and "left out ['feature_map']" in notes[0]
    assert attention_spec("long-context", kind="softmax") == "softmax"
    assert attention_spec(None) is None
    assert attention_spec(None, kind="linear", overrides={"window": 8}) == {"kind": "linear", "window": 8}
    with pytest.raises(ValueError, match="need a kind"):
        attention_spec(None, overrides={"window": 8})
    with pytest.raises(ValueError, match="names no kind"):
        attention_spec(None, config={"window": 8})
    with pytest.raises(ValueError, match="takes no settings"):
        attention_spec(None, kind="softmax", overrides={"window": 8})


def test_presets_command_lists_every_preset(capsys):
    from hf_polyattn import cli

    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    for p in PRESETS.values():
        assert f"\n{p.name}\n" in f"\n{out}" and p.source in out.replace("\n      ", "")
    assert cli.main(["presets", "long-context", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["long-context"] and data["long-context"]["measured"].startswith("perplexity 40.79 / ")
