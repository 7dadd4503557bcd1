import json

import pytest
import torch

import hf_polyattn  # noqa: F401  (registers the kinds: needed to reload the saved folders)
from hf_polyattn.training.pipeline import RetrofitArgs, run


def test_classification_transfer_finetune_hub_folder(tiny_dirs, tsv_file, tmp_path):
    """BERT + SST-2 excerpt: transfer, full fine-tuning, accuracy, a Hub-ready folder that reloads."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "bert"
    res = run(RetrofitArgs(model=tiny_dirs["bert"], task="classification", data=tsv_file, num_eval=40,
                           attention="linear", local_exact=False, window=0, feature_proj=0, transfer_steps=2,
                           transfer_batch_size=8,
                           finetune_steps=2, batch_size=8, max_length=32, eval_batch_size=20, progress=False,
                           output_dir=str(out)))
    assert set(res["evaluations"]) == {"swapped", "after_transfer", "after_finetune"}
    assert res["evaluations"]["after_finetune"]["examples"] == 40
    folder = out / "model"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (folder / f).exists(), f
    card = (folder / "README.md").read_text()
    assert "Retrofit results" in card and "accuracy" in card and "hf_polyattn" in card
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["attn_implementation"] == "linear" and cfg["attention_probs_dropout_prob"] == 0.0
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert model.config._attn_implementation == "linear"
    assert any(".polyattn." in n for n, _ in model.named_parameters())


def test_causal_lm_lora_softmax_and_evaluate_only(tiny_dirs, text_file, tmp_path):
    """LoRA fine-tuning (merged before saving) of a softmax baseline; the evaluate recipe's path."""
    from transformers import AutoModelForCausalLM

    common = dict(model=tiny_dirs["llama"], data=text_file, context=32, eval_context=32, eval_stride=16,
                  max_eval_tokens=256, progress=False)
    res = run(RetrofitArgs(**common, attention="softmax", finetune_steps=3, lora=True, lora_r=4,
                           output_dir=str(tmp_path / "soft")))
    ft = res["stages"]["finetune"]
    assert ft["steps"] == 3 and ft["fingerprint"]["num_trainable"] < 20_000  # LoRA adapters only
    before, after = res["evaluations"]["before"]["perplexity"], res["evaluations"]["after_finetune"]["perplexity"]
    assert after != before
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "soft" / "model")
    assert not any("lora" in n for n, _ in reloaded.named_parameters())  # merged
    again = run(RetrofitArgs(**{**common, "model": str(tmp_path / "soft" / "model")}, attention="softmax",
                             save_model=False, output_dir=str(tmp_path / "eval")))
    assert again["evaluations"]["before"]["perplexity"] == pytest.approx(after, rel=1e-4)
    assert torch.isfinite(torch.tensor(after))


def test_missing_data_is_a_clear_error_before_training(tiny_dirs, tmp_path):
    """The installed package has no default corpus (the recipes supply the repository's copy)."""
    from hf_polyattn.data import DataError

    assert RetrofitArgs().data is None
    with pytest.raises(DataError, match="data is required"):
        run(RetrofitArgs(model=tiny_dirs["llama"], attention="polysketch", transfer_steps=1,
                         output_dir=str(tmp_path / "x")))
    assert not (tmp_path / "x" / "model").exists()


def test_polynomial_with_a_window_is_refused_not_dropped():
    """--attention polynomial --window 64 used to run without the window (silently dropped)."""
    with pytest.raises(ValueError, match="--window 64"):
        RetrofitArgs(model="x", data="y", attention="polynomial", window=64)


