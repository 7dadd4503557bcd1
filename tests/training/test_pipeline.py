import json
import warnings

import pytest
import torch

import hf_polyattn  # noqa: F401  (registers the kinds: needed to reload the saved folders)
from hf_polyattn.training.pipeline import RetrofitArgs, run

build = RetrofitArgs.build
# what the retrofit's flags defaulted to before the presets held the measured settings (sketch, q/k LayerNorm,
# blocks of 64, and for a causal LM with a window the long-context study's sinks, gated decay and window_mix):
# spelled out where a test depends on the attention it ran with
KERNEL = {"block_size": 64, "qk_norm": True}
LONG = {"sinks": 4, "decay": "gate", "window_mix": True, "window_mix_init": 0.01}


def test_classification_transfer_finetune_hub_folder(tiny_dirs, tsv_file, tmp_path):
    """BERT + SST-2 excerpt: transfer, full fine-tuning, accuracy, a Hub-ready folder that reloads."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "bert"
    res = run(build(model=tiny_dirs["bert"], task="classification", data=tsv_file, num_eval=40,
                    attention={"kind": "linear", **KERNEL}, transfer_steps=2, transfer_batch_size=8,
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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run(build(**common, attention="softmax", finetune_steps=3, lora=True, lora_r=4,
                        output_dir=str(tmp_path / "soft")))
    # PEFT's read of a property transformers 5.24 deprecated is not the user's to act on (pipeline._add_lora)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    ft = res["stages"]["finetune"]
    assert ft["steps"] == 3 and ft["fingerprint"]["num_trainable"] < 20_000  # LoRA adapters only
    before, after = res["evaluations"]["before"]["perplexity"], res["evaluations"]["after_finetune"]["perplexity"]
    assert after != before
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "soft" / "model")
    assert not any("lora" in n for n, _ in reloaded.named_parameters())  # merged
    again = run(build(**{**common, "model": str(tmp_path / "soft" / "model")}, attention="softmax",
                      save_model=False, output_dir=str(tmp_path / "eval")))
    assert again["evaluations"]["before"]["perplexity"] == pytest.approx(after, rel=1e-4)
    assert torch.isfinite(torch.tensor(after))


def test_missing_data_is_a_clear_error_before_training(tiny_dirs, tmp_path):
    """Without a preset there is no default corpus: --data names one (demo, web, a file, a Hub id)."""
    from hf_polyattn.data import DataError
    from hf_polyattn.training.pipeline import DataArgs

    assert DataArgs().data is None
    with pytest.raises(DataError, match="data is required"):
        run(build(model=tiny_dirs["llama"], attention="polysketch", transfer_steps=1, output_dir=str(tmp_path / "x")))
    assert not (tmp_path / "x" / "model").exists()
    with pytest.raises(DataError, match="SST-2 is not bundled"):  # the encoder presets name no data
        run(build(preset="linear-encoder", model=tiny_dirs["bert"], output_dir=str(tmp_path / "y")))


def test_no_attention_is_a_clear_error():
    with pytest.raises(ValueError, match="no attention given: name a preset"):
        build(model="x", data="y")


def test_polynomial_with_a_window_is_refused_not_dropped():
    """--attention polynomial --window 64 used to run without the window (silently dropped)."""
    with pytest.raises(ValueError, match="window applies to the linear-time kinds.*'polynomial' is exact everywhere"):
        build(model="x", data="y", attention={"kind": "polynomial", "window": 64})


def test_the_pipeline_adds_no_attention_defaults_the_presets_hold_them(tiny_dirs):
    """A kind named alone runs with PolyAttnConfig's defaults for it: the measured settings (a 128-token window,
    the projection to head_dim, SECTION_retrofit_window.md; sinks, gated decay, window_mix, SECTION_long_context.md)
    come from a preset, never from the pipeline. 'head_dim' resolves to the model's head size."""
    from transformers import AutoConfig

    from hf_polyattn import PolyAttnConfig
    from hf_polyattn.training.pipeline import resolve_attention

    llama = AutoConfig.from_pretrained(tiny_dirs["llama"])
    bert = AutoConfig.from_pretrained(tiny_dirs["bert"])
    for kind in ("polysketch", "linear", "polynomial", "sliding_window"):
        assert resolve_attention(build(model="x", data="y", attention=kind).model.attention, llama) == \
            PolyAttnConfig.for_kind(kind)
    args = build(preset="long-context", model=tiny_dirs["llama"], data="y")
    cfg = resolve_attention({**args.model.attention, "softmax_heads": None}, llama)
    head_dim = llama.hidden_size // llama.num_attention_heads
    assert (cfg.window, cfg.feature_proj, cfg.local_exact, cfg.sinks, cfg.decay, cfg.decay_horizon) == (
        128, head_dim, False, 4, "gate", 256.0) and head_dim > 0
    assert resolve_attention({"kind": "linear", "feature_proj": "head_dim"}, bert).feature_proj == 32 // 4
    pinned = resolve_attention({"kind": "polysketch", "local_exact": True, "window": 0, "feature_proj": 0}, llama)
    assert pinned.window == 0 and pinned.feature_proj == 0 and pinned.local_exact  # the blocks
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        build(model="x", data="y", attention={"kind": "linear", "window": -1})
    with pytest.raises(ValueError, match="feature_proj must be an int >= 0 or 'head_dim'"):
        build(model="x", data="y", attention={"kind": "linear", "feature_proj": "model"})


