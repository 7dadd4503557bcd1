"""Model cards fit for the Hub: the base model by its Hub id, no local path anywhere, only the settings the kind
reads, the decode memory, and a card that huggingface_hub parses back."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

import hf_polyattn
from hf_polyattn import PolyAttnConfig
from hf_polyattn.checkpoints import known_hub_id
from tests.conftest import assert_no_local_path

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
def test_the_path_check_catches_paths(tmp_path):
    """The regex above finds what it must (else every test below would pass vacuously)."""
    for text in (f"loaded from `{tmp_path}`", "data /work/x/data.txt.", "(/home/u/.cache/hf_polyattn/m)"):
        with pytest.raises(AssertionError):
            assert_no_local_path(text)
    assert_no_local_path("see [x](https://huggingface.co/org/m) and `hf_polyattn/integration/memory` and 1/2")


@pytest.fixture
def packaged_smollm2(tiny_dirs, tmp_path, monkeypatch):
    """A tiny Llama where the packaged SmolLM2's local copy lives (checkpoints.cache_dir()), as after
    resolve_checkpoint('smollm2'): loading it gives a local _name_or_path."""
    monkeypatch.setenv("HF_POLYATTN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    shutil.copytree(tiny_dirs["llama"], folder)
    return folder


def test_known_hub_id_of_aliases_and_local_copies(packaged_smollm2, tmp_path):
    assert known_hub_id("smollm2") == known_hub_id(SMOLLM2) == SMOLLM2
    assert known_hub_id(str(packaged_smollm2)) == SMOLLM2
    assert known_hub_id("minilm") == "sentence-transformers/all-MiniLM-L6-v2"
    assert known_hub_id(str(tmp_path)) is None and known_hub_id("my-org/model") is None


def test_converted_model_card(packaged_smollm2, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(packaged_smollm2)
    assert model.config._name_or_path == str(packaged_smollm2)
    cfg = PolyAttnConfig(kind="linear", window=8, sinks=2, decay="gate", feature_proj=8, qk_norm=True,
                         softmax_heads=((0, 1), (1, 0)))
    out = tmp_path / "converted"
    hf_polyattn.convert(model, cfg).save_pretrained(out)
    text = (out / "README.md").read_text()
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == SMOLLM2 and card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation" and card.data.tags[:2] == ["hf_polyattn", "linear"]
    assert "# SmolLM2-135M-Instruct with linear attention and 2 softmax kv heads" in text.splitlines()
    assert_no_local_path(text, tmp_path, packaged_smollm2)
    # only what linear reads: its table rows and metadata, none of polysketch's / polynomial's / performer's fields
    table = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    assert table == [k for k in cfg.read_settings() if k != "options"]
    assert {"window", "sinks", "decay", "feature_map"} <= set(table)
    assert not {"degree", "sketch", "sketch_size", "num_features", "alpha", "beta", "exact_path"} & set(table)
    assert set(card.data.polyattn) == set(cfg.read_settings())
    # the softmax-head layout, one row per layer, and the decode memory of base and retrofit at 4k / 16k / 32k
    assert "| 0 | 1 | 1 of 2 |" in text and "| 1 | 0 | 1 of 2 |" in text
    # 2 layers x 2 kv heads x 2 x 8 dims x 4 bytes = 256 B a token for softmax; 2 of the 4 kv heads keep theirs
    assert f"| softmax `{SMOLLM2}` | 256 B | 1.0 MiB | 4.0 MiB | 8.0 MiB |" in text
    assert "| this model | 128 B |" in text and "cache at 32,768 tokens" in text


def test_pipeline_card(packaged_smollm2, text_file, tmp_path):
    """A retrofit run's card: base model from the alias's local copy, the data by its file name, the run's results,
    the long-context table and plot, no path of this machine."""
    from hf_polyattn.training.pipeline import RetrofitArgs, run

    data = tmp_path / "my data" / "tiny.txt"
    data.parent.mkdir()
    shutil.copy(text_file, data)
    out = tmp_path / "run"
    # the attention the retrofit's old flags (attention="linear", window=8, feature_proj=0) built: their recommended
    # long-context settings (4 sinks, gated decay of horizon 256, window_mix from 0.01) with qk_norm and 64-token
    # blocks
    attention = {"kind": "linear", "window": 8, "feature_proj": 0, "block_size": 64, "qk_norm": True, "sinks": 4,
                 "decay": "gate", "decay_horizon": 256.0, "window_mix": True, "window_mix_init": 0.01}
    run(RetrofitArgs.build(model=str(packaged_smollm2), data=str(data), attention=attention, context=32,
                           eval_context=32, eval_stride=32, max_eval_tokens=64, transfer_steps=1, eval_before=False,
                           progress=False, eval_contexts="16,64", passkey_lengths="", passkey_depths=1,
                           long_eval_tokens=128, long_eval_baselines="softmax", output_dir=str(out)))
    folder = out / "model"
    text = (folder / "README.md").read_text()
    assert_no_local_path(text, tmp_path, packaged_smollm2, data)
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == SMOLLM2
    assert card.data.eval_results[0].dataset_name == "tiny.txt" and card.data.datasets is None
    assert "- data: `tiny.txt`" in text and "## Retrofit results" in text
    assert "### Long context" in text and "](long_context.png)" in text and (folder / "long_context.png").exists()
    settings = json.loads((folder / "config.json").read_text())["polyattn"]
    table = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    assert table == [k for k in PolyAttnConfig.from_dict(settings).read_settings() if k != "options"]
    assert "sketch_size" not in table and "degree" not in table
    # a second card written into the same folder replaces the run's section rather than appending another
    from hf_polyattn.eval.card import write_card

    write_card(folder, json.loads((out / "results.json").read_text()))
    assert (folder / "README.md").read_text().count("## Retrofit results") == 1


def test_card_from_committed_results_names_hub_dataset(tmp_path):
    """card_from_results writes a card from a results record and a config alone (how model_cards/ is made); a Hub
    dataset id becomes the card's datasets metadata and a link."""
    from transformers import LlamaConfig

    from hf_polyattn.eval.card import card_from_results

    config = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    cfg = PolyAttnConfig(kind="polysketch", sketch_size=8, window=16, softmax_heads=((2, 1),))
    results = {"args": {"model": "smollm2", "data": "HuggingFaceFW/fineweb-edu", "task": "causal_lm",
                        "transfer_steps": 60, "transfer_lr": 0.01},
               "polyattn": cfg.to_dict(), "evaluations": {}, "machine": "a test machine"}
    path = card_from_results(tmp_path, results, config, command="hf-polyattn retrofit --model smollm2 ...")
    card = ModelCard.load(path)
    assert card.data.base_model == SMOLLM2 and card.data.datasets == ["HuggingFaceFW/fineweb-edu"]
    text = path.read_text()
    assert "](https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu)" in text
    assert "- attention transfer: 60 steps (lr 0.01)" in text and "- command: `hf-polyattn retrofit" in text
    assert "| 2 | 1 | 1 of 2 |" in text and "| `sketch_size` | `8` |" in text
    assert_no_local_path(text, tmp_path)


