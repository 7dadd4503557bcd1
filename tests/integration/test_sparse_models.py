"""sparse_cache (LoLA's bounded sparse cache, ops/sparse.py) through transformers models: generate() with the
recurrent cache equals the uncached forward (prompts shorter and longer than window + block, left padding, softmax
heads beside, bf16); a trained model takes it without training (``hf_polyattn.reconfigure``, ``--set`` without
``--kind``) and save -> reload keeps it."""

from __future__ import annotations

import json

import pytest
import torch
from integration_helpers import (
    build,
    check_greedy_steps,
    check_left_padded_generation,
    generating,
    perturb_polyattn,
    prompt_ids,
)
from transformers import AutoModelForCausalLM

import hf_polyattn
from hf_polyattn import PolyAttnConfig
from hf_polyattn.cli import build_config, main

SPARSE = {
    "linear-sinks-gate": PolyAttnConfig(kind="linear", window=4, sinks=1, decay="gate", sparse_cache=3,
                                        sparse_chunk=3),
    "polysketch-proj": PolyAttnConfig(kind="polysketch", sketch_size=4, window=4, feature_proj=16, sparse_cache=2,
                                      sparse_chunk=4),
    "conv-hedgehog": PolyAttnConfig(kind="linear", feature_map="hedgehog", window=4, sinks=2, short_conv=3,
                                    sparse_cache=2, sparse_chunk=3),
    # ranked by the attention of the last sparse_chunk queries: the decoding state carries them
    "attention-sinks-gate": PolyAttnConfig(kind="linear", window=4, sinks=1, decay="gate", sparse_cache=3,
                                           sparse_chunk=3, sparse_score="attention"),
    # the same with the sinks at their own positions (RoPE: what the sinks and the cached keys are scored at)
    "attention-own-sinks": PolyAttnConfig(kind="linear", window=4, sinks=2, sink_position="own", decay="gate",
                                          sparse_cache=3, sparse_chunk=3, sparse_score="attention"),
}


def _ids(batch=2, length=14, seed=0):
    return prompt_ids(batch, length, seed)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(SPARSE))
def test_greedy_with_cache_equals_full_forward(name, arch):
    model = generating(build(arch, SPARSE[name]))
    perturb_polyattn(model)
    check_greedy_steps(model, _ids(1, 3, seed=1))
    check_greedy_steps(model, _ids(1, 17, seed=2), steps=10)


@pytest.mark.parametrize("name", ["linear-sinks-gate", "conv-hedgehog", "attention-sinks-gate", "attention-own-sinks"])
def test_left_padded_generation_equals_rows(name):
    """Pads of 11 tokens (not a multiple of the block): the blocks count each row's own keys."""
    model = generating(build("llama", SPARSE[name]))
    perturb_polyattn(model)
    check_left_padded_generation(model, [_ids(1, 16, seed=3)[0], _ids(1, 5, seed=4)[0]], 16)


def test_beside_softmax_heads():
    model = generating(build("llama", SPARSE["linear-sinks-gate"].replace(softmax_heads=((0, 1),))))
    perturb_polyattn(model)
    check_greedy_steps(model, _ids(1, 15, seed=5))


