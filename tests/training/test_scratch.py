"""The from-scratch trainer (``training/scratch.py``): a Gemma 3 shape with its sliding-window layers, trained a few
steps on the fixture text, saved, and converted with its sliding layers kept exact."""

from __future__ import annotations

import json

import pytest

from hf_polyattn.training.scratch import ScratchArgs, train_scratch


def test_gemma3_family_trains_saves_and_converts(text_file, tmp_path):
    from transformers import AutoModelForCausalLM

    import hf_polyattn

    args = ScratchArgs(data=text_file, family="gemma3", vocab_size=300, n_layer=3, n_embd=32, n_head=2, context=32,
                       sliding_window=8, global_every=3, steps=2, batch_size=2, eval_tokens=256, save_every=100,
                       progress=False, output_dir=str(tmp_path))
    res = train_scratch(args)
    assert res["pretrain"]["steps"] == 2 and res["eval"]["perplexity"] > 1
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 8
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig(kind="linear", window=4, sinks=2, sink_position="own"))
    assert [e["role"] for e in hf_polyattn.layer_layout(model)] == ["sliding", "sliding", "kind"]


@pytest.mark.parametrize("bad, match", [(dict(family="llama"), "family must be one of"),
                                        (dict(sliding_window=0), "sliding_window must be an int >= 1")])
def test_bad_arguments_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ScratchArgs(**bad)
