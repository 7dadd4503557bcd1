"""Per-layer state attached to a transformers attention module (prefix ``polyattn``).

Each attention module (the module whose ``forward`` calls
``ALL_ATTENTION_FUNCTIONS.get_interface``) gets one submodule ``polyattn``: a
:class:`HFPolyAttention` holding that layer's sketches, feature parameters, q/k
LayerNorms and polynomial coefficients. Weight keys are therefore
``...self_attn.polyattn.*`` (Llama) or ``...attention.self.polyattn.*`` (BERT), saved and
loaded by the standard safetensors path. A second PolyAttention never shares a
Parameter: every layer builds its own.

Why the submodules are created at construction time, by a torch module-registration
hook: ``from_pretrained`` builds the model on the meta device, then loads every
checkpoint key into the modules that *exist at that moment*; keys of modules created
later (in a forward pre-hook, after load) would be dropped as "unexpected". transformers
5.23 offers no per-instance construction hook; the alternatives were

* ``transformers.monkey_patching.register_patch_mapping``: swaps attention *classes*
  for every model in the process, one replacement class cannot subclass both
  ``LlamaAttention`` and ``BertSelfAttention``, and it is documented as experimental;
* subclassing or patching ``PreTrainedModel.post_init`` / ``_init_weights``: global
  monkey-patching of transformers (what DESIGN.md tells us to avoid).

``torch.nn.modules.module.register_module_module_registration_hook`` is a public torch
API called whenever a submodule is assigned. Our hook acts only when the registered
module carries a transformers config whose ``_attn_implementation`` is one of our kinds,
so softmax models built in the same process are untouched. It sees the attention module
right after its ``__init__`` (so its ``layer_idx``, head counts and config are known) and
the ``nn.ModuleList`` of layers (which gives the layer index to modules without one, e.g.
DistilBERT).

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

import inspect
import logging
from itertools import chain

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_utils import PreTrainedModel

from ..config import KINDS, PolyAttnConfig
from ..ops import PolyAttention
from .cache import polyattn_layer_of

logger = logging.getLogger(__name__)

__all__ = [
    "HFPolyAttention",
    "attach_polyattn",
    "find_attention_modules",
    "install_construction_hook",
    "is_attention_module",
    "resolve_polyattn_config",
]

# Config attributes written to config.json (read back by from_pretrained / our hook).
CONFIG_KEY = "polyattn"
BASE_MODEL_KEY = "polyattn_base_model"
# Without the plugin, transformers' error only names the kind ("Specified
# attn_implementation="polysketch" is not supported"): config.json says what to import.
REQUIRES_KEY = "polyattn_requires"
REQUIRES_NOTE = "pip install hf_polyattn; `import hf_polyattn` before from_pretrained registers this attention"


def persist_settings(config: PreTrainedConfig, cfg: PolyAttnConfig) -> None:
    """Write the attention settings as config attributes that save_pretrained serialises."""
    config.attn_implementation = cfg.kind  # read back by from_pretrained (PreTrainedConfig.__init__)
    setattr(config, CONFIG_KEY, cfg.to_dict())
    setattr(config, REQUIRES_KEY, REQUIRES_NOTE)

_ATTENTION_CLASS_CACHE: dict[type, bool] = {}


def is_attention_module(module: nn.Module) -> bool:
    """True for modules whose ``forward`` dispatches through ``AttentionInterface``.

    The same source heuristic transformers uses in ``_can_set_attn_implementation``,
    applied to the module's own ``forward`` and cached per class.
    """
    cls = type(module)
    hit = _ATTENTION_CLASS_CACHE.get(cls)
    if hit is None:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        hit = "ALL_ATTENTION_FUNCTIONS" in src and "get_interface(" in src
        _ATTENTION_CLASS_CACHE[cls] = hit
    return hit


def _polyattn_kind(config) -> str | None:
    if not isinstance(config, PreTrainedConfig):
        return None
    kind = getattr(config, "_attn_implementation", None)
    return kind if isinstance(kind, str) and kind in KINDS else None


def resolve_polyattn_config(config: PreTrainedConfig) -> PolyAttnConfig | None:
    """The PolyAttnConfig a transformers config asks for, or None for other attention.

    ``config.polyattn`` (from config.json or ``convert``) when its kind matches
    ``config._attn_implementation``; otherwise the kind's defaults (a stock checkpoint
    loaded with ``attn_implementation=KIND``).
    """
    kind = _polyattn_kind(config)
    if kind is None:
        return None
    stored = getattr(config, CONFIG_KEY, None)
    if isinstance(stored, PolyAttnConfig):
        cfg = stored
    elif isinstance(stored, dict):
        try:
            cfg = PolyAttnConfig.from_dict(stored)
        except (TypeError, ValueError) as err:
            raise ValueError(f"config.json key {CONFIG_KEY!r} is not a valid PolyAttnConfig: {err}") from err
    elif stored is None:
        cfg = PolyAttnConfig(kind=kind)
    else:
        raise ValueError(f"config.{CONFIG_KEY} must be a dict of PolyAttnConfig fields, got {type(stored).__name__}")
    if cfg.kind != kind:
        logger.warning(
            "attn_implementation=%r overrides the stored polyattn settings of kind %r: using the defaults of %r",
            kind, cfg.kind, kind,
        )
        cfg = PolyAttnConfig(kind=kind)
    return cfg


def check_supported_config(config: PreTrainedConfig) -> None:
    """Refuse model configs whose attention pattern a 2-D padding mask cannot express."""
    layer_types = getattr(config, "layer_types", None)
    special = sorted({t for t in (layer_types or []) if t in ("sliding_attention", "chunked_attention")})
    if special:
        raise ValueError(
            f"hf_polyattn does not implement {special} layers (config.layer_types): its kernels attend to the "
            "whole causal past. Load with layer types set to full attention (e.g. use_sliding_window=False for "
            "Qwen2) to use global polyattn attention."
        )
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        raise ValueError(
            f"config.sliding_window={config.sliding_window}: hf_polyattn does not implement sliding-window "
            "attention (it attends to the whole past in linear time). Pass sliding_window=None to "
            "from_pretrained (or set config.sliding_window = None before convert) to use global attention."
        )
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError("config.attention_chunk_size is set: chunked attention is not supported by hf_polyattn; "
                         "set it to None")


def _dims(module: nn.Module) -> tuple[int, int, int]:
    """(num_heads, head_dim, num_kv_heads) of a transformers attention module."""
    config = module.config

    def first(*names, src):
        for n in names:
            v = getattr(src, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    heads = first("num_heads", "num_attention_heads", "n_heads", src=module) or first(
        "num_attention_heads", "n_head", "n_heads", src=config)
    head_dim = first("head_dim", "attention_head_size", "head_size", src=module)
    if head_dim is None and heads:
        hidden = first("hidden_size", "embed_dim", "dim", src=config)
        head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden else None)
    if not heads or not head_dim:
        raise ValueError(f"cannot read the head count / head size of {type(module).__name__}: hf_polyattn supports "
                         "attention modules with num_heads/num_attention_heads and head_dim/attention_head_size")
    groups = first("num_key_value_groups", src=module)
    kv_heads = heads // groups if groups else (first("num_key_value_heads", src=config) or heads)
    return heads, head_dim, kv_heads


class HFPolyAttention(PolyAttention):
    """PolyAttention that follows the transformers loading protocol (see module docstring)."""

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
    """The Cache passed to an attention module (``past_key_values`` or GPT-NeoX's ``layer_past``)."""
    for value in chain(kwargs.values(), args):
        if isinstance(value, Cache):
            return value
    return None


def _cache_pre_hook(module, args, kwargs):
    """Hand the per-layer recurrent state to the attention function (it never sees the cache)."""
    layer = None
    cache = _find_cache(args, kwargs)
    # Only while the model runs a polyattn kind: after set_attn_implementation("sdpa") (or a
    # distillation attention) the cache must keep real keys/values.
    if cache is not None and getattr(module, "is_causal", True) and _polyattn_kind(module.config) is not None:
        # Only causal self-attention folds a state; cross-attention re-reads encoder keys.
        if isinstance(cache, EncoderDecoderCache):
            cache = cache.self_attention_cache
        layer = polyattn_layer_of(cache, getattr(module, "layer_idx", None))
    module._polyattn_cache_layer = layer
    return None


def _cache_post_hook(module, args, output):
    module._polyattn_cache_layer = None  # never keep a cache alive through the module
    return None


def attach_polyattn(module: nn.Module, cfg: PolyAttnConfig, layer_idx: int, *, device=None, dtype=None) -> None:
    """Give ``module`` its own ``polyattn`` submodule (replacing an existing one) and the cache hooks."""
    heads, head_dim, kv_heads = _dims(module)
    if device is None and dtype is None:
        pa = HFPolyAttention(cfg, heads, head_dim, kv_heads, layer_idx)  # ambient device/dtype (from_pretrained)
    else:
        with torch.device(device or "cpu"):
            pa = HFPolyAttention(cfg, heads, head_dim, kv_heads, layer_idx)
        if dtype is not None:
            pa = pa.to(dtype)
    module.polyattn = pa
    if not getattr(module, "_polyattn_hooked", False):
        module.register_forward_pre_hook(_cache_pre_hook, with_kwargs=True)
        module.register_forward_hook(_cache_post_hook)
        module._polyattn_hooked = True
        module._polyattn_cache_layer = None


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(name, module, layer index) of every attention module, in model order.

    The index is the module's ``layer_idx`` when it has one, else the position of its
    block inside the enclosing ``nn.ModuleList`` of layers.
    """
    found = []
    for name, mod in model.named_modules():
        if not isinstance(getattr(mod, "config", None), PreTrainedConfig) or not is_attention_module(mod):
            continue
        idx = getattr(mod, "layer_idx", None)
        if not isinstance(idx, int) or isinstance(idx, bool):
            digits = [p for p in name.split(".") if p.isdigit()]
            idx = int(digits[-1]) if digits else len(found)
        found.append((name, mod, idx))
    return found


# ------------------------------------------------------------ model-level integration
def sync_config(model: PreTrainedModel) -> None:
    """Make config.json record the attention settings (``save_pretrained`` drops ``_attn_implementation``).

    A top-level ``"attn_implementation"`` key is read back by ``from_pretrained``: with
    the plugin imported the model loads with our kind; without it transformers raises
    ``ValueError: Specified attn_implementation="polysketch" is not supported``.
    """
    config = model.config
    if _polyattn_kind(config) is None:
        # Temporarily on another implementation (e.g. a distillation teacher): keep what
        # convert()/loading recorded, the polyattn weights are still in the model.
        return
    pa = next((m for m in model.modules() if isinstance(m, HFPolyAttention)), None)
    persist_settings(config, pa.config if pa is not None else resolve_polyattn_config(config))
    if getattr(config, BASE_MODEL_KEY, None) is None:
        from .hub import hub_model_id

        base = hub_model_id(getattr(config, "_name_or_path", None))
        if base is not None:
            setattr(config, BASE_MODEL_KEY, base)


def prepare_model_instance(model: PreTrainedModel) -> None:
    """Per-instance overrides: save/push with settings + card, generate() with PolyAttnCache.

    Installed as instance attributes (bound methods), so only this model object changes;
    the transformers classes stay untouched.
    """
    if model.__dict__.get("_polyattn_prepared"):
        return
    for name in _OVERRIDES:
        setattr(model, name, _ModelMethod(name, model))
    model.__dict__["_polyattn_prepared"] = True


def _override(name: str):
    from . import hub

    return {"save_pretrained": hub.polyattn_save_pretrained, "push_to_hub": hub.polyattn_push_to_hub,
            "_prepare_cache_for_generation": _prepare_cache_for_generation}[name]


_OVERRIDES = ("save_pretrained", "push_to_hub", "_prepare_cache_for_generation")


class _ModelMethod:
    """A per-instance method that survives deepcopy and pickling (torch.save(model)).

    A ``types.MethodType`` would pickle as ``getattr(model, "<function name>")``, which
    fails (or, named like the attribute, silently re-binds the class method) when the
    model is unpickled.
    """

    __slots__ = ("name", "model")

    def __init__(self, name: str, model):
        self.name, self.model = name, model

    def __call__(self, *args, **kwargs):
        return _override(self.name)(self.model, *args, **kwargs)

    def __reduce__(self):
        return _ModelMethod, (self.name, self.model)

    @property
    def __doc__(self):
        return _override(self.name).__doc__

    @property
    def __name__(self):
        return self.name

    def __repr__(self) -> str:
        return f"<hf_polyattn {self.name} of {type(self.model).__name__}>"


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """generate(): a PolyAttnCache instead of a DynamicCache when nothing else was asked for."""
    if (
        _polyattn_kind(self.config) is not None
        and model_kwargs.get("past_key_values") is None
        and generation_config.use_cache is not False
        and generation_config.cache_implementation in (None, "dynamic")
        and not self.config.is_encoder_decoder
        and not getattr(generation_config, "is_assistant", False)
    ):
        from .cache import PolyAttnCache

        model_kwargs["past_key_values"] = PolyAttnCache(self.config)
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def _registration_hook(parent: nn.Module, name: str, child):
    """Global torch hook: attach polyattn state while a polyattn model is being built."""
    if not isinstance(child, nn.Module):
        return None
    if isinstance(parent, PreTrainedModel) and _polyattn_kind(parent.config) is not None:
        if not parent.__dict__.get("_polyattn_prepared"):
            # transformers' own test for 'this class dispatches through AttentionInterface'
            if not getattr(type(parent), "_can_set_attn_implementation", lambda: True)():
                raise ValueError(
                    f"{type(parent).__name__} does not route its attention through transformers' "
                    f"AttentionInterface, so attn_implementation={parent.config._attn_implementation!r} would be "
                    "ignored (a silent softmax model). hf_polyattn supports models whose attention calls "
                    "ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, BERT, RoBERTa, DistilBERT, ...)."
                )
            check_supported_config(parent.config)
            prepare_model_instance(parent)
            sync_config(parent)
    if isinstance(child, nn.ModuleList):
        for idx, block in enumerate(child):
            for mod in block.modules():
                _maybe_attach(mod, idx)
    else:
        idx = getattr(child, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool):
            _maybe_attach(child, idx)
    return None


def _maybe_attach(module: nn.Module, idx: int) -> None:
    if "polyattn" in module._modules:
        return
    config = getattr(module, "config", None)
    if _polyattn_kind(config) is None or not is_attention_module(module):
        return
    cfg = resolve_polyattn_config(config)
    check_supported_config(config)
    attach_polyattn(module, cfg, idx)
    persist_settings(config, cfg)  # in the config object the model will save


_HOOK_HANDLE = None


def install_construction_hook() -> None:
    global _HOOK_HANDLE
    if _HOOK_HANDLE is None:
        _HOOK_HANDLE = torch.nn.modules.module.register_module_module_registration_hook(_registration_hook)


def uninstall_construction_hook() -> None:
    global _HOOK_HANDLE
    if _HOOK_HANDLE is not None:
        _HOOK_HANDLE.remove()
        _HOOK_HANDLE = None
