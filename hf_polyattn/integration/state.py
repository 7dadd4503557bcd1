"""Per-layer state attached to a transformers attention module (prefix ``polyattn``), and its hooks.

Each attention module (the module whose ``forward`` calls
``ALL_ATTENTION_FUNCTIONS.get_interface``) gets one submodule ``polyattn``: a
:class:`HFPolyAttention` holding that layer's sketches, feature parameters, q/k
LayerNorms and polynomial coefficients. Weight keys are therefore
``...self_attn.polyattn.*`` (Llama) or ``...attention.self.polyattn.*`` (BERT), saved and
loaded by the standard safetensors path. A second PolyAttention never shares a
Parameter: every layer builds its own.

They are created when the model is built (``construction.py``) or converted
(``convert.py``); the forward hooks installed here hand each call what the attention
function cannot see: the layer's recurrent state inside the cache, and whether the call
is cross-attention.

Why initialisation of missing keys goes through ``_is_hf_initialized``: weights absent
from a checkpoint are materialised with ``torch.empty_like`` and then only the modules
that answer ``_is_hf_initialized == False`` get ``_init_weights``, which knows nothing of
sketch buffers. :class:`HFPolyAttention` answers that question itself: when asked (by
transformers' init pass, after every checkpoint tensor has been loaded and flagged
``_is_hf_initialized``), it re-draws its tensors deterministically from the seed and
puts back the loaded ones. A module built on the meta device that was never finalised
refuses to run (``RuntimeError``) instead of computing with uninitialised memory.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_utils import PreTrainedModel

from ..config import PolyAttnConfig
from ..ops.base import AttentionBase
from ..ops.hybrid import layer_module_class
from ..ops.rotary import RopeRotation
from ..ops.sliding import SlidingWindowSoftmax
from .cache import polyattn_layer_of
from .compatibility import attention_dims, call_keyword_value, is_cross_attention_call
from .rope import kernel_repositories, model_rope, reads_rope, rotation_source
from .settings import BASE_MODEL_KEY, hub_model_id, persist_settings, polyattn_kind, resolve_polyattn_config

__all__ = ["HFPolyAttention", "attach_polyattn", "attach_sliding", "get_polyattn_config", "sink_rope", "sync_config"]


_HF_CLASSES: dict[type, type] = {}


def hf_class(module_class: type) -> type:
    """The kind's module class with the transformers loading protocol: ``HF<Name>(HFPolyAttention, <Name>)``,
    made once per class and published in this module (so that pickle finds it by name)."""
    if module_class not in _HF_CLASSES:
        if not (isinstance(module_class, type) and issubclass(module_class, AttentionBase)):
            raise TypeError(f"a kind's module must subclass hf_polyattn.ops.base.AttentionBase, got {module_class!r}")
        name = f"HF{module_class.__name__}"
        while name in globals():
            name += "_"
        cls = type(name, (HFPolyAttention, module_class), {"__module__": __name__, "__qualname__": name})
        globals()[name] = _HF_CLASSES[module_class] = cls
    return _HF_CLASSES[module_class]


class HFPolyAttention(AttentionBase):
    """A kind's module that follows the transformers loading protocol (see module docstring).

    ``HFPolyAttention(config, ...)`` builds ``hf_class(<the kind's module class>)`` (``hf_class(HybridAttention)``
    for a layer with softmax heads); every polyattn layer in a model is an instance of this class, whatever its kind.
    """

    def __new__(cls, config=None, num_heads=None, head_dim=None, num_kv_heads=None, layer_idx=0, **kwargs):
        if cls is HFPolyAttention:
            if not isinstance(config, PolyAttnConfig):
                raise TypeError(f"config must be a PolyAttnConfig, got {type(config).__name__}")
            # the kind's module, or the hybrid where config.softmax_heads names kv heads of this layer
            cls = hf_class(layer_module_class(config, layer_idx))
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Built on the meta device (from_pretrained): real values come from the checkpoint
        # or from finish_loading(); until then the module refuses to run.
        self._polyattn_ready = not any(t.is_meta for t in chain(self.parameters(), self.buffers()))

    @property
    def _is_hf_initialized(self) -> bool:
        # Asked by transformers' init pass after loading: initialise what the checkpoint
        # did not provide, and answer True so that `_init_weights` leaves us alone.
        if not self._polyattn_ready:
            self.finish_loading()
        return True

    @_is_hf_initialized.setter
    def _is_hf_initialized(self, value: bool) -> None:
        pass  # readiness is tracked by _polyattn_ready

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Deterministically initialise every tensor not flagged as loaded; keep the loaded ones."""
        tensors = dict(chain(self.named_parameters(), self.named_buffers()))
        if any(t.is_meta for t in tensors.values()):
            return  # not materialised yet: a later call (or the forward check) handles it
        loaded = {n: t.detach().clone() for n, t in tensors.items() if getattr(t, "_is_hf_initialized", False)}
        if len(loaded) < len(tensors):
            self.reset_parameters()
            for name, value in loaded.items():
                tensors[name].copy_(value)
        self._polyattn_ready = True

    def check_ready(self) -> None:
        if self._polyattn_ready:
            return
        if not any(t.is_meta for t in chain(self.parameters(), self.buffers())):
            # Materialised by a loader other than from_pretrained (accelerate's
            # load_checkpoint_and_dispatch, to_empty + load_state_dict): its values are the
            # loaded ones; re-drawing them here would overwrite a checkpoint.
            self._polyattn_ready = True
            return
        raise RuntimeError(
            f"the polyattn parameters of layer {self.layer_idx} are still on the meta device (never loaded or "
            "initialised): load the model with from_pretrained, or call hf_polyattn.convert(model, config) to "
            "re-create them"
        )


