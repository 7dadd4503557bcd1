"""Decay of the kernel state (``PolyAttnConfig.decay``) through transformers models: generate() with the recurrent
cache equals the full forward at every step (left-padded batches included), save -> reload keeps the decay's
parameters, and an encoder refuses it when converted."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import (
    ARCHS,
    VOCAB,
    assert_left_padded_generation_equals_rows,
    auto_class,
    build,
    check_greedy_steps,
    perturb_polyattn,
    prompt_ids,
)

import hf_polyattn
from hf_polyattn import PolyAttnConfig

DECAYED = {
    # Llama: grouped-query attention (2 kv heads for 4 query heads), gates read from the values, a window
    "llama-gate-window": ("llama", PolyAttnConfig(kind="polysketch", sketch="learned", sketch_size=8, window=5,
                                                  feature_proj=16, block_size=4, decay="gate", decay_horizon=8.0)),
    "gpt2-scalar-window": ("gpt2", PolyAttnConfig(kind="performer", num_features=16, window=3, window_mix=True,
                                                  block_size=4, decay="scalar", decay_horizon=8.0)),
    "llama-scalar-local": ("llama", PolyAttnConfig(kind="linear", local_exact=True, block_size=4, decay="scalar",
                                                   decay_horizon=8.0)),
    "llama-gate-plain": ("llama", PolyAttnConfig(kind="taylor", block_size=4, decay="gate", decay_horizon=8.0)),
}


def _model(name):
    arch, cfg = DECAYED[name]
    model = build(arch, cfg)
    perturb_polyattn(model)  # the gates' weights off 0: they vary with the token
    model.generation_config.eos_token_id = None  # random tiny models would stop at random
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("name", list(DECAYED))
def test_greedy_generation_equals_full_forward(name):
    check_greedy_steps(_model(name), prompt_ids())


@pytest.mark.parametrize("name", ["llama-gate-window", "llama-scalar-local"])
def test_left_padded_batch_generation_equals_rows(name):
    """Padded keys have gate 1 and no value: a left-padded prompt generates what it generates alone (padding by
    4 = block_size keeps local_exact's blocks where they were)."""
    assert_left_padded_generation_equals_rows(_model(name), pad=4)


@pytest.mark.parametrize("name", ["llama-gate-window", "gpt2-scalar-window"])
def test_save_reload_identical(tmp_path, name):
    model = _model(name)
    arch, cfg = DECAYED[name]
    names = [n for n, _ in model.named_parameters() if n.endswith(("decay_theta", "gate_weight", "gate_bias"))]
    assert len(names) == (2 if cfg.decay == "scalar" else 4)  # one tensor (gate: two) per layer
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    again = auto_class(ARCHS[arch]).from_pretrained(tmp_path).eval()
    assert hf_polyattn.get_polyattn_config(again) == cfg
    for n in names:
        assert torch.equal(again.get_parameter(n), model.get_parameter(n)), n
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)


def test_encoder_refuses_decay():
    with pytest.raises(ValueError, match="decay='scalar' is defined for causal attention only.*bidirectional"):
        build("bert", PolyAttnConfig(kind="linear", window=4, decay="scalar"))
