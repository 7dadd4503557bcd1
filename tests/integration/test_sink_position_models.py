"""Sinks scored at positions within the window (``sink_position='window'``) through transformers models: the module
gets the model's own RoPE frequencies (Llama, Mistral, Qwen2, GPT-NeoX's partial rotary, scaled rope types), generate()
with the recurrent cache equals the uncached forward at lengths beyond w + s, left-padded rows equal themselves
alone (generate, and a forward without position_ids), 'window' changes exactly the positions beyond w + s - 1 of a
RoPE model and nothing of GPT-2, a RoPE the code cannot read is refused at convert / from_pretrained naming
sink_position='own' (also a module whose queries are not the rotation its apply_rotary_pos_emb reads), the reading
leaves the module alone and works on the meta device and for a bf16 model, softmax_heads pass the rotation on,
config.json from before sink_position reloads as 'own'."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from integration_helpers import (
    ARCHS,
    VOCAB,
    check_greedy_steps,
    check_left_padded_generation,
    generating,
    perturb_polyattn,
)

import hf_polyattn
from hf_polyattn import PolyAttnConfig
from hf_polyattn.integration.rope import model_rope, uses_rope

W, S = 4, 2
STREAMING = PolyAttnConfig(kind="sliding_window", window=W, sinks=S)
POLYSKETCH = PolyAttnConfig(kind="polysketch", sketch="learned", sketch_size=8, window=W, sinks=S, learned_sinks=2,
                            block_size=4)
ROPE_ARCHS = ["llama", "mistral", "qwen2", "gpt_neox"]


def _config(arch: str, **changes):
    config = ARCHS[arch].make_config()
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def _model(arch: str = "llama", cfg: PolyAttnConfig = STREAMING, **changes):
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, ARCHS[arch].model_cls)(_config(arch, **changes)).eval()
    hf_polyattn.convert(model, cfg)
    perturb_polyattn(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _layers(model):
    return [m for m in model.modules() if isinstance(m, hf_polyattn.integration.state.HFPolyAttention)]


def _prompt(batch=1, length=12, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _rotary_emb(model):
    return next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))


SCALED = {"linear": dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
          "llama3": dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=32),
          "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)}


@pytest.mark.parametrize("arch,rope", [*((a, None) for a in ROPE_ARCHS), *(("llama", t) for t in SCALED)],
                         ids=[*ROPE_ARCHS, *(f"llama-{t}" for t in SCALED)])
def test_module_gets_the_models_frequencies(arch, rope):
    """The frequencies the module re-rotates with are the model's rotary embedding's, every layer; GPT-NeoX rotates
    a quarter of its 16-dim heads."""
    changes = {} if rope is None else {"rope_parameters": SCALED[rope]}
    model = _model(arch, **changes)
    want = _rotary_emb(model).inv_freq
    for layer in _layers(model):
        assert torch.equal(layer.rope.inv_freq, want.cpu()) and layer.rope.rotary_dim == 2 * want.numel()
    assert _layers(model)[0].rope.rotary_dim == (4 if arch == "gpt_neox" else 16)


@pytest.mark.parametrize("arch", ROPE_ARCHS)
@pytest.mark.parametrize("cfg", [STREAMING, POLYSKETCH], ids=["streaming", "polysketch"])
def test_greedy_equals_full_forward_every_step(arch, cfg):
    """A 12-token prompt (beyond w + s = 6) and 8 decoded tokens: cache = no cache at every step."""
    check_greedy_steps(_model(arch, cfg), _prompt())


@pytest.mark.parametrize("cfg", [STREAMING, POLYSKETCH], ids=["streaming", "polysketch"])
def test_left_padded_generation_equals_rows(cfg):
    """Left padding moves no position (generate's position_ids and the module's count agree); row 1's 3 tokens reach
    beyond w + s while decoding."""
    check_left_padded_generation(_model("llama", cfg), [_prompt(1, 12, seed=1)[0], _prompt(1, 3, seed=2)[0]], 12)


def test_left_padded_forward_without_position_ids_equals_row():
    """transformers then numbers positions from the padding on (a RoPE softmax model does not mind: all of a row's
    distances stay); the module counts the real keys before a query, so the sinks of a padded row sit where they sit
    alone. (Exact attention only: a kernel part's features of rotated q, k are not translation invariant.)"""
    model = _model("llama", STREAMING)
    ids = _prompt(2, 15, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        alone = model(ids[:1, 5:]).logits
    torch.testing.assert_close(batch[0, 5:], alone[0], rtol=1e-4, atol=1e-4)


def test_window_changes_exactly_the_positions_beyond_w_plus_s():
    """Same weights, 'window' against 'own' on a Llama: the logits of positions 0..w + s - 1 are the same (no query
    there is rotated, and later ones cannot reach them), every later one differs."""
    ids = _prompt(1, 16, seed=4)
    logits = {}
    for where in ("window", "own"):
        with torch.no_grad():
            logits[where] = _model("llama", STREAMING.replace(sink_position=where))(ids).logits[0]
    diff = (logits["window"] - logits["own"]).abs().amax(-1)
    assert (diff[: W + S] < 1e-6).all() and (diff[W + S :] > 1e-4).all(), diff


def test_gpt2_window_equals_own():
    """Positions added to the input embeddings: nothing to re-rotate, 'window' computes what 'own' computes."""
    ids = _prompt(2, 20, seed=5)
    out = {}
    for where in ("window", "own"):
        model = _model("gpt2", STREAMING.replace(sink_position=where))
        assert all(layer.rope is None for layer in _layers(model))
        with torch.no_grad():
            out[where] = model(ids).logits
    assert torch.equal(out["window"], out["own"])
    assert not uses_rope(ARCHS["gpt2"].make_config()) and uses_rope(ARCHS["llama"].make_config())


UNREADABLE = {
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "longrope": dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                     original_max_position_embeddings=64),
}
MATCH = r"sink_position='window' re-rotates .*Pass sink_position='own'"


@pytest.mark.parametrize("rope", list(UNREADABLE))
def test_unreadable_rope_is_refused(rope, tmp_path):
    """Frequencies that change with the length: convert raises before changing anything, from_pretrained with the
    settings in its config raises while building; sink_position='own' (or no sinks) converts."""
    import transformers

    model = transformers.LlamaForCausalLM(_config("llama", rope_parameters=UNREADABLE[rope])).eval()
    with pytest.raises(ValueError, match=MATCH):
        hf_polyattn.convert(model, STREAMING)
    assert not _layers(model) and model.config._attn_implementation != "sliding_window"
    model.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.polyattn = STREAMING.to_dict()
    with pytest.raises(ValueError, match=MATCH):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, config=config,
                                                          attn_implementation="sliding_window")
    config.polyattn = STREAMING.replace(sink_position="own").to_dict()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, config=config,
                                                               attn_implementation="sliding_window")
    assert _layers(loaded) and all(layer.rope is None for layer in _layers(loaded))