def test_length_curriculum_batches_and_checks(tiny_dirs, text_file, tmp_path):
    """transfer_schedule / finetune_schedule: phases of (context, steps, batch) run in order, a pure function of the
    step; their steps must add up to the stage's."""
    from hf_polyattn.training.pipeline import Retrofit

    args = build(model=tiny_dirs["llama"], data=text_file, attention={"kind": "linear", "window": 8},
                 transfer_steps=3, transfer_schedule="16:1:3,32:2", transfer_batch_size=2, finetune_steps=2,
                 finetune_schedule="24:2", progress=False, output_dir=str(tmp_path / "run"))
    assert args.schedule("transfer") == [(16, 1, 3), (32, 2, 2)]
    assert args.schedule("finetune") == [(24, 2, args.train.batch_size)]
    r = Retrofit(args).prepare()
    shapes = [tuple(r._batch_fn("transfer")(step, 0, 0)["input_ids"].shape) for step in range(3)]
    assert shapes == [(3, 16), (2, 32), (2, 32)]
    assert torch.equal(r._batch_fn("transfer")(1, 0, 0)["input_ids"], r._batch_fn("transfer")(1, 0, 0)["input_ids"])
    assert tuple(r._batch_fn("finetune")(1, 0, 0)["input_ids"].shape) == (args.train.batch_size, 24)
    for bad, match in (("16:2", "has 2 steps, transfer_steps is 3"), ("16:x:1", "LEN:STEPS"), ("1:3", "LEN >= 2"),
                       ("16:3:0", "BATCH")):
        with pytest.raises(ValueError, match=match):
            build(model=tiny_dirs["llama"], data=text_file, attention="polysketch", transfer_steps=3,
                  transfer_schedule=bad)