def test_defaults_are_the_measured_best_per_task(tiny_dirs):
    """window / feature_proj left at None take what measured best (SECTION_retrofit_window.md): a 128-token
    window and a projection to head_dim for causal LMs, a 16-token window for classification; explicit values win."""
    from hf_polyattn.training.pipeline import polyattn_config_from_args, resolved_window_and_projection

    llama = RetrofitArgs(model=tiny_dirs["llama"], data="y", attention="polysketch")
    head_dim = polyattn_config_from_args(llama).feature_proj
    assert resolved_window_and_projection(llama) == (128, head_dim) and head_dim > 0
    cfg = polyattn_config_from_args(llama)
    assert cfg.window == 128 and not cfg.local_exact
    bert = RetrofitArgs(model=tiny_dirs["bert"], data="y", task="classification", attention="linear")
    assert resolved_window_and_projection(bert) == (16, 0)
    assert resolved_window_and_projection(RetrofitArgs(model="x", data="y", attention="polynomial")) == (0, 0)
    pinned = RetrofitArgs(model=tiny_dirs["llama"], data="y", attention="polysketch", window=0, feature_proj=0)
    cfg = polyattn_config_from_args(pinned)
    assert cfg.window == 0 and cfg.feature_proj == 0 and cfg.local_exact  # the blocks, as before
    with pytest.raises(ValueError, match="window must be None"):
        RetrofitArgs(model="x", data="y", window=-1)


def test_length_curriculum_batches_and_checks(tiny_dirs, text_file, tmp_path):
    """transfer_schedule / finetune_schedule: phases of (context, steps, batch) run in order, a pure function of the
    step; their steps must add up to the stage's."""
    from hf_polyattn.training.pipeline import Retrofit

    args = RetrofitArgs(model=tiny_dirs["llama"], data=text_file, attention="linear", window=8, feature_proj=0,
                        transfer_steps=3, transfer_schedule="16:1:3,32:2", transfer_batch_size=2, finetune_steps=2,
                        finetune_schedule="24:2", progress=False, output_dir=str(tmp_path / "run"))
    assert args.schedule("transfer") == [(16, 1, 3), (32, 2, 2)]
    assert args.schedule("finetune") == [(24, 2, args.batch_size)]
    r = Retrofit(args).prepare()
    shapes = [tuple(r._batch_fn("transfer")(step, 0, 0)["input_ids"].shape) for step in range(3)]
    assert shapes == [(3, 16), (2, 32), (2, 32)]
    assert torch.equal(r._batch_fn("transfer")(1, 0, 0)["input_ids"], r._batch_fn("transfer")(1, 0, 0)["input_ids"])
    assert tuple(r._batch_fn("finetune")(1, 0, 0)["input_ids"].shape) == (args.batch_size, 24)
    for bad, match in (("16:2", "has 2 steps, transfer_steps is 3"), ("16:x:1", "LEN:STEPS"), ("1:3", "LEN >= 2"),
                       ("16:3:0", "BATCH")):
        with pytest.raises(ValueError, match=match):
            RetrofitArgs(model=tiny_dirs["llama"], data=text_file, transfer_steps=3, transfer_schedule=bad)


def test_causal_lm_with_softmax_heads_transfers_and_cards_them(tiny_dirs, text_file, tmp_path):
    """polyattn_json softmax_heads through the recipe: transfer trains the kind's heads, the folder reloads as the
    same hybrid and both card sections name the softmax heads and the decode memory per token."""
    from transformers import AutoModelForCausalLM

    res = run(RetrofitArgs(model=tiny_dirs["llama"], data=text_file, attention="polysketch", sketch_size=8,
                           block_size=16, window=8, feature_proj=0, context=32, eval_context=32, eval_stride=32,
                           max_eval_tokens=256, transfer_steps=2, eval_before=False, progress=False,
                           polyattn_json=json.dumps({"softmax_heads": [[0, 1], [1, 0], [1, 1]]}),
                           output_dir=str(tmp_path / "hybrid")))
    assert res["stages"]["transfer"]["steps"] == 2 and res["polyattn"]["softmax_heads"] == [[0, 1], [1, 0], [1, 1]]
    folder = tmp_path / "hybrid" / "model"
    card = " ".join((folder / "README.md").read_text().split())
    # hidden 32, 4 heads: head_dim 8; softmax 2 x 2 kv heads x 8 x 2 layers = 64 numbers per token, kept 2 x 3 x 8
    summary = "3 of the 4 KV heads (2 layers x 2) keep exact softmax attention"
    assert f"- softmax heads: {summary}" in card and "### Softmax heads" in card
    assert "2 x 3 x 8 = 48 numbers against softmax's 2 x 2 x 8 x 2 = 64 (0.750x)" in card
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert hf_polyattn.get_polyattn_config(model).softmax_heads == ((0, 1), (1, 0), (1, 1))


