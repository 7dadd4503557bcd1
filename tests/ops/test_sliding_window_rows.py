"""kind='sliding_window' on a call with fewer queries than keys (a decode step, a chunk after a cache), inference on
the CPU: only the call's rows are computed (``SlidingWindowAttention._window_rows``), with the padded path's result."""

import pytest
import torch

import hf_polyattn
from hf_polyattn.kinds import sliding_window


def _model(window: int, sinks: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig.for_kind("sliding_window", window=window, sinks=sinks))
    return model


def _chunked(model, ids, mask, prefill: int, step: int) -> torch.Tensor:
    """Last-position logits of a prefill and of each chunk of ``step`` tokens decoded on its cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
        logits, cache = [out.logits[:, -1]], out.past_key_values
        for t in range(prefill, ids.shape[1], step):
            out = model(ids[:, t:t + step], attention_mask=mask[:, :t + step], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("window,sinks,step", [(8, 2, 1), (8, 2, 3), (6, 0, 1), (16, 4, 5)])
def test_rows_of_a_cached_call_equal_the_padded_path(window, sinks, step, monkeypatch):
    model = _model(window, sinks)
    ids = torch.randint(0, 64, (2, 41))
    mask = torch.ones(2, 41, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    rows, used = sliding_window.SlidingWindowAttention._window_rows, []
    monkeypatch.setattr(sliding_window.SlidingWindowAttention, "_window_rows",
                        lambda self, q5, *a, **k: used.append(q5.shape[3]) or rows(self, q5, *a, **k))
    fast = _chunked(model, ids, mask, 11, step)
    assert used and max(used) == step  # every cached call took the rows path, with its own rows only
    monkeypatch.setattr(sliding_window.SlidingWindowAttention, "_fused_exact", lambda self, q: False)
    padded = _chunked(model, ids, mask, 11, step)
    torch.testing.assert_close(fast, padded, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(fast[-1], full, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(fast).all()


def test_rows_path_only_without_a_gradient():
    """Training (a gradient recorded) keeps the padded path: rows_flash has no backward."""
    model = _model(8, 2)
    ids = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        cache = model(ids[:, :12], use_cache=True).past_key_values
    out = model(ids[:, 12:], past_key_values=cache, use_cache=True).logits
    out.sum().backward()
    assert any(p.grad is not None for p in model.parameters())