def test_causal_lm_with_softmax_heads_transfers_and_cards_them(tiny_dirs, text_file, tmp_path):
    """softmax_heads through the pipeline: transfer trains the kind's heads, the folder reloads as the same hybrid
    and both card sections name the softmax heads and the decode memory per token."""
    from transformers import AutoModelForCausalLM

    attention = {"kind": "polysketch", "sketch": "learned", "sketch_size": 8, **KERNEL, "block_size": 16, "window": 8,
                 **LONG, "decay_horizon": 256.0, "softmax_heads": [[0, 1], [1, 0], [1, 1]]}
    res = run(build(model=tiny_dirs["llama"], data=text_file, attention=attention, context=32, eval_context=32,
                    eval_stride=32, max_eval_tokens=256, transfer_steps=2, eval_before=False, progress=False,
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
    """sinks, learned_sinks, decay, decay_horizon and softmax_heads (pairs, 'LAYER:HEAD' text or @scores.json) set
    the PolyAttnConfig; left unset they are the kind's own (the long-context preset is where the measured ones
    are); a kind that does not read one refuses it."""
    from transformers import LlamaConfig

    from hf_polyattn.presets import get_preset
    from hf_polyattn.training.pipeline import resolve_attention

    mc = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)

    def config(**attention):
        return resolve_attention(build(model="x", data="y", attention=attention).model.attention, mc)

    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"softmax_heads": [[1, 0], [0, 1]]}))
    cfg = config(kind="linear", window=8, sinks=4, learned_sinks=2, decay="gate", decay_horizon=512.0,
                 softmax_heads=f"@{scores}")
    assert (cfg.sinks, cfg.learned_sinks, cfg.decay, cfg.decay_horizon) == (4, 2, "gate", 512.0)
    assert cfg.softmax_heads == ((0, 1), (1, 0))
    # left unset: the kind's own; the measured long-context settings are the preset's
    plain = config(kind="linear", window=8)
    assert (plain.sinks, plain.decay, plain.decay_horizon, plain.window_mix, plain.window_mix_init,
            plain.softmax_heads) == (0, "none", 1024.0, False, 1.0, None)
    preset = get_preset("long-context").attention
    assert {k: preset[k] for k in ("sinks", "decay", "decay_horizon", "window_mix", "window_mix_init")} == {
        "sinks": 4, "decay": "gate", "decay_horizon": 256.0, "window_mix": True, "window_mix_init": 0.01}
    # a horizon without a decay is refused by name, never dropped
    with pytest.raises(ValueError, match="decay_horizon"):
        config(kind="polysketch", window=8, decay="none", decay_horizon=512.0)
    streaming = config(kind="sliding_window", window=128, sinks=4)
    assert (streaming.window, streaming.sinks, streaming.decay) == (128, 4, "none")  # StreamingLLM
    assert config(kind="linear", window=8, softmax_heads="1:1").softmax_heads == ((1, 1),)
    with pytest.raises(ValueError, match="LAYER:HEAD"):
        config(kind="linear", softmax_heads="1-1")
    with pytest.raises(ValueError, match="decay"):
        config(kind="sliding_window", window=8, decay="gate")


def test_lm_eval_tasks_are_scored_at_every_evaluation(tiny_dirs, text_file, tmp_path):
    """--lm_eval_tasks: lm-eval's number beside perplexity after each stage, the one lm-eval gives the saved model
    (windows of --eval_context tokens)."""
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn.eval import harness

    metadata = json.dumps({"tinyshakespeare_file": text_file})
    attention = {"kind": "polysketch", "sketch": "learned", "sketch_size": 8, **KERNEL, "window": 8, **LONG,
                 "decay_horizon": 256.0}
    res = run(build(model=tiny_dirs["llama"], data=text_file, attention=attention, transfer_steps=1, context=32,
                    eval_context=32, eval_stride=32, max_eval_tokens=128, lm_eval_tasks="polyattn_tinyshakespeare",
                    lm_eval_limit=1, lm_eval_metadata=metadata, progress=False, output_dir=str(tmp_path)))
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
        build(model="x", data="y", attention="polysketch", task="classification", lm_eval_tasks="polyattn_sst2")
    with pytest.raises(ValueError, match="score the saved folder instead"):
        build(model="x", data="y", attention="polysketch", lm_eval_tasks="polyattn_sst2", fsdp=True)
    with pytest.raises(ValueError, match="must be a JSON object"):
        build(model="x", data="y", attention="polysketch", lm_eval_tasks="polyattn_sst2", lm_eval_metadata="[1]")