@pytest.mark.parametrize("name", ["linear-sinks-gate", "attention-sinks-gate", "attention-own-sinks"])
def test_bf16_model_generates_finite_logits(name):
    model = generating(build("llama", SPARSE[name])).to(torch.bfloat16)
    out = model.generate(_ids(2, 15, seed=6), attention_mask=torch.ones(2, 15, dtype=torch.long), max_new_tokens=6,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert all(torch.isfinite(x).all() for x in out.logits)
    assert torch.isfinite(model(input_ids=_ids(), use_cache=False).logits).all()


def test_decode_cache_bytes_stop_growing():
    """PolyAttnCache.nbytes() after 30 and after 60 generated tokens: the same (constant memory)."""
    model = generating(build("llama", SPARSE["linear-sinks-gate"]))
    sizes = []
    for steps in (30, 60):
        out = model.generate(_ids(1, 12, seed=7), max_new_tokens=steps, do_sample=False,
                             return_dict_in_generate=True)
        sizes.append(hf_polyattn.returned_cache(out).nbytes())
    assert sizes[0] == sizes[1] > 0


def test_a_trained_model_takes_it_without_training(tmp_path):
    """A model converted without the cache and 'trained' (its attention tensors moved), then reconfigured: it computes
    what the same tensors compute with the cache built in, keeps every trained tensor, and save -> reload keeps the
    setting; a change that would add a tensor is refused before anything changes."""
    cfg = SPARSE["linear-sinks-gate"]
    trained = build("llama", cfg.replace(sparse_cache=0, sparse_chunk=64))
    perturb_polyattn(trained)
    tensors = {n: t.clone() for n, t in trained.state_dict().items()}
    with_cache = build("llama", cfg)
    with_cache.load_state_dict(tensors)
    hf_polyattn.reconfigure(trained, sparse_cache=3, sparse_chunk=3)
    assert hf_polyattn.get_polyattn_config(trained) == cfg
    assert all(torch.equal(t, tensors[n]) for n, t in trained.state_dict().items())
    ids = _ids(2, 20, seed=8)
    want = with_cache(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(trained(input_ids=ids, use_cache=False).logits, want, rtol=0, atol=0)
    trained.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["polyattn"]
    assert saved["sparse_cache"] == 3 and saved["sparse_chunk"] == 3
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"\['feature_proj'\] change the tensors"):
        hf_polyattn.reconfigure(trained, feature_proj=32)
    with pytest.raises(ValueError, match="keeps the kind"):
        hf_polyattn.reconfigure(trained, kind="polysketch")
    with pytest.raises(ValueError, match="keeps the layers the kind runs in"):
        hf_polyattn.reconfigure(trained, sliding_layers="kind")
    with pytest.raises(ValueError, match="needs window > 0"):
        hf_polyattn.reconfigure(trained, window=0)
    assert hf_polyattn.get_polyattn_config(trained) == cfg  # unchanged by the refusals
    with pytest.raises(ValueError, match="no polyattn attention"):
        hf_polyattn.reconfigure(build("llama"), sparse_cache=3)


def test_set_without_kind_on_a_trained_checkpoint(tmp_path, capsys):
    """`hf-polyattn convert TRAINED --set sparse_cache=3 --out DIR`: the trained attention with the cache, saved."""
    trained = build("llama", SPARSE["linear-sinks-gate"].replace(sparse_cache=0, sparse_chunk=64))
    perturb_polyattn(trained)
    src, out = tmp_path / "trained", tmp_path / "with-cache"
    trained.save_pretrained(src)
    assert main(["convert", str(src), "--set", "sparse_cache=3", "--set", "sparse_chunk=3", "--out", str(out)]) == 0
    assert "sparse_cache=3" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert hf_polyattn.get_polyattn_config(loaded) == SPARSE["linear-sinks-gate"]
    hf_polyattn.reconfigure(trained, sparse_cache=3, sparse_chunk=3)
    ids = _ids(2, 20, seed=9)
    torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits,
                               trained(input_ids=ids, use_cache=False).logits, rtol=0, atol=1e-6)


def test_encoders_refuse_it():
    """Causal only: a bidirectional model is refused at convert and at reconfigure, naming the setting."""
    with pytest.raises(ValueError, match="sparse_cache=2 is defined for causal attention only"):
        build("bert", PolyAttnConfig(kind="linear", window=4, sparse_cache=2))
    bert = build("bert", PolyAttnConfig(kind="linear", window=4))
    with pytest.raises(ValueError, match="sparse_cache=2 is defined for causal attention only"):
        hf_polyattn.reconfigure(bert, sparse_cache=2)
    assert hf_polyattn.get_polyattn_config(bert).sparse_cache == 0


def test_one_line_study_rows():
    cfg = build_config("linear", ["window=64", "sinks=4", "decay=gate", "sparse_cache=64"])
    assert cfg.sparse_cache == 64 and cfg.sparse_chunk == 64
    assert "sparse cache of 64 keys (LoLA, blocks of 64)" in cfg.spec.table_label(cfg)
    assert "64 keys and values per kv head of the sparse cache" in cfg.spec.memory_note(cfg)