@pytest.mark.parametrize("rope_parameters,why", [
    (dict(rope_type="mystery", rope_theta=10000.0), r"LlamaRotaryEmbedding cannot be built from the config "
                                                    r"\(KeyError: 'mystery'\)"),
    (dict(full_attention=dict(rope_type="default", rope_theta=1e4)), r"LlamaRotaryEmbedding cannot be built"),
])
def test_unknown_rope_parameters_are_refused(rope_parameters, why):
    """(transformers' own Llama cannot be built with them either: the reading itself, on a module whose config
    changed after it was built)"""
    model = _model("llama", STREAMING.replace(sink_position="own"))
    attention = model.model.layers[0].self_attn
    attention.config.rope_parameters = rope_parameters
    with pytest.raises(ValueError, match=why + r".*sink_position='own'"):
        model_rope(attention, 0)


# ----------------------------------------------------------------------------- the reading, adversarially
_FAKE = "hf_polyattn_test_fake_modeling"  # a modeling module holding Llama's rotary embedding and rotation


def _twisted_attention(twist):
    """An attention class of a fake modeling module with Llama's RotaryEmbedding and apply_rotary_pos_emb, whose
    forward applies ``twist`` to q and k after the rotation (what apply_rotary_pos_emb alone does not show)."""
    import types

    from transformers.models.llama import modeling_llama as ml

    module = sys.modules.setdefault(_FAKE, types.ModuleType(_FAKE))
    module.TwistedRotaryEmbedding = ml.LlamaRotaryEmbedding
    module.apply_rotary_pos_emb = ml.apply_rotary_pos_emb

    class TwistedAttention(ml.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = (proj(hidden_states).view(shape).transpose(1, 2)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))
            q, k = ml.apply_rotary_pos_emb(q, k, *position_embeddings)
            q, k = twist(q), twist(k)
            fn = ml.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          ml.eager_attention_forward)
            out, _ = fn(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0, **kwargs)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None

    TwistedAttention.__module__ = _FAKE
    return TwistedAttention(_config("llama"), layer_idx=0)