def test_softmax_heads_auto_scores_the_checkpoint(tiny_dirs, text_file, tmp_path):
    """--softmax_heads auto:K keeps the checkpoint's K best kv heads by retrieval score, measured before conversion
    (the same pairs score_heads + select_heads give); the scores are recorded; bad forms are refused early."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn.eval.heads import score_heads, select_heads
    from hf_polyattn.training.pipeline import AUTO_PROMPTS, AUTO_SEED

    attention = {"kind": "linear", **KERNEL, "window": 8, **LONG, "decay_horizon": 256.0, "softmax_heads": "auto:2"}
    res = run(build(model=tiny_dirs["llama"], data=text_file, attention=attention, context=32, eval_context=32,
                    eval_stride=32, max_eval_tokens=128, transfer_steps=1, save_model=False, progress=False,
                    output_dir=str(tmp_path / "a")))
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    scores = score_heads(model, AutoTokenizer.from_pretrained(tiny_dirs["llama"]), num_prompts=AUTO_PROMPTS,
                         length=256, seed=AUTO_SEED)
    expected = sorted(list(p) for p in select_heads(scores, 2))
    assert res["polyattn"]["softmax_heads"] == expected == res["head_scores"]["selected"]
    for bad in ("auto:x", "automatic"):
        with pytest.raises(ValueError, match="auto"):
            build(model="x", data="y", attention={"kind": "polysketch", "softmax_heads": bad})
    with pytest.raises(ValueError, match="causal_lm only"):
        build(model="x", data="y", task="classification", attention={"kind": "linear", "softmax_heads": "auto"})


def test_softmax_heads_auto_keeps_more_than_a_quarter_when_a_quarter_holds_little(tiny_dirs, text_file, tmp_path,
                                                                               monkeypatch):
    """softmax_heads='auto' keeps a quarter of the candidate kv heads, or the fewest that hold AUTO_SHARE of the
    retrieval score when a quarter holds less (a family with few global layers: Gemma 3's three); the record says
    which rule chose."""
    import hf_polyattn.eval.heads as heads_module
    from hf_polyattn.training.pipeline import AUTO_SHARE

    assert AUTO_SHARE == 0.8
    attention = {"kind": "linear", **KERNEL, "window": 8, **LONG, "decay_horizon": 256.0, "softmax_heads": "auto"}
    chosen = {}
    for name, rows, expected in (("spread", [[0.5, 0.1], [0.3, 0.1]], [[0, 0], [1, 0]]),
                                 ("one", [[0.9, 0.05], [0.03, 0.02]], [[0, 0]])):
        fixed = heads_module.HeadScores(retrieval=torch.tensor(rows), beyond_window=None, num_prompts=4, length=256,
                                        seed=1, sinks=4, window=128, layers=[0, 1])
        monkeypatch.setattr(heads_module, "score_heads", lambda *a, _f=fixed, **k: _f)
        res = run(build(model=tiny_dirs["llama"], data=text_file, attention=attention, context=32, eval_context=32,
                        eval_stride=32, max_eval_tokens=64, transfer_steps=1, save_model=False, progress=False,
                        output_dir=str(tmp_path / name)))
        assert res["polyattn"]["softmax_heads"] == res["head_scores"]["selected"] == expected
        chosen[name] = res["head_scores"]["rule"]
    assert chosen == {"spread": "the fewest that hold 80% of the retrieval score: a quarter of 4 holds less",
                      "one": "a quarter of 4"}


def test_retrieval_mix_lays_recall_tasks_into_the_training_windows(tiny_dirs, text_file, tsv_file, tmp_path):
    """--retrieval_mix: a seeded fraction of each stage's windows carries a recall task (training/retrieval_data.py),
    the same at every call of a step (a resumed run draws the same), different between the stages."""
    from hf_polyattn.training.pipeline import Retrofit

    args = build(model=tiny_dirs["llama"], data=text_file, attention={"kind": "linear", "window": 8},
                 transfer_steps=4, transfer_batch_size=8, finetune_steps=2, context=200, retrieval_mix=0.5,
                 progress=False, output_dir=str(tmp_path / "run"))
    plain = build(model=tiny_dirs["llama"], data=text_file, attention={"kind": "linear", "window": 8},
                  transfer_steps=4, transfer_batch_size=8, finetune_steps=2, context=200, progress=False,
                  output_dir=str(tmp_path / "plain"))
    r, p = Retrofit(args).prepare(), Retrofit(plain).prepare()
    tok = r.tokenizer
    for stage in ("transfer", "finetune"):
        mixed, base = r._batch_fn(stage)(1, 0, 0)["input_ids"], p._batch_fn(stage)(1, 0, 0)["input_ids"]
        assert mixed.shape == base.shape
        changed = [i for i in range(mixed.shape[0]) if not torch.equal(mixed[i], base[i])]
        assert changed and len(changed) < mixed.shape[0]
        assert all(("wrote down" in tok.decode(mixed[i])) or ("Inventory:" in tok.decode(mixed[i])) for i in changed)
        assert torch.equal(r._batch_fn(stage)(1, 0, 0)["input_ids"], mixed)
    assert not torch.equal(r._batch_fn("transfer")(1, 0, 0)["input_ids"], r._batch_fn("finetune")(1, 0, 0)["input_ids"])
    with pytest.raises(ValueError, match="retrieval_mix must be a fraction"):
        build(model=tiny_dirs["llama"], data=text_file, attention="polysketch", retrieval_mix=1.5)
    with pytest.raises(ValueError, match="--retrieval_mix lays recall tasks into causal LM"):
        build(model=tiny_dirs["bert"], data=tsv_file, task="classification", attention="polysketch",
              retrieval_mix=0.5)


def test_reconfigure_after_training_reaches_the_evaluation_and_the_folder(tiny_dirs, text_file, tmp_path):
    """reconfigure: the settings that add no tensor apply after the last stage. The long-context rows and the saved
    folder (reloaded) have them, the run records them, training ran without them (the evaluation after transfer
    equals a run without reconfigure), and the model with them computes other outputs than without."""
    from transformers import AutoModelForCausalLM

    from hf_polyattn import get_polyattn_config

    attention = {"kind": "linear", "window": 8, **KERNEL, **LONG, "decay_horizon": 256.0}
    common = dict(model=tiny_dirs["llama"], data=text_file, attention=attention, context=32, eval_context=32,
                  eval_stride=32, max_eval_tokens=64, transfer_steps=1, progress=False, eval_contexts="64",
                  passkey_lengths="", long_eval_tokens=128, long_eval_baselines="none")
    settings = {"sparse_cache": 4, "sparse_chunk": 4, "sparse_observe": 2, "decay_max_horizon": 16.0}
    res = run(build(**common, reconfigure=settings, output_dir=str(tmp_path / "with")))
    plain = run(build(**common, output_dir=str(tmp_path / "without")))
    assert res["reconfigured"] == settings and "reconfigured" not in plain
    assert {k: res["polyattn"][k] for k in settings} == settings
    assert res["evaluations"]["after_transfer"]["perplexity"] == plain["evaluations"]["after_transfer"]["perplexity"]
    ppl = res["long_context"]["rows"][0]["perplexity"][0]["perplexity"]
    assert ppl != plain["long_context"]["rows"][0]["perplexity"][0]["perplexity"]
    card = (tmp_path / "with" / "model" / "README.md").read_text()
    assert "then, without training (`hf_polyattn.reconfigure`): `sparse_cache=4`, `sparse_chunk=4`" in card
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "with" / "model")
    cfg = get_polyattn_config(model)
    assert (cfg.sparse_cache, cfg.sparse_chunk, cfg.sparse_observe, cfg.decay_max_horizon) == (4, 4, 2, 16.0)


def test_retrofit_evaluation_scores_ruler_and_later_turns_and_reads_in_chunks(tiny_dirs, text_file, tmp_path):
    """--ruler_lengths / --multi_turn / --prefill_chunk reach the retrofit's own long-context evaluation as they reach
    `hf-polyattn eval`'s: every row (the run's and the baseline) scores the RULER suite in one prompt and in a later
    turn, the chunked read is recorded and answers what one call answers (the same seeded run without it), and the
    card shows the suite."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # the fixture's Llama with 1,200 positions: its 256 hold no RULER or two-turn passkey prompt of the tiny tokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    config = LlamaConfig.from_pretrained(tiny_dirs["llama"])
    config.max_position_embeddings = 1200
    model_dir = tmp_path / "llama1200"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    attention = {"kind": "linear", "window": 8, **KERNEL, **LONG}
    common = dict(model=str(model_dir), data=text_file, attention=attention, context=32, eval_context=32,
                  eval_stride=32, max_eval_tokens=64, transfer_steps=1, eval_before=False, progress=False,
                  eval_contexts="64", passkey_lengths="300", passkey_depths=1, multi_turn=True, ruler_lengths="900",
                  ruler_tasks="niah_single_1,vt", ruler_samples=1, long_eval_tokens=128,
                  long_eval_baselines="streaming")
    chunked = run(build(**common, prefill_chunk=48, output_dir=str(tmp_path / "chunked")))["long_context"]
    whole = run(build(**common, output_dir=str(tmp_path / "whole")))["long_context"]
    assert chunked["settings"]["ruler_lengths"] == [900] and chunked["settings"]["prefill_chunk"] == 48
    assert len(chunked["rows"]) == 2  # the run's row and StreamingLLM's
    for row, one in zip(chunked["rows"], whole["rows"]):
        for key in ("ruler", "ruler_multi_turn", "passkey", "passkey_multi_turn"):
            assert row[key]["prefill_chunk"] == 48 and "prefill_chunk" not in one[key], key
        assert row["ruler"]["tasks"] == ["niah_single_1", "vt"] and row["ruler"]["lengths"] == [900]
        assert row["ruler_multi_turn"]["multi_turn"] and not row["ruler"]["multi_turn"]
        assert row["passkey_multi_turn"]["multi_turn"]
        for key in ("ruler", "ruler_multi_turn"):
            assert [o["output"] for o in row[key]["outputs"]] == [o["output"] for o in one[key]["outputs"]]
        for key in ("passkey", "passkey_multi_turn"):
            assert row[key]["answers"] == one[key]["answers"]
    card = (tmp_path / "chunked" / "model" / "README.md").read_text()
    assert "niah_single_1 @ 900" in card


