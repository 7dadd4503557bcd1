import pytest
import torch

import hf_polyattn
from hf_polyattn import PolyAttnConfig
from hf_polyattn.training.transfer import distillation, polyattn_parameters, transfer_loss


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4, num_labels=2))


CFG = PolyAttnConfig(kind="polysketch", sketch="learned", sketch_size=8, local_exact=True, qk_norm=True, block_size=8)


def test_distillation_returns_the_teacher_and_restores_the_model():
    model = _llama().eval()
    x = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        soft = model(x).logits
    hf_polyattn.convert(model, CFG)
    with torch.no_grad():
        swapped = model(x).logits
    assert not torch.allclose(soft, swapped, atol=1e-3)
    frozen = {n for n, p in model.named_parameters() if ".polyattn." not in n}
    with distillation(model, attn_ce_weight=0.5) as coll, torch.no_grad():
        teacher_run = model(x, use_cache=False).logits  # layers see softmax outputs: the softmax model's logits
        assert len(coll.losses) == 2  # one per layer
        assert len(coll.ce) == 2 and all(0 < c < 10 for c in coll.ce)  # weights cross-entropy, in nats
        assert all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    torch.testing.assert_close(teacher_run, soft, rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation == "polysketch"
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, swapped)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_transfer_lowers_the_mse_and_trains_only_polyattn(arch):
    model = _llama() if arch == "llama" else _bert()
    hf_polyattn.convert(model, CFG if arch == "llama" else CFG.replace(local_exact=False))
    x = torch.randint(1, 64, (2, 24))
    mask = torch.ones_like(x)
    if arch == "bert":
        mask[:1, 16:] = 0  # padding: the student gets the key padding mask, padded rows do not count
    batch = {"input_ids": x, "attention_mask": mask}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with distillation(model) as coll:
        params = [p for _, p in polyattn_parameters(model)]
        opt = torch.optim.Adam(params, lr=1e-2)
        losses = []
        for _ in range(25):
            loss = transfer_loss(model.base_model, batch, coll)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(sum(coll.mse) / len(coll.mse))
    assert losses[-1] < 0.7 * losses[0], losses
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".polyattn." in n for n in changed)


def test_transfer_needs_a_converted_model():
    with pytest.raises(ValueError, match="convert"):
        with distillation(_llama()):
            pass


def test_transfer_with_softmax_heads_trains_the_kind_on_the_other_heads(monkeypatch):
    """Layer 0 keeps kv head 1 softmax (the kind runs kv head 0), layer 1 keeps both: the student is the kind's
    module on kv head 0 of layer 0 alone, its MSE is against those query heads of the teacher, layer 1 adds no loss,
    and every trainable parameter gets a gradient (DDP fails on one that gets none)."""
    from transformers import AttentionInterface

    from hf_polyattn.ops import softmax_attention
    from hf_polyattn.training.transfer import DISTILL_NAME, register_distill_attention

    model = _llama().eval()
    hf_polyattn.convert(model, CFG.replace(softmax_heads=[(0, 1), (1, 0), (1, 1)]))
    params = polyattn_parameters(model)
    assert params and all(n.startswith("model.layers.0.self_attn.polyattn.kernel.") for n, _ in params)
    register_distill_attention()
    seen = []
    inner = AttentionInterface._global_mapping[DISTILL_NAME]

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.polyattn, query.detach(), key.detach(), value.detach(), kwargs.get("scaling")))
        return inner(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, DISTILL_NAME, spy)
    x = torch.randint(1, 64, (2, 24))
    with distillation(model) as coll:
        loss = transfer_loss(model.base_model, {"input_ids": x}, coll)
        assert len(coll.losses) == 1 and coll.exact_layers == 1
        loss.backward()
    for name, p in params:  # in the graph (a learned sketch's hidden layer gets a zero gradient at its init)
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert all(p.grad.abs().max() > 0 for n, p in params if "norm" in n)
    poly, q, k, v, scaling = seen[0]
    with torch.no_grad():
        student = poly.kernel(q[:, :2], k[:, :1], v[:, :1], causal=True, scaling=scaling)
        teacher = softmax_attention(q[:, :2], k[:, :1], v[:, :1], causal=True, scale=scaling)
    assert coll.mse[0] == pytest.approx(float((student - teacher).square().mean()), rel=1e-4)


def test_transfer_refuses_a_model_with_every_head_softmax():
    model = _llama()
    hf_polyattn.convert(model, CFG.replace(softmax_heads=[(i, h) for i in range(2) for h in range(2)]))
    with pytest.raises(ValueError, match="softmax_heads names every kv head"):
        polyattn_parameters(model)


def test_transfer_runs_the_sparse_cache_in_its_forward_with_gradients():
    """A model given the linear-only preset's inference settings (a bounded sparse cache re-chosen by the last
    queries, the decay bound: ``hf_polyattn.reconfigure``) transfers with them: the student of every layer is the
    cache's forward (its MSE differs from the same model's without the cache once the cache evicts: 40 tokens, window
    4, blocks of 4, 3 cached keys), and every trainable parameter gets a finite gradient through it (the selection
    is under no_grad, the fold of the evicted keys and the exact part over the kept ones are not)."""
    model = _llama().eval()
    hf_polyattn.convert(model, PolyAttnConfig(kind="linear", feature_map="hedgehog", window=4, sinks=1,
                                              decay="gate", qk_norm=True, block_size=8))
    x = torch.randint(1, 64, (2, 40))

    def mse():
        with distillation(model) as coll, torch.no_grad():
            transfer_loss(model.base_model, {"input_ids": x}, coll)
            return list(coll.mse)

    without = mse()
    hf_polyattn.reconfigure(model, sparse_cache=3, sparse_chunk=4, sparse_observe=2, decay_max_horizon=16.0)
    with_cache = mse()
    assert all(abs(a - b) > 1e-6 * max(a, b) for a, b in zip(with_cache, without)), (with_cache, without)
    params = polyattn_parameters(model)
    with distillation(model) as coll:
        loss = transfer_loss(model.base_model, {"input_ids": x}, coll)
        loss.backward()
    for name, p in params:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert sum(int(p.grad.abs().max() > 0) for _, p in params) > len(params) // 2