TWISTS = {
    # a per-dim scale after the rotation (a norm after RoPE): R(delta) no longer commutes with what reaches us
    "scale-after-rope": (lambda x: x * torch.linspace(0.5, 2.0, x.shape[-1]), r"are not those rotations"),
    # the rotated dims moved elsewhere in the head (as MLA puts them last)
    "dims-moved": (lambda x: x.roll(3, dims=-1), r"are not those rotations"),
}


@pytest.mark.parametrize("twist", list(TWISTS))
def test_a_rotation_the_module_does_not_apply_as_read_is_refused(twist):
    """The module-level check: apply_rotary_pos_emb reads rotate_half with Llama's frequencies, but the module hands
    the attention function something else: refused (convert too), never a wrong re-rotation."""
    fn, why = TWISTS[twist]
    with pytest.raises(ValueError, match=why + r".*model_type='llama'.*sink_position='own'"):
        model_rope(_twisted_attention(fn), 0)


def test_the_plain_module_of_a_fake_modeling_module_reads_llamas_rotation():
    """The control of the twists: the same fake class without a twist reads Llama's own rotation."""
    rope = model_rope(_twisted_attention(lambda x: x), 0)
    want = _rotary_emb(_model("llama")).inv_freq
    assert rope.pairs is None and torch.equal(rope.inv_freq, want) and rope.rotary_dim == 16


def test_reading_leaves_the_module_alone_and_runs_on_the_meta_device():
    """The probe runs a copy (random weights): the module's weights, config, attention choice and hooks are as
    they were; a module built on the meta device (from_pretrained) is read the same; each layer's reading is
    cached (the same object for the same kind of layer). GLM: interleaved pairs on half of each head."""
    import transformers

    from hf_polyattn.integration import rope as rope_module

    config = transformers.GlmConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GlmForCausalLM(config).eval()
    attention = model.model.layers[1].self_attn
    before = {n: t.clone() for n, t in attention.state_dict().items()}
    hooks = (dict(attention._forward_pre_hooks), dict(attention._forward_hooks))
    rope_module._CACHE.clear()
    rope = model_rope(attention, 1)
    assert rope.pairs is not None and torch.equal(rope.pairs, torch.arange(8).reshape(4, 2).T)
    assert all(torch.equal(before[n], t) for n, t in attention.state_dict().items())
    assert (dict(attention._forward_pre_hooks), dict(attention._forward_hooks)) == hooks
    assert model.config._attn_implementation == attention.config._attn_implementation != "polyattn_rope_probe"
    assert model_rope(model.model.layers[0].self_attn, 0) is rope  # one reading per kind of layer
    with torch.device("meta"):
        meta = transformers.GlmForCausalLM(config)
    rope_module._CACHE.clear()
    again = model_rope(meta.model.layers[1].self_attn, 1)
    assert again is not rope and torch.equal(again.pairs, rope.pairs) and torch.equal(again.inv_freq, rope.inv_freq)


def test_gemma3_layers_read_their_own_layer_types_rotation():
    """Gemma 3 rotates its sliding layers with base 10,000 and its full-attention layers with base 1,000,000 (one
    rotary embedding, per layer type, after q/k norms): each layer reads its own type's frequencies (the sliding
    layers themselves are refused at convert for now; the reading is what a converted full layer gets)."""
    import transformers

    config = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=16, max_position_embeddings=128, pad_token_id=0,
                                           layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    rotary = model.model.rotary_emb
    for idx, layer in enumerate(model.model.layers):
        rope = model_rope(layer.self_attn, idx)
        assert rope.pairs is None and torch.equal(rope.inv_freq, getattr(rotary, f"{config.layer_types[idx]}_inv_freq"))
    assert not torch.equal(rotary.sliding_attention_inv_freq, rotary.full_attention_inv_freq)