def test_retrofit_evaluation_options_are_checked_before_training(tiny_dirs, tsv_file):
    attention = {"kind": "linear", "window": 8}
    with pytest.raises(ValueError, match="--prefill_chunk 64 with sparse_cache=4: a sparse cache chooses its keys"):
        build(model="x", data="y", attention=attention, reconfigure={"sparse_cache": 4}, eval_contexts="64",
              prefill_chunk=64)
    with pytest.raises(ValueError, match="--prefill_chunk 64 with sparse_cache=4"):
        build(model="x", data="y", attention={**attention, "sparse_cache": 4}, ruler_lengths="128", prefill_chunk=64)
    build(model="x", data="y", attention="softmax", transfer_steps=0, ruler_lengths="128", prefill_chunk=64)
    with pytest.raises(ValueError, match="ruler_lengths must be comma-separated ints, got '1k'"):
        build(model="x", data="y", attention=attention, ruler_lengths="1k")
    with pytest.raises(ValueError, match="ruler_tasks must be"):
        build(model="x", data="y", attention=attention, ruler_lengths="128", ruler_tasks="nope")
    with pytest.raises(ValueError, match="read='copy' says how a multi-turn evaluation reads"):
        build(model="x", data="y", attention=attention, passkey_lengths="128", read="copy")
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 0"):
        build(model="x", data="y", attention=attention, ruler_lengths="128", prefill_chunk=-1)
    with pytest.raises(ValueError, match="ruler_lengths evaluate a causal LM"):
        build(model=tiny_dirs["bert"], data=tsv_file, task="classification", attention=attention,
              ruler_lengths="128")


