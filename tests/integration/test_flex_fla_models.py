"""backend 'fla' (FlexAttention window + fla-core's gated state, ops/flex.py) through transformers models, with the
kernels' stand-ins of tests/ops/flex_fla_standins.py: generate() with the recurrent cache (the decode step) equals the
uncached forward (the 'fla' path) at every step, a left-padded batch generates what each row does alone, a hybrid
layer (softmax kv heads beside), a RoPE model (sinks scored at their window positions) and one without (GPT-2), a
bf16 model's forward and backward."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import assert_left_padded_generation_equals_rows, build, check_greedy_steps, perturb_polyattn

from hf_polyattn import PolyAttnConfig
from tests.ops.test_flex_fla import LONG, standins  # noqa: F401  (standins: the fixture)

# the long-context default at test size (window 5, 2 sinks), the tiny models' head_dim 16 as the projection
LONG16 = {**LONG, "feature_proj": 16, "block_size": 4, "backend": "fla"}
MODELS = {
    "llama-long": ("llama", PolyAttnConfig(**LONG16)),
    "llama-long-hybrid": ("llama", PolyAttnConfig(**LONG16, softmax_heads=((0, 1), (1, 0)))),
    "gpt2-long": ("gpt2", PolyAttnConfig(**LONG16)),
}


def _model(name, dtype=torch.float32):
    arch, cfg = MODELS[name]
    model = build(arch, cfg).to(dtype)
    perturb_polyattn(model)
    model.generation_config.eos_token_id = None  # random tiny models would stop at random
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_equals_full_forward(name, standins):  # noqa: F811
    check_greedy_steps(_model(name), torch.randint(3, 100, (1, 14)), steps=6)
    assert standins["flex"] and standins["gla"]


@pytest.mark.parametrize("name", ["llama-long", "llama-long-hybrid"])
def test_left_padded_batch_generation_equals_rows(name, standins):  # noqa: F811
    assert_left_padded_generation_equals_rows(_model(name), pad=3, length=13)


def test_bf16_model_forward_backward(standins):  # noqa: F811
    model = _model("llama-long", torch.bfloat16)
    ids = torch.randint(3, 100, (2, 21))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    out = model(ids, attention_mask=mask, labels=ids, use_cache=False)  # with a cache the state path runs fp32
    assert torch.isfinite(out.logits.float()).all() and torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if ".polyattn." in n and p.grad is not None]
    assert grads and all(torch.isfinite(g.float()).all() for g in grads)
    assert any(c["dtype"] == torch.bfloat16 for c in standins["flex"])