def test_a_bf16_model_reads_the_float32_rotation_and_decodes():
    """A bf16 Cohere (interleaved pairs): the rotation is read from a float32 probe, the same as the float32 model's;
    greedy decoding beyond w + s stays finite and within bf16 rounding of the uncached forward."""
    import transformers

    config = transformers.CohereConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.CohereForCausalLM(config).eval()
    hf_polyattn.convert(model, STREAMING)
    want = _layers(model)[0].rope
    torch.manual_seed(0)
    half = transformers.CohereForCausalLM(config).to(torch.bfloat16).eval()
    hf_polyattn.convert(half, STREAMING)
    got = _layers(half)[0].rope
    assert torch.equal(got.pairs, want.pairs) and torch.equal(got.inv_freq, want.inv_freq)
    half.generation_config.eos_token_id = None
    out = half.generate(_prompt(1, 12), max_new_tokens=8, do_sample=False, output_logits=True,
                        return_dict_in_generate=True)
    assert all(torch.isfinite(step).all() for step in out.logits)
    with torch.no_grad():
        full = half(out.sequences[:, :-1], use_cache=False).logits[:, 11:].float()
    torch.testing.assert_close(torch.stack(out.logits, 1).float(), full, rtol=0.05, atol=0.05)


def test_softmax_heads_pass_the_rotation_on():
    """A hybrid layer (kv head 0 of layer 1 softmax): the kind's module of the other heads re-rotates too."""
    model = _model("llama", STREAMING.replace(softmax_heads=((1, 0),)))
    hybrid = _layers(model)[1]
    assert hybrid.kernel is not None and hybrid.kernel.rope is hybrid.rope and hybrid.rope is not None
    check_greedy_steps(model, _prompt())


def test_reload_keeps_the_setting_and_reads_old_configs_as_own(tmp_path):
    """save -> reload keeps sink_position; a config.json written before the field existed (sinks, no sink_position)
    reloads as 'own', the attention it was saved with."""
    import transformers

    model = _model("llama")
    ids = _prompt(1, 14, seed=6)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_polyattn.get_polyattn_config(again).sink_position == "window"
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
    path = tmp_path / "config.json"
    stored = json.loads(path.read_text())
    del stored["polyattn"]["sink_position"]
    path.write_text(json.dumps(stored))
    old = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_polyattn.get_polyattn_config(old).sink_position == "own"
    with torch.no_grad():
        own = _model("llama", STREAMING.replace(sink_position="own"))(ids).logits
        torch.testing.assert_close(old(ids).logits, own, rtol=0, atol=0)


# ----------------------------------------------------------------------------- apply_rotary_pos_emb behind a wrapper
def _bare_wrapper(fn):
    """A wrapper of signature (*args, **kwargs) that keeps no ``__wrapped__``: the arguments cannot be named."""
    return lambda *args, **kwargs: fn(*args, **kwargs)


def _wraps_wrapper(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("wrap", [_bare_wrapper, _wraps_wrapper], ids=["bare", "functools.wraps"])
def test_a_wrapped_apply_rotary_pos_emb_is_read_through_its_wrapper(wrap):
    """transformers 5.25 wraps apply_rotary_pos_emb (use_kernel_forward_from_hub): its visible signature is
    (*args, **kwargs). The fake modeling module's function behind a bare wrapper (called as the models call it,
    (q, k, cos, sin)) and behind functools.wraps (named through __wrapped__) reads Llama's own rotation."""
    attention = _twisted_attention(lambda x: x)
    fake = sys.modules[_FAKE]
    plain = fake.apply_rotary_pos_emb
    try:
        fake.apply_rotary_pos_emb = wrap(plain)
        rope = model_rope(attention, 0)
    finally:
        fake.apply_rotary_pos_emb = plain
    want = _rotary_emb(_model("llama")).inv_freq
    assert rope.pairs is None and torch.equal(rope.inv_freq, want) and rope.rotary_dim == 16


def _interleaved_kernel(self, q, k, cos, sin, unsqueeze_dim=1):
    """A stand-in for a hub kernel that kernelize puts in place of apply_rotary_pos_emb: it turns the pairs
    (2t, 2t + 1) by frequency t (GPT-J's layout) where the Python function turns (t, t + d/2): a different rotation,
    so a reading of the Python function instead of what the model runs would be wrong."""
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)

    def turn(x):
        partner = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        return x * cos + partner * sin

    return turn(q), turn(k)