def test_bf16_decoder_and_encoder_cards(tmp_path):
    """A bf16 checkpoint's decode memory is counted in bf16; an encoder, which never decodes, has no such table but
    still only the settings its kind reads; a GPT-2 (no kv heads in its config) counts its heads."""
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    small = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=64)
    llama = LlamaForCausalLM(LlamaConfig(**small, num_key_value_heads=2)).to(torch.bfloat16)
    llama.config.dtype = torch.bfloat16  # as from_pretrained(dtype=torch.bfloat16) records it
    hf_polyattn.convert(llama, PolyAttnConfig(kind="linear", window=8)).save_pretrained(tmp_path / "bf16")
    text = (tmp_path / "bf16" / "README.md").read_text()
    assert "(batch 1, bfloat16;" in text and "| this model | 0 (constant) |" in text
    bert = hf_polyattn.convert(BertModel(BertConfig(**small)), PolyAttnConfig(kind="polysketch", sketch_size=8))
    bert.save_pretrained(tmp_path / "bert")
    text = (tmp_path / "bert" / "README.md").read_text()
    assert "### Decode memory" not in text and "| `sketch_size` | `8` |" in text and "feature_map" not in text
    gpt2 = hf_polyattn.convert(GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=64)),
                               "performer")
    gpt2.save_pretrained(tmp_path / "gpt2")
    card = ModelCard.load(tmp_path / "gpt2" / "README.md")
    assert "### Decode memory" in card.text and card.data.polyattn["kind"] == "performer"
    assert_no_local_path(card.content, tmp_path)
