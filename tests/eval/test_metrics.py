import math

import pytest
import torch
from torch.nn import functional as F

from hf_polyattn.eval.metrics import accuracy, perplexity, perplexity_windows


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("n,context,stride", [(40, 16, 16), (40, 16, 5), (33, 8, 8), (16, 16, 4), (10, 16, 3)])
def test_windows_score_each_token_at_most_once(n, context, stride):
    seen = []
    for s, first, e in perplexity_windows(n, context, stride):
        assert e - s == min(context, n) and s < first <= e
        seen += list(range(first, e))
    assert len(seen) == len(set(seen)) and max(seen) == n - 1
    if stride < context:
        assert sorted(seen) == list(range(1, n))


def test_perplexity_matches_a_hand_computation():
    model = _tiny_llama()
    ids = torch.randint(0, 50, (37,))
    context, stride = 12, 5
    # by hand: every token t >= 1 once, predicted from the window that first covers it
    nll, count = 0.0, 0
    for s, first, e in perplexity_windows(37, context, stride):
        with torch.no_grad():
            logp = F.log_softmax(model(ids[None, s:e]).logits[0].double(), -1)
        for t in range(first, e):
            nll -= logp[t - 1 - s, ids[t]].item()
            count += 1
    r = perplexity(model, ids, context=context, stride=stride, batch_size=3)
    assert r["tokens"] == count == 36
    assert r["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    # non-overlapping windows, one window in one go: the plain exp(mean NLL) of a single forward
    short = ids[:12]
    with torch.no_grad():
        ref = F.cross_entropy(model(short[None]).logits[0, :-1], short[1:])
    assert perplexity(model, short, context=12, stride=12)["perplexity"] == pytest.approx(math.exp(ref), rel=1e-5)


def test_perplexity_bounds_the_logits_it_holds(monkeypatch):
    """A large vocabulary (Gemma 3's 262,144 tokens) must not hold a whole batch's logits and cross_entropy's
    temporaries at once: the batch is cut to LOGITS_BUDGET logits (one window at least) and the NLL computed in
    chunks of positions, with the same result as one unbounded pass; bf16 logits are upcast chunk by chunk."""
    import hf_polyattn.eval.metrics as metrics

    model = _tiny_llama()
    ids = torch.randint(0, 50, (97,))
    free = perplexity(model, ids, context=16, stride=16, batch_size=8)
    calls = []
    handle = model.register_forward_hook(lambda mod, args, kwargs, out: calls.append(kwargs["input_ids"].shape[0]),
                                         with_kwargs=True)
    monkeypatch.setattr(metrics, "LOGITS_BUDGET", 2 * 16 * 50)  # two windows of 16 tokens x 50 logits
    monkeypatch.setattr(metrics, "NLL_CHUNK", 3 * 50)  # three positions per cross_entropy call
    bounded = perplexity(model, ids, context=16, stride=16, batch_size=8)
    assert max(calls) == 2 and sum(calls) == free["windows"] == 7
    assert bounded["tokens"] == free["tokens"]
    assert bounded["perplexity"] == pytest.approx(free["perplexity"], rel=1e-6)
    calls.clear()
    monkeypatch.setattr(metrics, "LOGITS_BUDGET", 10)  # less than one window: one window per pass
    assert perplexity(model, ids, context=16, stride=16, batch_size=8)["perplexity"] == pytest.approx(
        free["perplexity"], rel=1e-6)
    assert set(calls) == {1}
    handle.remove()
    half = _tiny_llama().to(torch.bfloat16)
    r = perplexity(half, ids, context=16, stride=16, batch_size=8)
    assert math.isfinite(r["perplexity"])


def test_perplexity_rejects_bad_settings():
    with pytest.raises(ValueError, match="stride"):
        perplexity_windows(100, 16, 17)
    with pytest.raises(ValueError, match="context"):
        perplexity_windows(100, 1, 1)


def test_accuracy():
    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids):
            return type("O", (), {"logits": torch.stack([input_ids.float(), 1 - input_ids.float()], -1)[:, 0]})

    batches = [{"input_ids": torch.tensor([[1], [0], [1]]), "labels": torch.tensor([0, 1, 1])}]
    r = accuracy(Fixed(), batches)
    assert r["correct"] == 2 and r["examples"] == 3 and r["accuracy"] == pytest.approx(2 / 3)
    assert r["hits"] == "110"  # per example, in evaluation order