def test_a_hub_kernel_in_place_of_apply_rotary_pos_emb_is_the_rotation_read():
    """With the kernels package (transformers >= 5.25 requires it), each attention module calls its own
    apply_rotary_pos_emb wrapper, whose forward kernelize may replace with a hub kernel for the module's device.
    Such a kernel (here one turning interleaved pairs) changes the model's queries, and the rotation convert reads is
    the kernel's, not the Python function's: generate() with the recurrent cache still equals the uncached forward
    at every step beyond w + s."""
    import types

    import transformers
    from transformers.utils import is_kernels_available

    if not is_kernels_available():  # not installed, or outside this release's range (5.23 with kernels 0.19)
        pytest.skip("this transformers uses no kernels package: its apply_rotary_pos_emb is the plain function")

    from hf_polyattn.integration import rope as rope_module

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config("llama")).eval()
    ids = _prompt(1, 12, seed=7)
    with torch.no_grad():
        before = model(ids).logits
    wrappers = [m.__dict__["_kernel_funcs"] for m in model.modules() if "_kernel_funcs" in m.__dict__]
    assert wrappers and all(len(funcs) == 1 for funcs in wrappers)
    for funcs in wrappers:
        (func,) = funcs.values()
        func.forward = types.MethodType(_interleaved_kernel, func)  # what kernelize does with a layer it finds
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, before, atol=1e-3)  # the model runs the kernel
    rope_module._CACHE.clear()
    hf_polyattn.convert(model, STREAMING)
    perturb_polyattn(model)
    model.generation_config.eos_token_id = None
    for layer in _layers(model):
        assert layer.rope.pairs is not None and torch.equal(layer.rope.pairs, torch.arange(16).reshape(8, 2).T)
    check_greedy_steps(model, ids)
    plain = _model("llama")  # the same class without the kernel: the Python function's rotate_half
    assert all(layer.rope.pairs is None for layer in _layers(plain))


def _flipped_kernel(self, q, k, cos, sin, unsqueeze_dim=1):
    """A stand-in hub kernel that turns every pair (t, t + d/2) the other way round (sin negated): R(-p), a rotation
    the model applies as consistently as its own, that the Python function's reading gets wrong."""
    from transformers.models.llama.modeling_llama import rotate_half

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos - rotate_half(q) * sin, k * cos - rotate_half(k) * sin


def _unreadable_kernel(self, q, k, cos, sin, unsqueeze_dim=1):
    """A stand-in hub kernel that scales by cos instead of rotating: no rotation to read."""
    cos = cos.unsqueeze(unsqueeze_dim)
    return q * cos, k * cos


class _Repository:
    """A kernels repository (``RepositoryProtocol``: ``load`` gives the layer class) serving a stand-in kernel from
    this file instead of the Hub."""

    def __init__(self, kernel):
        self.kernel = kernel

    def load(self):
        from torch import nn

        return type(f"Kernel_{self.kernel.__name__}", (nn.Module,), {"forward": self.kernel})

    def __repr__(self) -> str:
        return f"_Repository({self.kernel.__name__})"


