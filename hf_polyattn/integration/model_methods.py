"""Per-instance overrides of a polyattn model: save/push with settings + card, generate() with
PolyAttnCache, and the refusal of ``output_attentions=True``.

Installed on the model object only (instance attributes and a forward pre-hook), so the
transformers classes stay untouched and softmax models in the same process are unaffected.
"""

from __future__ import annotations

from transformers.modeling_utils import PreTrainedModel

from . import hub
from .cache import PolyAttnCache
from .compatibility import CACHE_ARGUMENT, OUTPUT_ATTENTIONS_ERROR
from .remote_code import forget_auto_class_registration
from .settings import polyattn_kind

__all__ = ["prepare_model_instance"]

_OVERRIDES = ("save_pretrained", "push_to_hub", "_prepare_cache_for_generation")


def prepare_model_instance(model: PreTrainedModel) -> None:
    """Install the per-instance overrides on ``model`` (idempotent).

    Installed as instance attributes (bound methods), so only this model object changes;
    the transformers classes stay untouched.
    """
    if model.__dict__.get("_polyattn_prepared"):
        return
    # loaded with trust_remote_code: transformers marked the stock class for custom_object_save (remote_code.py)
    forget_auto_class_registration(type(model))
    for name in _OVERRIDES:
        setattr(model, name, _ModelMethod(name, model))
    model.register_forward_pre_hook(_refuse_output_attentions, with_kwargs=True)
    model.__dict__["_polyattn_prepared"] = True


def _refuse_output_attentions(model, args, kwargs):
    """``output_attentions=True`` must fail loudly on every model.

    The attention function refuses it when it receives it, but some models never pass it
    down: GPT-2 (``GPT2Model.forward`` pops it from its kwargs) and then
    ``capture_outputs`` collects the ``None`` weights into an empty tuple, so
    ``model(ids, output_attentions=True).attentions == ()`` (``generate`` too). The model's
    own forward is the one place every model sees the flag (the argument, else the config).
    """
    if polyattn_kind(model.config) is None:
        return None  # temporarily another implementation (e.g. an eager distillation teacher)
    wanted = kwargs.get("output_attentions")
    if wanted is None:
        wanted = getattr(model.config, "output_attentions", False)
    if wanted:
        raise ValueError(OUTPUT_ATTENTIONS_ERROR)
    return None


def _override(name: str):
    # Looked up at call time: tests (and users) may patch the hub functions.
    return {"save_pretrained": hub.polyattn_save_pretrained, "push_to_hub": hub.polyattn_push_to_hub,
            "_prepare_cache_for_generation": _prepare_cache_for_generation}[name]


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
    """generate(): a PolyAttnCache instead of a DynamicCache when nothing else was asked for, under the name the
    installed transformers reads (``cache`` from 5.24: a ``past_key_values`` entry there made it warn twice per
    token, 'deprecated' and 'Both `past_key_values` and `cache` are set')."""
    if (
        polyattn_kind(self.config) is not None
        and model_kwargs.get(CACHE_ARGUMENT) is None
        and generation_config.use_cache is not False
        and generation_config.cache_implementation in (None, "dynamic")
        and not self.config.is_encoder_decoder
        and not getattr(generation_config, "is_assistant", False)
    ):
        model_kwargs[CACHE_ARGUMENT] = PolyAttnCache(self.config)
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)
