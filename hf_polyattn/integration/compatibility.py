"""Which attention modules we replace, and what they ask for that the kernels cannot honour.

transformers' attention functions take ``**kwargs`` and many drop what they do not know.
Ours must not: T5 passes ``position_bias=`` (its relative position bias, the only position
information T5 has), Gemma 2 ``softcap=``, GPT-OSS ``s_aux=`` (attention sinks); dropping
them silently gives a different model (a T5 encoder without its bias is
permutation-equivariant). So every argument is checked twice:

* at ``convert()`` / construction (``from_pretrained(..., attn_implementation=KIND)``): the
  call site of the attention function in the module's ``forward`` is read (its source, as
  transformers itself does in ``_can_set_attn_implementation``) and every keyword argument
  outside :data:`HANDLED_KWARGS` whose value is not statically None (``self.attr`` and
  ``getattr(self.config, ...)`` are evaluated on the module) is refused, naming it;
* at every call: the attention function refuses any keyword argument outside
  :data:`HANDLED_KWARGS` whose value is not None (:func:`check_call_kwargs`); that also
  catches what the model forwards from the user through ``**kwargs``.

Cross-attention (BART, T5, BERT/GPT-2 with ``add_cross_attention``): queries and keys come
from different sequences, so ``local_exact`` diagonal blocks would pair unrelated positions.
It is detected from the model config, the module's ``is_cross_attention`` attribute and, at
run time, from the call itself (``key_value_states`` / ``encoder_hidden_states`` given), never
from sequence lengths.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from torch import nn
from transformers.configuration_utils import PreTrainedConfig

from ..config import PolyAttnConfig
from ..ops.hybrid import softcap_refusal
from .settings import config_sliding

__all__ = [
    "EXACT_WINDOW_KWARGS",
    "CACHE_ARGUMENT",
    "HANDLED_KWARGS",
    "UNKNOWN",
    "OUTPUT_ATTENTIONS_ERROR",
    "attention_call_keywords",
    "attention_dims",
    "call_keyword_value",
    "cache_kwargs",
    "check_attention_module",
    "check_call_kwargs",
    "check_model_options",
    "check_softmax_heads",
    "computed_mask",
    "find_attention_modules",
    "cross_blocker",
    "has_cross_attention",
    "is_attention_module",
    "is_cross_attention_call",
    "mark_checked",
    "owner_of",
    "returned_cache",
]

OUTPUT_ATTENTIONS_ERROR = (
    "output_attentions=True is not supported by hf_polyattn attention: the linear-time kernels never form the "
    "attention matrix. Use attn_implementation='eager' for that."
)

# Keyword arguments the attention function honours or that cannot change its result,
# read off what Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, BERT, RoBERTa, DistilBERT and BART
# pass in transformers 5.23 (plus TransformersKwargs). Any other keyword with a value
# that is not None is refused.
_SIGNATURE = ("module", "query", "key", "value", "attention_mask", "scaling", "dropout")
# Read and enforced by the attention function: is_causal decides causality; a set
# sliding_window, output_attentions=True or a packed-sequence kwarg is refused there.
_ENFORCED = ("is_causal", "sliding_window", "output_attentions",
             "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k", "max_length_q", "max_length_k")
# Bookkeeping that does not enter the attention computation: positions are applied before
# the function (RoPE) or ignored (absolute embeddings); the cache reaches the kernels
# through the module's pre-hook; the rest are output / loss / flash-attention switches.
_HARMLESS = ("position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value", "layer_past",
             "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
             "deterministic")
HANDLED_KWARGS = frozenset(_SIGNATURE + _ENFORCED + _HARMLESS)
# What a sliding-window layer kept exact (``ops/sliding.py``) applies besides: Gemma 2's logit soft-capping. A layer
# the kind converts applies it too where its module can (``ops.hybrid.softcap_refusal``), the cap read at convert /
# from_pretrained (``state.attach_polyattn``) and checked against every call (``registry.py``).
EXACT_WINDOW_KWARGS = ("softcap",)

# What the usual refused arguments mean, for the error message.
_WHAT = {
    "position_bias": "a position bias added to the attention scores (T5-style relative positions)",
    "attention_bias": "a bias added to the attention scores",
    "alibi": "an ALiBi bias added to the attention scores",
    "softcap": "logit soft-capping tanh(score / cap) * cap (applied by the sliding-window layers hf_polyattn keeps "
               "exact, and by a converted layer's exact parts; this one cannot be read at convert)",
    "s_aux": "attention sinks (extra logits in the softmax normaliser)",
    "sinks": "attention sinks (extra logits in the softmax normaliser)",
    "head_mask": "a per-head mask on the attention probabilities",
    "indices": "sparse attention indices",
    "block_indices": "sparse attention block indices",
    "seq_idx": "packed-sequence indices",
}

# Arguments of an attention module's forward that make the call cross-attention when set.
_CROSS_ARGUMENTS = ("key_value_states", "encoder_hidden_states")


def _cache_argument() -> str:
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


# The name under which generate(), the models' forward and their outputs carry the cache: 'cache' from transformers
# 5.24 (which warns FutureWarning on 'past_key_values' for every forward and removes it in 5.40), 'past_key_values'
# on 5.23 (which knows no 'cache').
CACHE_ARGUMENT = _cache_argument()


def cache_kwargs(cache) -> dict:
    """``{name: cache}`` for a model's forward or ``generate()`` under the installed transformers' name
    (:data:`CACHE_ARGUMENT`): ``model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True)``."""
    return {CACHE_ARGUMENT: cache}


def last_logits_only(model) -> dict:
    """``{"logits_to_keep": 1}`` where the model's forward takes it, else {}: a read whose logits but the last are
    never used spares the output layer over every token (a 2k-token document x 49,152 words on SmolLM2)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def returned_cache(output):
    """The cache a forward's or ``generate()``'s output carries (``output.cache`` from 5.24, where reading
    ``output.past_key_values`` logs a deprecation; ``output.past_key_values`` on 5.23)."""
    return output[CACHE_ARGUMENT] if CACHE_ARGUMENT in output else None


