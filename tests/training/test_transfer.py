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
