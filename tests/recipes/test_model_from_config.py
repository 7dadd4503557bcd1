"""recipes/model_from_config.py: a retrofit's architecture with random weights (for timing where weights cannot
travel) keeps every layer's attention, softmax heads included, and its parameter names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_polyattn

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "model_from_config.py")


def test_copy_has_the_layout_and_parameters_but_new_weights(tmp_path):
    torch.manual_seed(1)  # the recipe draws with seed 0
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig(kind="linear", feature_map="elu", window=8, sinks=2,
                                                          decay="gate", softmax_heads=[(1, 0)]))
    model.save_pretrained(tmp_path / "trained")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((tmp_path / "trained" / "config.json").read_text())
    done = subprocess.run([sys.executable, RECIPE, str(tmp_path / "config_only"),
                           str(tmp_path / "random"), "--dtype", "bf16"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "3 attention layers, 1 softmax kv heads" in done.stdout
    copy = AutoModelForCausalLM.from_pretrained(tmp_path / "random")
    assert hf_polyattn.layer_layout(copy) == hf_polyattn.layer_layout(model)
    mine, theirs = dict(model.named_parameters()), dict(copy.named_parameters())
    assert mine.keys() == theirs.keys()
    assert copy.dtype == torch.bfloat16
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(mine[q].to(torch.bfloat16), theirs[q])  # drawn anew, not copied
    ids = torch.randint(0, 64, (1, 20))
    assert torch.isfinite(copy(ids).logits.float()).all()


def test_refuses_a_folder_without_config(tmp_path):
    done = subprocess.run([sys.executable, RECIPE, str(tmp_path),
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 2 and "no config.json" in done.stderr