_ATTENTION_CLASS_CACHE: dict[type, bool] = {}
_CALL_KEYWORDS_CACHE: dict[type, list[tuple[str, ast.expr]]] = {}
_CROSS_POSITIONS_CACHE: dict[type, dict[str, int]] = {}


def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def is_attention_module(module: nn.Module) -> bool:
    """True for modules whose ``forward`` dispatches through ``AttentionInterface``.

    The same source heuristic transformers uses in ``_can_set_attn_implementation``,
    applied to the module's own ``forward`` and cached per class.
    """
    cls = type(module)
    hit = _ATTENTION_CLASS_CACHE.get(cls)
    if hit is None:
        src = _forward_source(cls)
        hit = "ALL_ATTENTION_FUNCTIONS" in src and "get_interface(" in src
        _ATTENTION_CLASS_CACHE[cls] = hit
    return hit


def attention_dims(module: nn.Module) -> tuple[int, int, int]:
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


# --------------------------------------------------------------- what the call site passes
def attention_call_keywords(cls: type) -> list[tuple[str, ast.expr]]:
    """(name, value expression) of every keyword argument ``cls.forward`` passes to the attention function.

    The attention function is the name bound to ``ALL_ATTENTION_FUNCTIONS.get_interface(...)``
    (``attention_interface`` in every model of transformers 5.23); ``**kwargs`` is skipped
    (checked at run time). Empty when the source cannot be read.
    """
    cached = _CALL_KEYWORDS_CACHE.get(cls)
    if cached is not None:
        return cached
    found: list[tuple[str, ast.expr]] = []
    src = _forward_source(cls)
    try:
        tree = ast.parse(textwrap.dedent(src)) if src else None
    except SyntaxError:
        tree = None
    if tree is not None:
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                if "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            direct = not isinstance(func, ast.Name) and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(func) and not (
                isinstance(func, ast.Attribute) and func.attr == "get_interface")
            if (isinstance(func, ast.Name) and func.id in names) or direct:
                found += [(kw.arg, kw.value) for kw in node.keywords if kw.arg is not None]
    _CALL_KEYWORDS_CACHE[cls] = found
    return found


