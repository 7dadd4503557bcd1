"""Attention sinks and learned sink slots through transformers models: generate() with the recurrent cache equals
the uncached forward (every step, left-padded batches, beam search), chunked prefill equals one forward, the state
stays s + w keys, save -> reload keeps the settings and the slots, encoders refuse sinks at call time."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import (
    ARCHS,
    VOCAB,
    auto_class,
    build,
    check_greedy_steps,
    check_left_padded_generation,
    perturb_polyattn,
)
from safetensors import safe_open

import hf_polyattn
from hf_polyattn import PolyAttnCache, PolyAttnConfig, cache_kwargs, returned_cache

SINK_CONFIGS = {
    # StreamingLLM: the window and the first keys, nothing else
    "streaming": PolyAttnConfig(kind="sliding_window", window=4, sinks=2),
    "polysketch": PolyAttnConfig(kind="polysketch", sketch="learned", sketch_size=8, window=5, sinks=2, learned_sinks=3,
                                 feature_proj=16, qk_norm=True, block_size=4),
    "linear": PolyAttnConfig(kind="linear", window=3, sinks=1, learned_sinks=2, window_mix=True, block_size=4),
}


def _model(name: str, arch: str = "llama"):
    model = build(arch, SINK_CONFIGS[name])
    perturb_polyattn(model)  # the learned slots off their zero start
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _prompt(batch=1, length=10, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("prompt", [3, 10], ids=["sinks-leave-while-decoding", "sinks-leave-in-prefill"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(SINK_CONFIGS))
def test_greedy_equals_full_forward_every_step(name, arch, prompt):
    """A prompt shorter than the window (the sinks leave it one decoding step at a time) or longer (they leave it in
    the prefill), then 8 new tokens decoded through the state."""
    check_greedy_steps(_model(name, arch), _prompt(length=prompt))


@pytest.mark.parametrize("name", list(SINK_CONFIGS))
def test_left_padded_batch_generation_equals_rows(name):
    """The sinks of a left-padded row are its first real tokens: the row generates as it does alone. Row 1's 3 tokens
    after 9 pads are still in the window after the prefill: its sinks leave it while decoding, row 0's before."""
    model = _model(name)
    check_left_padded_generation(model, [_prompt(1, 12, seed=1)[0], _prompt(1, 3, seed=2)[0]], 12)


@pytest.mark.parametrize("name", list(SINK_CONFIGS))
def test_chunked_prefill_equals_full_forward(name):
    """A left-padded batch: prefill 3 tokens, then chunks of 4, 1, 2, ... through the cache = one forward."""
    model = _model(name)
    ids = _prompt(2, 17, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        out = model(ids[:, :3], attention_mask=mask[:, :3], position_ids=position_ids[:, :3], use_cache=True)
        logits, past, t = [out.logits], returned_cache(out), 3
        for size in (4, 1, 2, 3, 1, 1, 2):
            out = model(ids[:, t : t + size], attention_mask=mask[:, : t + size], **cache_kwargs(past),
                        position_ids=position_ids[:, t : t + size], use_cache=True)
            logits.append(out.logits)
            t += size
    assert t == ids.shape[1]
    torch.testing.assert_close(torch.cat(logits, dim=1)[mask.bool()], full[mask.bool()], rtol=1e-4, atol=1e-4)


def test_beam_search_reorders_sink_slots():
    model = _model("polysketch")
    ids = _prompt(2)
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2, early_stopping=False)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_state_keeps_sinks_and_window_only():
    """Once the window is full, the state holds s sinks + w window keys per layer, whatever the length."""
    model = _model("polysketch")
    cfg = SINK_CONFIGS["polysketch"]
    ids = _prompt()
    caches = []
    for steps in (4, 20):
        cache = PolyAttnCache(model)
        model.generate(ids, max_new_tokens=steps, do_sample=False, **cache_kwargs(cache))
        caches.append(cache)
        for layer in cache.layers:
            state = layer.state
            assert state.k.shape[2] == cfg.window and state.sink_k.shape[2] == cfg.sinks
            assert state.sink_mask.all()
    assert caches[0].nbytes() == caches[1].nbytes()


@pytest.mark.parametrize("name", list(SINK_CONFIGS))
def test_save_reload_keeps_sinks(tmp_path, name):
    model = _model(name)
    ids = _prompt(2, 13, seed=4)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    again = auto_class(ARCHS["llama"]).from_pretrained(tmp_path).eval()
    cfg = hf_polyattn.get_polyattn_config(again)
    assert cfg == SINK_CONFIGS[name] and cfg.sinks == SINK_CONFIGS[name].sinks
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        slots = sorted(key for key in f.keys() if ".polyattn.sink_" in key)
        learned = SINK_CONFIGS[name].learned_sinks
        assert len(slots) == (4 if learned else 0)  # sink_k, sink_v of both layers
        for key in slots:
            saved = f.get_tensor(key)
            assert saved.shape == (2, 1, learned, 16) and saved.abs().any()  # (kv heads, 1, slots, head_dim)
            torch.testing.assert_close(saved, again.get_parameter(key))


def test_encoder_refuses_sinks_at_call_time_and_takes_learned_slots(tmp_path):
    """BERT: sinks are a causal phenomenon (the call says so); learned slots work bidirectionally and persist."""
    model = build("bert", PolyAttnConfig(kind="linear", window=4, sinks=2))
    ids = _prompt(1, 9)
    with pytest.raises(ValueError, match=r"sinks=2 is defined for causal attention only"):
        model(ids)
    model = build("bert", PolyAttnConfig(kind="linear", window=4, learned_sinks=3))
    perturb_polyattn(model)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    again = auto_class(ARCHS["bert"]).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_model_finite(dtype):
    model = _model("polysketch").to(dtype)
    ids = _prompt(2, 12, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = model(ids, attention_mask=mask, labels=ids)
    assert torch.isfinite(out.logits).all()
    out.loss.backward()
    slot_grads = [p.grad for n, p in model.named_parameters() if ".polyattn.sink_" in n]
    assert slot_grads and all(g is not None and torch.isfinite(g).all() for g in slot_grads)
    seq = model.generate(ids[1:], max_new_tokens=4, do_sample=False)
    assert seq.shape == (1, 16)