# ----------------------------------------------------------------------------- hooks
def _find_cache(args, kwargs):
    """The Cache passed to an attention module (``cache``; ``past_key_values`` before transformers 5.24, GPT-NeoX's
    ``layer_past``)."""
    for value in chain(kwargs.values(), args):
        if isinstance(value, Cache):
            return value
    return None


def _cache_pre_hook(module, args, kwargs):
    """Tell the attention function what it cannot see: the per-layer recurrent state (it never
    sees the cache) and whether this call is cross-attention (it never sees the encoder states).
    And where kernelize replaced the module's apply_rotary_pos_emb since the sinks' rotation was read
    (``give_rope``), read it again first (``_follow_rotation``)."""
    layer = None
    cross = is_cross_attention_call(module, args, kwargs)
    cache = _find_cache(args, kwargs)
    # Only while the model runs a polyattn kind: after set_attn_implementation("sdpa") (or a
    # distillation attention) the cache must keep real keys/values.
    if cache is not None and not cross and getattr(module, "is_causal", True) and polyattn_kind(module.config):
        # Only causal self-attention folds a state; cross-attention re-reads encoder keys.
        if isinstance(cache, EncoderDecoderCache):
            cache = cache.self_attention_cache
        layer = polyattn_layer_of(cache, getattr(module, "layer_idx", None))
    pa = module._modules.get("polyattn")
    if pa is not None:
        source = pa.__dict__.get("_polyattn_rope_source")
        if source is not None and rotation_source(module) != source:
            _follow_rotation(module, pa)
    # plain attributes (neither parameters, buffers nor modules) written to the instance directly: nn.Module's
    # __setattr__ looks the name up in its parameters, modules and buffers first, four times per layer and token
    state = module.__dict__
    state["_polyattn_cache_layer"] = layer
    state["_polyattn_cross_call"] = cross
    return None


def _cache_post_hook(module, args, output):
    state = module.__dict__
    state["_polyattn_cache_layer"] = None  # never keep a cache alive through the module
    state["_polyattn_cross_call"] = False
    return None


def sink_rope(module: nn.Module, cfg: PolyAttnConfig, layer_idx: int | None = None) -> RopeRotation | None:
    """The RoPE the ``polyattn`` module of attention ``module`` (layer ``layer_idx``) re-rotates its sinks' queries
    with (``sink_position='window'``), or None (no sinks there, or no RoPE in that layer); ValueError for a RoPE it
    cannot read (``rope.model_rope``)."""
    return model_rope(module, layer_idx) if reads_rope(cfg) else None


def give_rope(pa: nn.Module, module: nn.Module, rope: RopeRotation | None) -> None:
    """Hand ``pa`` (the ``polyattn`` module of attention ``module``) the rotation ``sink_rope`` read from ``module``,
    and remember which code that rotation was read from (``rope.rotation_source``): a hub kernel that kernelize puts
    in place of ``module``'s apply_rotary_pos_emb later (from_pretrained's ``use_kernels``, ``model.train()`` /
    ``eval()`` on another device) rotates differently, and its first call is where ``_cache_pre_hook`` sees it."""
    pa.rope = rope
    pa.__dict__["_polyattn_rope_source"] = rotation_source(module) if reads_rope(pa.config) else None