def computed_mask(cls: type) -> str | None:
    """The mask ``cls.forward`` hands its attention function where the module computes it itself, as source text
    (Doge's ``attn_mask``: ``self.prepare_dynamic_mask(hidden states, ...)`` per head, repeated per group; the
    sparse-attention indexers of DeepSeek-V3.2 and its kin: ``attention_mask`` masked by ``self.indexer``'s top-k
    keys); None where
    it hands on the mask the model gave it (its ``attention_mask`` argument, sliced or looked up: no call of a method
    of its own on the way), or where the source cannot be read (the attention function refuses a mask it cannot use
    at run time).

    hf_polyattn's kernels use the model's mask for padding only (the 2-D key-padding mask its mask function builds):
    a mask computed per head from the states is a part of the scores they cannot apply."""
    src = _forward_source(cls)
    try:
        tree = ast.parse(textwrap.dedent(src)) if src else None
    except SyntaxError:
        return None
    if tree is None:
        return None
    assigned: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    assigned.setdefault(t.id, []).append(node.value)
    callers = {name for name, values in assigned.items() if any("ALL_ATTENTION_FUNCTIONS" in ast.unparse(v)
                                                                for v in values)}

    def own_call(expr: ast.expr, seen: frozenset) -> bool:  # a call of self.<method> on the way to the mask
        for node in ast.walk(expr):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
                return True
            if isinstance(node, ast.Name) and node.id in assigned and node.id not in seen:
                if any(own_call(v, seen | {node.id}) for v in assigned[node.id]):
                    return True
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callers:
            mask = next((kw.value for kw in node.keywords if kw.arg == "attention_mask"), None)
            if mask is None and len(node.args) > 4:
                mask = node.args[4]
            if mask is not None and own_call(mask, frozenset()):
                return ast.unparse(mask)
    return None


_UNKNOWN = UNKNOWN = object()  # a call-site value that cannot be read statically


