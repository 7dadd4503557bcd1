"""kind='sliding_window' on a call with fewer queries than keys (a decode step, a chunk after a cache): only the
call's rows are computed, through the fused kernel (``SlidingWindowAttention._window_rows``: inference on the CPU in
float32) or as tensors (``_window_rows_dense``: half precision, a gradient, another device or backend, a polynomial
window), with the padded path's result (``cached_rows = False``) and the full forward's."""

import pytest
import torch

import hf_polyattn
from hf_polyattn.integration.compatibility import cache_kwargs, returned_cache
from hf_polyattn.kinds import sliding_window

SWA = sliding_window.SlidingWindowAttention


def _model(window: int, sinks: int, **opts):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig.for_kind("sliding_window", window=window, sinks=sinks,
                                                                   **opts))
    return model


def _chunked(model, ids, mask, prefill: int, step: int) -> torch.Tensor:
    """Last-position logits of a prefill and of each chunk of ``step`` tokens decoded on its cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
        logits, cache = [out.logits[:, -1]], returned_cache(out)
        for t in range(prefill, ids.shape[1], step):
            out = model(ids[:, t:t + step], attention_mask=mask[:, :t + step], **cache_kwargs(cache), use_cache=True)
            cache = returned_cache(out)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


def _inputs(seed=0):
    ids = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 41, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    return ids, mask


def _spy(monkeypatch, name):
    """Record the query rows of every call of ``SWA.<name>``."""
    fn, used = getattr(SWA, name), []
    monkeypatch.setattr(SWA, name, lambda self, q5, *a, **k: used.append(q5.shape[3]) or fn(self, q5, *a, **k))
    return used


def _padded(model, ids, mask, prefill, step, monkeypatch):
    monkeypatch.setattr(SWA, "cached_rows", False)
    try:
        return _chunked(model, ids, mask, prefill, step)
    finally:
        monkeypatch.setattr(SWA, "cached_rows", True)


@pytest.mark.parametrize("window,sinks,step", [(8, 2, 1), (8, 2, 3), (6, 0, 1), (16, 4, 5)])
def test_rows_of_a_cached_call_equal_the_padded_path(window, sinks, step, monkeypatch):
    model = _model(window, sinks)
    ids, mask = _inputs()
    used = _spy(monkeypatch, "_window_rows")
    fast = _chunked(model, ids, mask, 11, step)
    assert used and max(used) == step  # every cached call took the fused rows path, with its own rows only
    padded = _padded(model, ids, mask, 11, step, monkeypatch)
    torch.testing.assert_close(fast, padded, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(fast[-1], full, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(fast).all()


@pytest.mark.parametrize("window,sinks,step,opts", [
    (8, 2, 1, {}), (8, 2, 3, {}), (6, 0, 1, {}), (16, 4, 5, {}),
    (8, 2, 2, {"local_kernel": "polynomial", "degree": 2}),  # not softmax: never the fused kernel's case
    (8, 2, 1, {"learned_sinks": 2}),
])
def test_dense_rows_equal_the_padded_path(window, sinks, step, opts, monkeypatch):
    model = _model(window, sinks, **opts)
    ids, mask = _inputs(1)
    monkeypatch.setattr(SWA, "_fused_exact", lambda self, q: False)  # as in bf16, with a gradient, on CUDA
    used = _spy(monkeypatch, "_window_rows_dense")
    dense = _chunked(model, ids, mask, 11, step)
    assert used and max(used) == step
    padded = _padded(model, ids, mask, 11, step, monkeypatch)
    torch.testing.assert_close(dense, padded, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(dense[-1], full, rtol=1e-5, atol=1e-5)


def test_half_precision_model_decodes_by_its_rows(monkeypatch):
    """A bf16 model on the CPU: its queries reach the attention in float32 (the fused kernel's case), and a decode
    step reads its own row only, within bf16's rounding of the float32 model."""
    model = _model(8, 2)
    ids, mask = _inputs(2)
    with torch.no_grad():
        reference = _chunked(model, ids, mask, 11, 1)
    model = model.to(torch.bfloat16)
    used = _spy(monkeypatch, "_window_rows")
    half = _chunked(model, ids, mask, 11, 1)
    assert used and set(used) == {1} and half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), reference, rtol=0.05, atol=0.05)


def _layer(model):
    return next(m for m in model.modules() if isinstance(m, SWA))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lq", [1, 4])
def test_dense_rows_take_half_inputs(dtype, lq, monkeypatch):
    """Half-precision inputs as a CUDA layer gets them: scored in float32, the padded path's result within half
    precision's rounding, finite."""
    layer = _layer(_model(8, 0))
    g = torch.Generator().manual_seed(4)
    q5, k5, v5 = (torch.randn(2, 2, 2 if i == 0 else 1, lq if i == 0 else 19, 8, generator=g) for i in range(3))
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :3] = False
    used = _spy(monkeypatch, "_window_rows_dense")
    half = layer.run_path("window", q5.to(dtype), k5.to(dtype), v5.to(dtype), mask, True, 8 ** -0.5, None, None)[0]
    assert used == [lq] and torch.isfinite(half).all()
    monkeypatch.setattr(SWA, "cached_rows", False)
    full = layer.run_path("window", q5, k5, v5, mask, True, 8 ** -0.5, None, None)[0]
    assert half.shape == full.shape
    torch.testing.assert_close(half.float(), full.float(), rtol=0.02, atol=0.02)


def test_a_gradient_flows_through_the_dense_rows(monkeypatch):
    """A cached call with a gradient recorded (rows_flash has no backward) takes the dense rows: the same gradients
    as the padded path."""
    model = _model(8, 2)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(3))
    grads = []
    for rows in (True, False):
        monkeypatch.setattr(SWA, "cached_rows", rows)
        used = _spy(monkeypatch, "_window_rows_dense")
        model.zero_grad()
        with torch.no_grad():
            cache = returned_cache(model(ids[:, :12], use_cache=True))
        out = model(ids[:, 12:], **cache_kwargs(cache), use_cache=True).logits
        out.sum().backward()
        assert bool(used) == rows
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert grads[0] and len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