@torch.compiler.disable  # a reading runs the module's own code on a probe copy; compiled code only calls it here
def _follow_rotation(module: nn.Module, pa: nn.Module) -> None:
    """Read ``module``'s rotation again: kernelize replaced its apply_rotary_pos_emb after the last reading, and the
    sinks must be re-rotated by what the model now applies. Refused (ValueError naming sink_position='own' and the
    kernel) where the new rotation cannot be read: re-rotating with the old one would be silently wrong."""
    try:
        rope = model_rope(module, pa.layer_idx)
    except ValueError as err:
        kernels = "; ".join(kernel_repositories(module)) or "the Python function again"
        raise ValueError(f"layer {pa.layer_idx}'s apply_rotary_pos_emb was replaced after its rotation was read "
                         f"(kernelize: {kernels}) and the new one cannot be read: {err}. Or run the model without "
                         "hub kernels: model.reset_kernels(), from_pretrained(..., use_kernels=False) or "
                         "USE_HUB_KERNELS=0") from None
    give_rope(pa, module, rope)


def attach_polyattn(module: nn.Module, cfg: PolyAttnConfig, layer_idx: int, *, device=None, dtype=None,
                    replaced_window: int | None = None) -> None:
    """Give ``module`` its own ``polyattn`` submodule (replacing an existing one, or the exact window of a sliding
    layer), with the logit soft-cap its call site passes (``AttentionBase.softcap``), and the cache hooks.
    ``replaced_window``: the model's sliding window of this layer, which the kind replaces (``sliding_layers='kind'``):
    its calls pass it, and it is accepted instead of refused."""
    heads, head_dim, kv_heads = attention_dims(module)
    rope = sink_rope(module, cfg, layer_idx)  # before anything changes: a RoPE it cannot read is refused here
    if device is None and dtype is None:
        pa = HFPolyAttention(cfg, heads, head_dim, kv_heads, layer_idx)  # ambient device/dtype (from_pretrained)
    else:
        with torch.device(device or "cpu"):
            pa = HFPolyAttention(cfg, heads, head_dim, kv_heads, layer_idx)
        if dtype is not None:
            pa = pa.to(dtype)
    give_rope(pa, module, rope)
    softcap = call_keyword_value(module, "softcap")  # Gemma 2's, on every layer: applied by the exact parts
    pa.softcap = softcap if isinstance(softcap, (int, float)) else None  # ValueError where nothing would apply it
    module._modules.pop("polyattn_sliding", None)
    module.polyattn = pa
    module.__dict__["_polyattn_replaced_window"] = replaced_window
    _install_hooks(module)


def attach_sliding(module: nn.Module, window: int, layer_idx: int) -> None:
    """Keep sliding-window layer ``module`` exact (``layout.py``): an ``ops.sliding.SlidingWindowSoftmax`` at its
    ``window`` and soft-capping (read from its call site) as ``polyattn_sliding`` (no parameters), replacing a
    ``polyattn`` submodule, and the cache hooks (decoding keeps its last window - 1 keys)."""
    softcap = call_keyword_value(module, "softcap")
    module._modules.pop("polyattn", None)
    module.polyattn_sliding = SlidingWindowSoftmax(window, softcap if isinstance(softcap, (int, float)) else None,
                                                   layer_idx)
    module.__dict__["_polyattn_replaced_window"] = None
    _install_hooks(module)


def _install_hooks(module: nn.Module) -> None:
    if not getattr(module, "_polyattn_hooked", False):
        module.register_forward_pre_hook(_cache_pre_hook, with_kwargs=True)
        module.register_forward_hook(_cache_post_hook)
        module._polyattn_hooked = True
        module._polyattn_cache_layer = None
        module._polyattn_cross_call = False



def get_polyattn_config(model_or_config) -> PolyAttnConfig | None:
    """The PolyAttnConfig in use by a model (or stored in a transformers config), else None."""
    if isinstance(model_or_config, nn.Module):
        for m in model_or_config.modules():
            if isinstance(m, HFPolyAttention):
                return m.config
        model_or_config = getattr(model_or_config, "config", None)
    if model_or_config is None:
        return None
    return resolve_polyattn_config(model_or_config)


def sync_config(model: PreTrainedModel) -> None:
    """Make config.json record the attention settings (``save_pretrained`` drops ``_attn_implementation``).

    A top-level ``"attn_implementation"`` key is read back by ``from_pretrained``: with
    the plugin imported the model loads with our kind; without it transformers raises
    ``ValueError: Specified attn_implementation="polysketch" is not supported``.
    """
    config = model.config
    if polyattn_kind(config) is None:
        # Temporarily on another implementation (e.g. a distillation teacher): keep what
        # convert()/loading recorded, the polyattn weights are still in the model.
        return
    pa = next((m for m in model.modules() if isinstance(m, HFPolyAttention)), None)
    persist_settings(config, pa.config if pa is not None else resolve_polyattn_config(config))
    if getattr(config, BASE_MODEL_KEY, None) is None:
        base = hub_model_id(getattr(config, "_name_or_path", None))
        if base is not None:
            setattr(config, BASE_MODEL_KEY, base)


