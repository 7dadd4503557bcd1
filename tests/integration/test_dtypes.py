"""Dtype contract: every kind in bf16 and fp16 models through every route a user takes.

Contract (docs/numerics_and_backends.md, "Dtypes and devices"): polyattn parameters and buffers follow the model's
dtype and device like every other weight (``from_pretrained(dtype=...)``, ``.to()``,
``.half()``, ``convert()`` of a half model); the kernels compute in float32 (the exact
tensor path in float64) and return the model's dtype. Before this contract, polysketch
raised ``expected m1 and m2 to have the same dtype`` in every half-precision model.
"""

from __future__ import annotations

import pytest
import torch
from integration_helpers import (
    ARCHS,
    CAUSAL_KINDS,
    KIND_CONFIGS,
    arch_kind_params,
    auto_class,
    build,
    has_tensors,
    perturb_polyattn,
)

import hf_polyattn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODELS = ["llama", "gpt2", "bert"]


def _ids(arch_name: str, n: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(3, 100, (2, n), generator=gen)


def _polyattn_dtypes(model) -> set[torch.dtype]:
    return {t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()]
            if ".polyattn." in n and t.is_floating_point()}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("dt_name", list(DTYPES))
@pytest.mark.parametrize("arch_name,kind", arch_kind_params(MODELS))
def test_half_precision_routes(tmp_path, arch_name, kind, dt_name):
    dt = DTYPES[dt_name]
    arch = ARCHS[arch_name]
    auto = auto_class(arch)
    ids = _ids(arch_name)
    held = {dt} if has_tensors(kind) else set()  # elu+1, the window alone, nystrom, fnet: no tensors

    fp32 = build(arch_name, kind)
    perturb_polyattn(fp32)  # learned / random tensors off their seed values: reloads must carry them
    fp32.save_pretrained(tmp_path / "fp32")
    ref = _logits(fp32, ids)

    # route 1: from_pretrained(..., dtype=half)
    loaded = auto.from_pretrained(tmp_path / "fp32", dtype=dt).eval()
    assert hf_polyattn.get_polyattn_config(loaded).kind == kind
    assert _polyattn_dtypes(loaded) == held
    out1 = _logits(loaded, ids)
    assert out1.dtype == dt and torch.isfinite(out1).all()
    # the half model is the fp32 model with rounded weights: same function up to rounding, far
    # from a model whose attention was silently replaced (softmax differs by O(1) here).
    torch.testing.assert_close(out1.float(), ref, atol=0.1, rtol=0.05)

    # route 2: .to(half) (and .half()) after convert: the same tensors as route 1
    cast = build(arch_name, kind)
    perturb_polyattn(cast)
    cast = cast.to(dt) if dt == torch.bfloat16 else cast.half()
    assert _polyattn_dtypes(cast) == held
    loaded_sd = loaded.state_dict()
    for name, t in cast.state_dict().items():  # every weight, polyattn ones included, bit-equal
        torch.testing.assert_close(t, loaded_sd[name], atol=0, rtol=0, msg=name)
    # not bit-equal logits: transformers keeps non-persistent buffers (RoPE inv_freq) in float32
    # under from_pretrained(dtype=...) while .to() casts them
    torch.testing.assert_close(_logits(cast, ids), out1, atol=0.02, rtol=0.02)

    # route 3: convert() of a model that is already half precision
    half = build(arch_name, None).to(dt)
    hf_polyattn.convert(half, KIND_CONFIGS[kind])
    assert _polyattn_dtypes(half) == held
    unperturbed = build(arch_name, kind).to(dt)
    # same seeded sketches, drawn in float64 and rounded once either way (double rounding
    # float64 -> float32 -> half may move a rare tie by one half-precision ulp)
    for (n1, t1), (n2, t2) in zip(half.state_dict().items(), unperturbed.state_dict().items()):
        assert n1 == n2
        torch.testing.assert_close(t1, t2, atol=0, rtol=2**-7, msg=n1)
    assert torch.isfinite(_logits(half, ids)).all()

    # route 4: save the half model -> reload with dtype="auto": same dtype, identical logits
    cast.save_pretrained(tmp_path / "half")
    again = auto.from_pretrained(tmp_path / "half", dtype="auto").eval()
    assert _polyattn_dtypes(again) == held
    torch.testing.assert_close(_logits(again, ids), out1, atol=0, rtol=0)  # both loaded by from_pretrained

    # route 5: generate (causal models) in half precision with the recurrent cache
    if arch.causal:
        gen = again.generate(ids[:, :6], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert gen.shape == (2, 14)
        assert int(gen.max()) < again.config.vocab_size


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_half_precision_training_step_is_finite(kind):
    """A bf16 model trains: loss and every polyattn gradient finite (degree-4 weights need float32 inside)."""
    model = build("llama", kind).to(torch.bfloat16).train()
    ids = _ids("llama", 20)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for n, p in model.named_parameters() if ".polyattn." in n and p.grad is not None]
    if any(p.requires_grad for n, p in model.named_parameters() if ".polyattn." in n):
        assert grads  # every trainable polyattn tensor got a gradient
    assert all(torch.isfinite(g).all() for g in grads)