def test_long_context_options_reach_the_config(tmp_path):
    """--sinks, --learned_sinks, --decay, --decay_horizon and --softmax_heads (pairs or @scores.json) set the
    PolyAttnConfig; left unset they take the measured long-context defaults (causal LM with a window) or the kind's;
    a kind that does not read one refuses it."""
    from transformers import LlamaConfig

    from hf_polyattn.training.pipeline import polyattn_config_from_args

    mc = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"softmax_heads": [[1, 0], [0, 1]]}))
    cfg = polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="linear", window=8, sinks=4,
                                                 learned_sinks=2, decay="gate", decay_horizon=512.0,
                                                 softmax_heads=f"@{scores}"), mc)
    assert (cfg.sinks, cfg.learned_sinks, cfg.decay, cfg.decay_horizon) == (4, 2, "gate", 512.0)
    assert cfg.softmax_heads == ((0, 1), (1, 0))
    # left unset: the measured long-context best for a causal LM with a window (RECOMMENDED_LONG_CONTEXT), where
    # the kind reads it; explicit values and polyattn_json win; without a window (or for encoders) the kind's own
    plain = polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="linear", window=8), mc)
    assert (plain.sinks, plain.decay, plain.decay_horizon, plain.window_mix, plain.window_mix_init,
            plain.softmax_heads) == (4, "gate", 256.0, True, 0.01, None)  # RECOMMENDED_DECAY_HORIZON
    sketch = polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="polysketch", window=8), mc)
    assert (sketch.decay, sketch.decay_horizon) == ("gate", 256.0)
    favor = polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="performer", window=8), mc)
    assert (favor.decay, favor.decay_horizon) == ("gate", 1024.0)  # not measured: PolyAttnConfig's own
    off = polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="polysketch", window=8, sinks=0,
                                                 decay="none", polyattn_json='{"window_mix": false}'), mc)
    assert (off.sinks, off.decay, off.decay_horizon, off.window_mix, off.window_mix_init) == (
        0, "none", 1024.0, False, 1.0)  # the default horizon leaves with the decay it belongs to
    off_json = polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="polysketch", window=8,
                                                      polyattn_json='{"decay": "none"}'), mc)
    assert (off_json.decay, off_json.decay_horizon) == ("none", 1024.0)
    # a horizon the user gave without a decay is refused by name, never dropped
    with pytest.raises(ValueError, match="decay_horizon"):
        polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="polysketch", window=8, decay="none",
                                               decay_horizon=512.0), mc)
    with pytest.raises(ValueError, match="decay_horizon"):
        polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="linear", window=8,
                                               polyattn_json='{"decay": "none", "decay_horizon": 512}'), mc)
    blocks = polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="linear", window=0), mc)
    assert (blocks.sinks, blocks.decay, blocks.window_mix) == (0, "none", False)
    streaming = polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="sliding_window"), mc)
    assert (streaming.window, streaming.sinks, streaming.decay) == (128, 4, "none")  # StreamingLLM
    encoder = polyattn_config_from_args(RetrofitArgs(model="x", data="y", task="classification", attention="linear",
                                                     window=8), mc)
    assert (encoder.sinks, encoder.decay, encoder.window_mix) == (0, "none", False)
    assert polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="linear", window=8,
                                                  softmax_heads="1:1"), mc).softmax_heads == ((1, 1),)
    with pytest.raises(ValueError, match="LAYER:HEAD"):
        polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="linear", softmax_heads="1-1"), mc)
    with pytest.raises(ValueError, match="decay"):
        polyattn_config_from_args(RetrofitArgs(model="x", data="y", attention="sliding_window", window=8,
                                                  decay="gate"), mc)