def _kernelize(model, kernel) -> None:
    """kernels' own ``kernelize`` on the CPU with ``kernel`` mapped to transformers' layer name "rotary_pos_emb" (on
    a GPU transformers maps it to kernels-community/rotary): it binds the layer's forward to each attention module's
    apply_rotary_pos_emb wrapper (kernels' ``_replace_forward``). ``kernel`` None: ``model.reset_kernels()``, back to
    the Python function."""
    from transformers.utils import is_kernels_available

    if not is_kernels_available():  # not installed, or outside this release's range (5.23 with kernels 0.19)
        pytest.skip("this transformers uses no kernels package: its apply_rotary_pos_emb is the plain function")
    if kernel is None:
        model.reset_kernels()
        return
    from kernels import Mode, kernelize, use_kernel_mapping

    with use_kernel_mapping({"rotary_pos_emb": {"cpu": {Mode.INFERENCE: _Repository(kernel)}}}, inherit_mapping=False):
        kernelize(model, device="cpu", mode=Mode.INFERENCE)
    funcs = [f for m in model.modules() for f in m.__dict__.get("_kernel_funcs", {}).values()]
    assert funcs and all(f.__dict__["forward"].__func__ is kernel for f in funcs)


def _llama(kernel=None):
    """A seeded Llama, ``kernel`` put in place of its apply_rotary_pos_emb before convert (None: none)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config("llama")).eval()
    if kernel is not None:
        _kernelize(model, kernel)
    hf_polyattn.convert(model, STREAMING)
    perturb_polyattn(model)
    return generating(model)


@pytest.mark.parametrize("kernel", [_flipped_kernel, _interleaved_kernel], ids=["sign-flip", "interleaved"])
def test_a_hub_kernel_put_in_after_convert_is_the_rotation_the_sinks_follow(kernel):
    """kernelize may replace apply_rotary_pos_emb after convert read the rotation: from_pretrained kernelizes at the
    end of loading (after the construction read it), and model.train() / eval() re-kernelize for the model's
    device when the kernels' mode changes. The sinks then follow the kernel from its first call on: the rotation and
    the logits are those of the same model kernelized before convert, and back to the Python function's when the
    kernel is removed (reset_kernels)."""
    ids = _prompt(1, 12, seed=7)
    model = _llama()
    with torch.no_grad():
        plain = model(ids).logits
    assert all(layer.rope.pairs is None for layer in _layers(model))  # rotate_half's layout, read at convert
    _kernelize(model, kernel)
    kernelized = _llama(kernel)
    with torch.no_grad():
        swapped = model(ids).logits
        want = kernelized(ids).logits
    for layer, ref in zip(_layers(model), _layers(kernelized), strict=True):
        assert layer.rope.pairs is not None and torch.equal(layer.rope.pairs, ref.rope.pairs)
        assert torch.equal(layer.rope.inv_freq, ref.rope.inv_freq)
    torch.testing.assert_close(swapped, want, rtol=0, atol=0)
    assert not torch.allclose(swapped, plain, atol=1e-3)
    check_greedy_steps(model, ids)
    _kernelize(model, None)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)
    assert all(layer.rope.pairs is None for layer in _layers(model))


def test_a_hub_kernel_put_in_after_convert_whose_rotation_cannot_be_read_is_refused():
    """A kernel whose rotation cannot be read is refused at its first call, naming sink_position='own' and the
    way back to the Python function, instead of re-rotating the sinks with the rotation read before it."""
    model = _llama()
    _kernelize(model, _unreadable_kernel)
    with pytest.raises(ValueError, match=r"replaced after its rotation was read.*sink_position='own'.*reset_kernels"):
        model(_prompt(1, 12))


def test_kernelize_without_a_rotary_kernel_reads_the_rotation_once(tmp_path, monkeypatch):
    """transformers 5.25 kernelizes at the end of from_pretrained (use_kernels on by default) and again at every
    model.train() / eval() that changes the kernels' mode; on the CPU it maps no rotary kernel, so the wrappers keep
    the Python function and the rotation read while the model was built stands: no reading again at any call."""
    import transformers
    from transformers.utils import is_kernels_available

    from hf_polyattn.integration import state

    if not is_kernels_available():  # not installed, or outside this release's range (5.23 with kernels 0.19)
        pytest.skip("this transformers uses no kernels package: nothing kernelizes the model")
    _llama().save_pretrained(tmp_path)
    reads = []
    monkeypatch.setattr(state, "model_rope", lambda *args, **kwargs: reads.append(args) or model_rope(*args, **kwargs))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.use_kernels and len(reads) == len(_layers(model)) == 2
    for mode in ("train", "eval", "train", "eval"):
        getattr(model, mode)()
        with torch.no_grad():
            model(_prompt(1, 12))
    assert len(reads) == 2