def test_reconfigure_is_checked_before_training():
    attention = {"kind": "linear", "window": 8}
    with pytest.raises(ValueError, match="sparse_observe=2 needs sparse_cache > 0"):
        build(model="x", data="y", attention=attention, reconfigure={"sparse_observe": 2})
    with pytest.raises(ValueError, match=r"unknown attention settings \['sparse_cach'\]"):
        build(model="x", data="y", attention=attention, reconfigure={"sparse_cach": 2})
    with pytest.raises(ValueError, match="attention 'softmax' has none"):
        build(model="x", data="y", attention="softmax", reconfigure={"sparse_cache": 2})
    with pytest.raises(ValueError, match="reconfigure is a dict"):
        build(model="x", data="y", attention=attention, reconfigure="sparse_cache=2")


def test_run_summary_names_the_layers_a_sliding_model_keeps_exact(tmp_path):
    """A Gemma 3-like run converts its global layers only: the summary says so and counts the softmax heads among
    those layers' kv heads (it said 'every attention layer' and '1 of 18 kv heads' on Gemma 3 270M)."""
    from hf_polyattn import PolyAttnConfig
    from hf_polyattn.training.pipeline import run_summary

    layout = [{"layer": i, "role": "kind" if i % 6 == 5 else "sliding"} for i in range(18)]
    results = {"args": {"attention": "linear", "output_dir": str(tmp_path)},
               "polyattn": PolyAttnConfig.for_kind("linear", window=8).to_dict(), "layer_layout": layout,
               "head_scores": {"retrieval": [[0.1]] * 18, "layers": [5, 11, 17], "candidates": 3,
                               "selected": [[5, 0], [11, 0]], "wall_s": 1.0},
               "stages": {}, "evaluations": {}}
    text = run_summary(results, None)
    assert "Retrofitted: 3 of 18 attention layers (the 15 sliding-window ones kept exact) -> linear" in text
    assert "its softmax heads are the best 2 of the 3 kv heads of those layers by retrieval score" in text
    results["layer_layout"] = [{"layer": i, "role": "kind"} for i in range(2)]
    results["head_scores"] = {"retrieval": [[0.1, 0.2]] * 2, "layers": None, "selected": [[0, 1]], "wall_s": 1.0}
    text = run_summary(results, None)
    assert "Retrofitted: every attention layer -> linear" in text and "best 1 of the 4 kv heads" in text