def _static_value(node: ast.expr, module: nn.Module) -> Any:
    """The value of ``node`` when it is a constant, ``self.a.b`` or ``getattr(self.a, "b", default)``;
    else ``_UNKNOWN`` (a local variable: assume it carries a value)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id == "self":
        return module
    if isinstance(node, ast.Attribute):
        owner = _static_value(node.value, module)
        if owner is _UNKNOWN or owner is None:
            return _UNKNOWN
        return getattr(owner, node.attr, _UNKNOWN)
    if isinstance(node, ast.IfExp):  # `self.sliding_window if self.is_sliding else None` (EXAONE 4)
        test = _static_value(node.test, module)
        if test is _UNKNOWN:
            return _UNKNOWN
        return _static_value(node.body if test else node.orelse, module)
    if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq))
            and len(node.comparators) == 1):  # `self.layer_type == "sliding_attention"`
        left, right = _static_value(node.left, module), _static_value(node.comparators[0], module)
        if left is _UNKNOWN or right is _UNKNOWN:
            return _UNKNOWN
        return (left == right) == isinstance(node.ops[0], ast.Eq)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) in (2, 3) and not node.keywords):
        owner = _static_value(node.args[0], module)
        attr = _static_value(node.args[1], module)
        if owner is _UNKNOWN or not isinstance(attr, str):
            return _UNKNOWN
        default = _static_value(node.args[2], module) if len(node.args) == 3 else _UNKNOWN
        return getattr(owner, attr, default)
    return _UNKNOWN


def _refusal(name: str, where: str, value_text: str) -> str:
    what = _WHAT.get(name, "an argument the hf_polyattn kernels do not implement")
    return (f"{where} passes {name}={value_text} to its attention function: {what}. hf_polyattn kernels cannot "
            f"apply it, and dropping it would silently change the model; this model is not supported by "
            f"hf_polyattn attention")


def call_keyword_value(module: nn.Module, name: str) -> Any:
    """The value the module's forward passes its attention function as keyword ``name``, read statically
    (``self.attr``, ``getattr(self.config, ...)``, ``a if b else c`` evaluated on the module); None when it passes
    none; :data:`UNKNOWN` when it cannot be read (a local variable)."""
    for kw, expr in attention_call_keywords(type(module)):
        if kw == name:
            return _static_value(expr, module)
    return None


def check_attention_module(module: nn.Module, cfg: PolyAttnConfig, owner: str, *, exact_window: bool = False,
                           layer_idx: int | None = None) -> None:
    """Refuse (ValueError) an attention module whose call site passes an argument we cannot honour,
    or a cross-attention module with ``local_exact``. ``owner``: the model class, for the message.
    ``exact_window``: the module is a sliding-window layer kept exact (``layout.py``), which honours soft-capping
    and runs no kind (the kind's direction and options do not apply to it). A converted layer (``layer_idx``, default
    the module's own) honours a soft-cap read from its call site where its module applies one
    (``ops.hybrid.softcap_refusal``: the kernel part forms no score, ``PolyAttnConfig.softcap_mode`` decides)."""
    cls = type(module)
    where = f"{owner} ({cls.__name__}.forward)"
    mask = computed_mask(cls)
    if mask is not None:
        # refused here rather than at the first forward (where the attention function meets a 4-D mask it cannot
        # apply): convert must not return a model that fails when run
        raise ValueError(
            f"{where} (model_type={getattr(module.config, 'model_type', None)!r}) passes attention_mask={mask} to "
            "its attention function: a mask the module computes itself from its states (Doge's per-head dynamic "
            "mask, a sparse-attention indexer's top-k keys), not the padding / causal mask the model builds. "
            "hf_polyattn attention uses the model's mask for padding only and cannot apply a per-head 4-D mask (at "
            "run time: 'received an attention_mask of shape (batch, heads, q, k)'); this model is not supported by "
            "hf_polyattn attention")
    honoured = EXACT_WINDOW_KWARGS if exact_window else ()
    for name, expr in attention_call_keywords(cls):
        if name in HANDLED_KWARGS or name in honoured:
            continue
        value = _static_value(expr, module)
        if value is None:
            continue  # e.g. softcap=self.attn_logit_softcapping with the option off
        if name == "softcap" and isinstance(value, (int, float)) and not isinstance(value, bool):
            idx = getattr(module, "layer_idx", 0) if layer_idx is None else layer_idx
            reason = softcap_refusal(cfg, idx if isinstance(idx, int) else 0, attention_dims(module)[2])
            if reason is None:
                continue
            raise ValueError(f"{where} passes softcap={ast.unparse(expr)} ({value}) to its attention function, "
                             f"logit soft-capping c tanh(score / c) of every score, and layer {idx} cannot apply it: "
                             f"{reason}")
        raise ValueError(_refusal(name, where, ast.unparse(expr)))
    if exact_window:
        return
    # the direction the attention function will ask for (registry.py: kwargs is_causal, else module.is_causal)
    causal = bool(getattr(module, "is_causal", True))
    spec = cfg.spec
    if causal and not spec.causal:
        raise ValueError(f"kind={cfg.kind!r} is bidirectional only and {where} is causal attention (a decoder): "
                         f"pick a kind that serves causal attention, e.g. {_serving('causal')}")
    if not causal and not spec.bidirectional:
        raise ValueError(f"kind={cfg.kind!r} is causal only and {where} is bidirectional attention (an encoder): "
                         f"pick a kind that serves bidirectional attention, e.g. {_serving('bidirectional')}")
    if not causal and cfg.decay != "none":
        raise ValueError(f"decay={cfg.decay!r} is defined for causal attention only and {where} is bidirectional "
                         "attention (an encoder or cross-attention): use decay='none' there")
    if not causal and cfg.sparse_cache:
        raise ValueError(f"sparse_cache={cfg.sparse_cache} is defined for causal attention only (it keeps keys that "
                         f"left a causal window) and {where} is bidirectional attention (an encoder or "
                         "cross-attention): use sparse_cache=0 there")
    if cross_blocker(cfg) and getattr(module, "is_cross_attention", False) is True:
        raise ValueError(_local_exact_cross_message(f"{owner} ({cls.__name__} is a cross-attention module)",
                                                    cross_blocker(cfg)))


def _serving(direction: str) -> list[str]:
    from ..registry import all_kinds

    return [spec.name for spec in all_kinds() if getattr(spec, direction)]


def check_call_kwargs(module: nn.Module, kwargs: dict[str, Any], honoured: tuple[str, ...] = ()) -> None:
    """Refuse (ValueError) any keyword argument of an attention call we cannot honour (None is harmless);
    ``honoured``: further names the caller applies (a sliding-window layer kept exact: ``softcap``)."""
    for name, value in kwargs.items():
        if name in HANDLED_KWARGS or name in honoured or value is None:
            continue
        shown = f"<{type(value).__name__}>" if not isinstance(value, (bool, int, float, str)) else repr(value)
        raise ValueError(_refusal(name, f"{owner_of(module)} ({type(module).__name__})", shown))


def owner_of(module: nn.Module) -> str:
    """The model class an attention module belongs to (recorded by convert / construction), for messages."""
    owner = module.__dict__.get("_polyattn_owner")
    if owner is None:
        config = getattr(module, "config", None)
        owner = (getattr(config, "architectures", None) or [f"model_type={getattr(config, 'model_type', '?')!r}"])[0]
    return owner


def mark_checked(module: nn.Module, owner: str) -> None:
    """Record that ``module`` passed :func:`check_attention_module` as part of the model class ``owner``."""
    module.__dict__["_polyattn_checked"] = True
    module.__dict__["_polyattn_owner"] = owner


# ------------------------------------------------------------------------ cross-attention
def local_option(cfg: PolyAttnConfig) -> str | None:
    """The option that sets an exact local part aligned by position ('local_exact=True', 'window=64'), or None."""
    if cfg.local_exact:
        return "local_exact=True"
    if cfg.window:
        return f"window={cfg.window}"
    return None


def cross_blocker(cfg: PolyAttnConfig) -> str | None:
    """What makes ``cfg`` refuse cross-attention: a kind defined within one sequence ("kind='bigbird'", named first:
    its window would not make it serve either), or an exact local part aligned by position ('window=64'); None when it
    serves cross-attention."""
    if not cfg.spec.cross_attention:
        return f"kind={cfg.kind!r}"
    return local_option(cfg)


def _local_exact_cross_message(where: str, option: str = "local_exact=True") -> str:
    if option.startswith("kind="):
        return (f"{option} is not supported with cross-attention ({where}): it is defined within one sequence "
                "(positions, blocks or hashes that queries and keys share), which keys from another sequence (the "
                "encoder) do not have. Use a kernel kind (polysketch, linear, performer, polynomial) for models "
                "with cross-attention.")
    return (f"{option} is not supported with cross-attention ({where}): its exact local part pairs query i "
            "with the keys near position i, which for keys from another sequence (the encoder) are unrelated "
            "positions. Use local_exact=False and window=0 for models with cross-attention.")


def has_cross_attention(config: PreTrainedConfig) -> bool:
    """Whether a model config builds cross-attention layers (encoder-decoder, or a decoder with add_cross_attention)."""
    return bool(getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False))


def check_softmax_heads(config: PreTrainedConfig, cfg: PolyAttnConfig, owner: str) -> None:
    """Refuse ``softmax_heads`` pairs the model does not have: layer < num_hidden_layers, kv head <
    num_key_value_heads (num_attention_heads without grouped-query attention). A pair beyond them would be
    silently unused."""
    if not cfg.softmax_heads:
        return
    text = config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    for layer, head in cfg.softmax_heads:
        if isinstance(layers, int) and layer >= layers:
            raise ValueError(f"softmax_heads names ({layer}, {head}): {owner} has {layers} layers "
                             f"(num_hidden_layers), allowed layers 0..{layers - 1}")
        if cfg.sliding_layers == "exact" and config_sliding(text, layer):
            converted = [i for i in range(layers or 0) if not config_sliding(text, i)]
            raise ValueError(f"softmax_heads names ({layer}, {head}): layer {layer} of {owner} is a sliding-window "
                             f"layer (window {getattr(text, 'sliding_window', '?')}) that stays exact softmax "
                             "(sliding_layers='exact'): softmax heads are chosen among the converted layers only, "
                             f"here {converted}")
        if isinstance(kv_heads, int) and head >= kv_heads:
            raise ValueError(f"softmax_heads names ({layer}, {head}): {owner} has {kv_heads} kv heads per layer "
                             f"(num_key_value_heads), allowed heads 0..{kv_heads - 1}")


def check_model_options(configs: list[PreTrainedConfig], cfg: PolyAttnConfig, owner: str) -> None:
    """Refuse options the model's structure rules out (``local_exact`` or a one-sequence kind with cross-attention,
    ``softmax_heads`` beyond its layers or kv heads)."""
    for config in configs:
        check_softmax_heads(config, cfg, owner)
    if cross_blocker(cfg):
        for config in configs:
            if has_cross_attention(config):
                flag = "is_encoder_decoder" if getattr(config, "is_encoder_decoder", False) else "add_cross_attention"
                raise ValueError(_local_exact_cross_message(f"{owner}: config.{flag}=True", cross_blocker(cfg)))


def _cross_positions(cls: type) -> dict[str, int]:
    """Positional index (after ``self``) of each cross-attention argument of ``cls.forward``."""
    cached = _CROSS_POSITIONS_CACHE.get(cls)
    if cached is None:
        cached = {}
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = []
        for i, p in enumerate(params):
            if p.name in _CROSS_ARGUMENTS and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                cached[p.name] = i
        _CROSS_POSITIONS_CACHE[cls] = cached
    return cached


def is_cross_attention_call(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether this forward call of an attention module attends to another sequence."""
    if getattr(module, "is_cross_attention", False) is True:
        return True
    for name in _CROSS_ARGUMENTS:
        if kwargs.get(name) is not None:
            return True
    for i in _cross_positions(type(module)).values():
        if i < len(args) and args[i] is not None:
            return True
    return False


def local_exact_cross_call_error(module: nn.Module, cfg: PolyAttnConfig) -> ValueError:
    return ValueError(_local_exact_cross_message(f"{type(module).__name__} was called with keys/values from "
                                                 "another sequence", cross_blocker(cfg) or "local_exact=True"))
