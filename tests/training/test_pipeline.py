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
    from hf_polyattn.training.data import DataError

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


def test_lm_eval_tasks_are_scored_at_every_evaluation(tiny_dirs, text_file, tmp_path):
    """--lm_eval_tasks: lm-eval's number beside perplexity after each stage, the one lm-eval gives the saved model
    (windows of --eval_context tokens)."""
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn import harness

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
