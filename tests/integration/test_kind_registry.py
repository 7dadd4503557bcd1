"""The kind registry end to end: every registered kind has a test row, a user's kind added with one call goes
through from_pretrained -> save -> reload -> generate, and a kind that cannot serve a model's direction fails
loudly at load/convert time."""

from __future__ import annotations

import json

import pytest
import torch
from integration_helpers import ARCHS, KIND_CONFIGS, VOCAB, auto_class, build

import hf_polyattn
from hf_polyattn import KindSpec, Option, PolyAttnConfig, kind_names, register_kind
from hf_polyattn.ops.base import KVCacheAttention
from hf_polyattn.registry import unregister_kind


def test_every_registered_kind_has_a_test_row():
    assert set(kind_names()) == set(KIND_CONFIGS), "add a row to integration_helpers.KIND_CONFIGS"


class DecayAttention(KVCacheAttention):
    """A user's kind: softmax with a learnable per-head recency bias -slope * (i - j) (ALiBi-like)."""

    def __init__(self, config, num_heads, head_dim, num_kv_heads=None, layer_idx=0):
        super().__init__(config, num_heads, head_dim, num_kv_heads, layer_idx)
        self.slope = torch.nn.Parameter(torch.empty(num_heads))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        self.slope.fill_(self.config.options["slope"])

    def attend(self, q, k, v, *, causal, scale, mask):
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        lq, lk = q.shape[2], k.shape[2]
        pos_q = torch.arange(lk - lq, lk, device=q.device)[:, None]
        pos_k = torch.arange(lk, device=q.device)[None, :]
        x = (q @ k.transpose(-1, -2)) * scale - self.slope.to(q.dtype)[:, None, None] * (pos_q - pos_k).abs()
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            allowed = pos_k <= pos_q
        allowed = allowed[None, None] if mask is None else allowed[None, None] & mask[:, None, None, :]
        w = torch.softmax(x.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        return w @ v


@pytest.fixture
def decay_kind():
    spec = register_kind(KindSpec(
        name="user_decay", module=DecayAttention, title="decayed softmax (a test kind)", linear_time=False,
        options={"slope": Option(0.1, "recency penalty per token", minimum=0.0)},
        label=lambda c: f"slope {c.options['slope']}",
    ))
    yield spec
    unregister_kind("user_decay")


def test_user_kind_end_to_end(decay_kind, tmp_path):
    arch = ARCHS["llama"]
    stock = build("llama", None)
    stock.save_pretrained(tmp_path / "stock")
    model = auto_class(arch).from_pretrained(tmp_path / "stock", attn_implementation="user_decay").eval()
    assert hf_polyattn.get_polyattn_config(model) == PolyAttnConfig.for_kind("user_decay")
    layers = [m for m in model.modules() if isinstance(m, hf_polyattn.HFPolyAttention)]
    assert len(layers) == 2 and all(isinstance(m, DecayAttention) for m in layers)
    with torch.no_grad():
        for m in layers:
            m.slope.add_(torch.arange(4.0) * 0.05)  # off their initial value: the reload must carry them
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        stock_logits = stock(ids).logits
    assert not torch.allclose(logits, stock_logits, atol=1e-3)  # the attention really changed
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["attn_implementation"] == "user_decay" and saved["polyattn"]["options"] == {"slope": 0.1}
    # importing hf_polyattn would not register a user's kind: no trust_remote_code loader that could not load it
    assert "auto_map" not in saved and not (tmp_path / "saved" / "hf_polyattn_loader.py").exists()
    again = auto_class(arch).from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, logits, rtol=0, atol=0)
    gen = again.generate(ids[:, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for step in range(6):  # cache (all keys kept) = recomputing the whole prefix
            full = again(gen[:, : 6 + step], use_cache=False).logits[:, -1]
            assert torch.equal(full.argmax(-1), gen[:, 6 + step])
    # a user kind reads the same table label / card machinery as the built-in ones
    assert PolyAttnConfig.for_kind("user_decay", slope=0.5).spec.table_label(
        PolyAttnConfig.for_kind("user_decay", slope=0.5)) == "user_decay (slope 0.5)"


def test_user_kind_options_are_validated(decay_kind):
    with pytest.raises(ValueError, match=r"slope must be a real number in \[0.0, None\], got -1"):
        PolyAttnConfig.for_kind("user_decay", slope=-1)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['slop'\] for kind='user_decay'; its options: "
                                         r"\['slope'\]"):
        PolyAttnConfig(kind="user_decay", options={"slop": 1.0})
    with pytest.raises(ValueError, match="options must be a dict"):
        PolyAttnConfig(kind="user_decay", options=[("slope", 1.0)])
    with pytest.raises(ValueError, match="kind='user_decay' does not read window"):
        PolyAttnConfig(kind="user_decay", window=4)


def test_register_kind_refuses_bad_specs(decay_kind):
    with pytest.raises(ValueError, match="already registered"):
        register_kind(KindSpec(name="user_decay", module=DecayAttention, title="another"))
    with pytest.raises(ValueError, match="kind name"):
        KindSpec(name="User Decay", module=DecayAttention, title="x")
    with pytest.raises(ValueError, match="taken by transformers"):
        KindSpec(name="sdpa", module=DecayAttention, title="x")
    with pytest.raises(TypeError, match="must be an Option"):
        KindSpec(name="user_x", module=DecayAttention, title="x", options={"a": 1})
    with pytest.raises(ValueError, match="unknown attention kind|kind must be one of"):
        PolyAttnConfig(kind="user_missing")


@pytest.mark.parametrize("kind", [k for k in KIND_CONFIGS if not KIND_CONFIGS[k].spec.causal])
def test_bidirectional_only_kind_refused_by_causal_models(kind, tmp_path):
    with pytest.raises(ValueError, match=rf"kind='{kind}' is bidirectional only .* is causal attention"):
        hf_polyattn.convert(build("llama", None), KIND_CONFIGS[kind])
    build("gpt2", None).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"kind='{kind}' is bidirectional only"):
        auto_class(ARCHS["gpt2"]).from_pretrained(tmp_path, attn_implementation=kind)
    hf_polyattn.convert(build("bert", None), KIND_CONFIGS[kind])  # an encoder is fine


@pytest.mark.parametrize("kind", [k for k in KIND_CONFIGS if not KIND_CONFIGS[k].spec.cross_attention
                                  and KIND_CONFIGS[k].spec.causal])
def test_one_sequence_kinds_refuse_cross_attention(kind):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, add_cross_attention=True))
    with pytest.raises(ValueError, match=rf"kind='{kind}' is not supported with cross-attention \(GPT2LMHeadModel: "
                                         r"config\.add_cross_attention=True\)"):
        hf_polyattn.convert(model, KIND_CONFIGS[kind])
