"""recipes/decode_floor.py: a retrofit's decoding step against its base's and against the same step with no
attention (the most an attention change can give)."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_polyattn
from hf_polyattn.bench_model import _new_cache, _step

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "decode_floor.py"


def _recipe():
    spec = importlib.util.spec_from_file_location("decode_floor", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pair(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "base")
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig(kind="linear", feature_map="elu", window=8, sinks=2,
                                                          decay="gate", softmax_heads=[(1, 0)]))
    model.save_pretrained(tmp_path / "retrofit")
    return tmp_path / "retrofit", tmp_path / "base"


def test_attention_off_zeroes_the_attention_and_keeps_the_state(tmp_path):
    floor = _recipe()
    retrofit, base = _pair(tmp_path)
    model = LlamaForCausalLM.from_pretrained(retrofit).eval()
    ids = torch.randint(0, 64, (1, 20))
    with torch.inference_mode():  # as the bench's steps run
        cache = _new_cache("retrofit", model)
        token = _step(model, ids, cache)
        untouched = copy.deepcopy(cache)
        with floor.attention_off(model):
            off = model(token, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits
        # the layers are themselves again after the block, and the step without attention left their state as it
        # was: the next step reads the same state as a copy taken before it
        on = model(token, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits
        ref = model(token, **hf_polyattn.cache_kwargs(untouched), use_cache=True).logits
    torch.testing.assert_close(on, ref)
    assert not torch.allclose(on, off)
    with pytest.raises(ValueError, match="no polyattn layer"), floor.attention_off(
            LlamaForCausalLM.from_pretrained(base)):
        pass


def test_the_recipe_writes_every_variant(tmp_path):
    retrofit, base = _pair(tmp_path)
    done = subprocess.run([sys.executable, str(RECIPE), str(retrofit), "--base", str(base), "--lengths", "24", "48",
                           "--steps", "3", "--threads", "1", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "out" / "decode_floor.json").read_text())
    assert [r["length"] for r in record["rows"]] == [24, 48]
    for r in record["rows"]:
        assert all(r[f"{v}_ms"] > 0 for v in ("base", "retrofit", "floor")) and "compiled_ms" not in r
    md = (tmp_path / "out" / "decode_floor.md").read_text()
    assert "| 24 |" in md and "| 48 |" in md and "base / floor (the most attention can give)" in md
    bad = subprocess.run([sys.executable, str(RECIPE), str(retrofit), "--base", str(tmp_path / "none")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--base" in bad.stderr and "not a folder" in bad.stderr


def test_fused_off_switches_every_layer_to_the_general_step_and_back(tmp_path):
    """``--unfused``: inside ``fused_off`` no layer decodes with ``fused_step`` (the general ring step, the same
    arithmetic: logits within float rounding), after it every layer is fused again; the recipe writes the column."""
    floor = _recipe()
    retrofit, _ = _pair(tmp_path)
    model = LlamaForCausalLM.from_pretrained(retrofit).eval()
    layers = [m for m in model.modules() if hasattr(m, "fused_decode")]
    assert layers and all(m.fused_decode for m in layers)
    ids = torch.randint(0, 64, (1, 20))
    with torch.inference_mode():
        caches = [_new_cache("retrofit", model) for _ in range(2)]
        tokens = [_step(model, ids, c) for c in caches]
        with floor.fused_off(model):
            assert not any(m.fused_decode for m in layers)
            off = model(tokens[0], **hf_polyattn.cache_kwargs(caches[0]), use_cache=True).logits
        on = model(tokens[1], **hf_polyattn.cache_kwargs(caches[1]), use_cache=True).logits
    assert all(m.fused_decode for m in layers)
    torch.testing.assert_close(off, on, rtol=1e-5, atol=1e-5)
    done = subprocess.run([sys.executable, str(RECIPE), str(retrofit), "--base", str(tmp_path / "base"), "--lengths",
                           "24", "--steps", "2", "--threads", "1", "--unfused", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "out" / "decode_floor.json").read_text())
    assert record["rows"][0]["unfused_ms"] > 0 and "--unfused" in record["command"]