def test_lm_eval_tasks_are_scored_at_every_evaluation(tiny_dirs, text_file, tmp_path):
    """--lm_eval_tasks: lm-eval's number beside perplexity after each stage, the one lm-eval gives the saved model
    (windows of --eval_context tokens)."""
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn.eval import harness

    metadata = json.dumps({"tinyshakespeare_file": text_file})
    res = run(RetrofitArgs(model=tiny_dirs["llama"], data=text_file, attention="polysketch", sketch_size=8,
                           window=8, feature_proj=0, transfer_steps=1, context=32, eval_context=32, eval_stride=32,
                           max_eval_tokens=128, lm_eval_tasks="polyattn_tinyshakespeare", lm_eval_limit=1,
                           lm_eval_metadata=metadata, progress=False, output_dir=str(tmp_path)))
    scores = {tag: e["lm_eval"]["polyattn_tinyshakespeare"]["bits_per_byte,none"]
              for tag, e in res["evaluations"].items()}
    assert set(scores) == {"swapped", "after_transfer"} and scores["swapped"] != scores["after_transfer"]
    folder = tmp_path / "model"
    again = harness.evaluate(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                             ["polyattn_tinyshakespeare"], limit=1, max_length=32, metadata=json.loads(metadata))
    assert again["polyattn_tinyshakespeare"]["bits_per_byte,none"] == pytest.approx(scores["after_transfer"],
                                                                                     rel=1e-6)


def test_lm_eval_tasks_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="scores causal LMs"):
        RetrofitArgs(model="x", data="y", task="classification", lm_eval_tasks="polyattn_sst2")
    with pytest.raises(ValueError, match="score the saved folder instead"):
        RetrofitArgs(model="x", data="y", lm_eval_tasks="polyattn_sst2", fsdp=True)
    with pytest.raises(ValueError, match="must be a JSON object"):
        RetrofitArgs(model="x", data="y", lm_eval_tasks="polyattn_sst2", lm_eval_metadata="[1]")


def test_softmax_heads_auto_scores_the_checkpoint(tiny_dirs, text_file, tmp_path):
    """--softmax_heads auto:K keeps the checkpoint's K best kv heads by retrieval score, measured before conversion
    (the same pairs score_heads + select_heads give); the scores are recorded; bad forms are refused early."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn.eval.heads import score_heads, select_heads
    from hf_polyattn.training.pipeline import AUTO_PROMPTS, AUTO_SEED

    res = run(RetrofitArgs(model=tiny_dirs["llama"], data=text_file, attention="linear", window=8, feature_proj=0,
                           context=32, eval_context=32, eval_stride=32, max_eval_tokens=128, transfer_steps=1,
                           softmax_heads="auto:2", save_model=False, progress=False, output_dir=str(tmp_path / "a")))
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    scores = score_heads(model, AutoTokenizer.from_pretrained(tiny_dirs["llama"]), num_prompts=AUTO_PROMPTS,
                         length=256, seed=AUTO_SEED)
    expected = sorted(list(p) for p in select_heads(scores, 2))
    assert res["polyattn"]["softmax_heads"] == expected == res["head_scores"]["selected"]
    for bad in ("auto:x", "automatic"):
        with pytest.raises(ValueError, match="auto"):
            RetrofitArgs(model="x", data="y", softmax_heads=bad)
    with pytest.raises(ValueError, match="causal_lm only"):
        RetrofitArgs(model="x", data="y", task="classification", softmax_heads="auto")
