"""Registration of every kind with transformers' AttentionInterface and AttentionMaskInterface.

One name per kind (``hf_polyattn.registry``: built-in and user kinds alike), each registered twice under the same
name: the attention function and the mask function. Without a mask function transformers
passes ``attention_mask=None`` and padding is lost silently.

The mask function returns the 2-D (batch, kv_len) bool key-padding mask, or None when
nothing is padded, like ``flash_attention_mask``: never the (B, 1, Lq, Lk) tensor of the
sdpa/eager masks (at 32k context that is 1 G booleans per sequence). Attention patterns a
padding mask cannot express (sliding windows, packed sequences, chunked or custom
overlays) arrive as a different ``mask_function`` and are refused with a clear error.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function
from transformers.modeling_utils import AttentionInterface

from .. import registry
from ..ops.sliding import SlidingWindowSoftmax
from .compatibility import (
    EXACT_WINDOW_KWARGS,
    OUTPUT_ATTENTIONS_ERROR,
    check_call_kwargs,
    cross_blocker,
    local_exact_cross_call_error,
    local_option,
)
from .construction import install_construction_hook
from .state import HFPolyAttention

__all__ = ["ATTENTION_FUNCTIONS", "polyattn_mask", "register_all"]

# Flash-attention varlen kwargs: what DataCollatorWithFlattening adds for packed batches.
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k", "max_length_q", "max_length_k")
_DROPOUT_NAMES = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout", "attn_dropout")


def _mask_function_names(fn, depth: int = 0) -> list[str]:
    """Qualified names of a mask function and of the functions its closure combines
    (``and_masks``/``or_masks`` wrap the packed-sequence and sliding-window functions)."""
    names = [getattr(fn, "__qualname__", repr(fn))]
    if depth < 4:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # empty cell
                continue
            for item in inner if isinstance(inner, (tuple, list)) else (inner,):
                if callable(item) and hasattr(item, "__qualname__"):
                    names += _mask_function_names(item, depth + 1)
    return names


# The mask functions transformers builds for sliding-window layers (masking_utils: the causal window, ModernBERT's
# bidirectional one, Gemma 3's bidirectional overlay). Such a layer receives the key padding mask like any other: the
# window itself is applied by the attention function from the sliding_window its call passes (layout.py checks at
# convert / from_pretrained that every layer whose mask has a window passes it).
_SLIDING_PARTS = ("sliding_window_overlay", "sliding_window_bidirectional_overlay", "_bidirectional_window_overlay",
                  "causal_mask_function", "bidirectional_mask_function", "and_masks", "or_masks",
                  "sliding_window_causal_mask_function", "sliding_window_bidirectional_mask_function")


def _is_sliding(fn) -> bool:
    names = [name.split(".<locals>")[0].rsplit(".", 1)[-1] for name in _mask_function_names(fn)]
    return any("sliding" in n or "window" in n for n in names) and all(n in _SLIDING_PARTS for n in names)


def _describe_mask_function(fn: Callable | str) -> str:
    name = fn if isinstance(fn, str) else " + ".join(_mask_function_names(fn))
    if "packed_sequence" in name:
        what = ("packed sequences (position_ids restart inside a row and attention_mask is None, e.g. "
                "DataCollatorWithFlattening): pad the batch instead and pass an attention_mask")
    elif "sliding" in name:
        what = (f"a sliding-window mask combined with another pattern ({name}): only causal and bidirectional "
                "sliding windows with key padding are supported")
    elif "chunked" in name:
        what = "a chunked-attention mask: set attention_chunk_size=None in the model config"
    else:
        what = (f"a custom mask pattern ({name}: or/and mask overlays, block overlays): only causal and "
                "bidirectional attention with key padding are supported")
    return f"hf_polyattn attention cannot apply {what}"


# set while ``integration.graphs.DecodeGraphs`` runs a static decoding step: its caller checked that no token of the
# call is padded, so the mask function answers None without reading the mask (a host sync, which a CUDA graph's
# recording refuses) whatever mask the model made or was given
STATIC_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("polyattn_static_call", default=False)


def polyattn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """2-D (batch, kv_length) bool key-padding mask (True = keep), or None without padding."""
    if mask_function not in (causal_mask_function, bidirectional_mask_function) and not _is_sliding(mask_function):
        raise ValueError(_describe_mask_function(mask_function))
    if attention_mask is None or STATIC_CALL.get():
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"hf_polyattn needs a 2-D (batch, length) attention_mask, got shape "
                         f"{tuple(attention_mask.shape)}")
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    # One host sync per forward (not per layer) buys the all-valid fast path.
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def _dropout_hint(module) -> str:
    config = getattr(module, "config", None)
    names = [n for n in _DROPOUT_NAMES if config is not None and hasattr(config, n)]
    name = names[0] if names else "the attention dropout"
    return (f"attention-probability dropout has no linear-time equivalent (no n x n weights exist): set "
            f"config.{name}=0.0 (e.g. from_pretrained(..., {name}=0.0)) or train in eval mode")


def _key_padding_mask(attention_mask, kv_len: int):
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"hf_polyattn attention received an attention_mask of shape {shape}; it needs the 2-D key-padding "
            "mask its mask function builds. Pass a 2-D (batch, length) attention_mask to the model, not a "
            "prepared 4-D mask."
        )
    if attention_mask.shape[1] < kv_len:
        raise ValueError(f"attention_mask covers {attention_mask.shape[1]} keys, the layer has {kv_len}")
    mask = attention_mask[:, -kv_len:]
    return mask if mask.dtype == torch.bool else mask.to(torch.bool)


def _check_common(module, dropout: float, kwargs: dict) -> None:
    """What every layer of a polyattn model refuses at each call, converted or kept exact."""
    if kwargs.get("output_attentions"):
        raise ValueError(OUTPUT_ATTENTIONS_ERROR)
    if any(kwargs.get(k) is not None for k in _PACKED_KWARGS):
        raise ValueError(_describe_mask_function("packed_sequence"))
    if dropout:
        raise ValueError(f"dropout={dropout} in training mode: {_dropout_hint(module)}")


def _exact_window_attention(module, exact: SlidingWindowSoftmax, query, key, value, attention_mask, scaling, dropout,
                            kwargs):
    """A sliding-window layer kept exact (``layout.py``): the model's softmax over its window, its soft-capping
    applied, its last window - 1 keys kept in the cache layer."""
    _check_common(module, dropout, kwargs)
    check_call_kwargs(module, kwargs, EXACT_WINDOW_KWARGS)  # a bias, sinks, ...: refused, never dropped
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window != exact.window or softcap != exact.softcap:
        raise ValueError(f"{type(module).__name__} (layer {exact.layer_idx}) was kept as an exact sliding-window layer "
                         f"with sliding_window={exact.window}, softcap={exact.softcap} (read from the model at convert "
                         f"/ from_pretrained) and is now called with sliding_window={window}, softcap={softcap}: "
                         "convert the model again")
    return _run_layer(module, exact, _is_causal(module, kwargs), query, key, value, attention_mask, scaling)


def _is_causal(module, kwargs: dict) -> bool:
    return bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))


def _run_layer(module, layer_module, causal: bool, query, key, value, attention_mask, scaling):
    """``layer_module`` (the kind's, or an exact window) on one call, through the cache layer's state when decoding
    causally; the (B, Lq, H, D) output and no weights, as transformers expects."""
    mask = _key_padding_mask(attention_mask, key.shape[2])
    layer = getattr(module, "_polyattn_cache_layer", None) if causal else None
    if layer is not None:
        state = layer.state if layer.state is not None else layer_module.init_state()
        out, layer.state = layer_module(query, key, value, causal=True, scaling=scaling, key_padding_mask=mask,
                                        state=state)
    else:
        out = layer_module(query, key, value, causal=causal, scaling=scaling, key_padding_mask=mask)
    # transformers reshapes the output blindly: (B, Lq, H, D) is the required layout.
    return out.transpose(1, 2).contiguous(), None


def _make_attention_function(kind: str) -> Callable:
    def polyattn_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
        exact = module._modules.get("polyattn_sliding")
        if isinstance(exact, SlidingWindowSoftmax):
            return _exact_window_attention(module, exact, query, key, value, attention_mask, scaling, dropout, kwargs)
        pa = getattr(module, "polyattn", None)
        if not isinstance(pa, HFPolyAttention):
            raise ValueError(
                f"{type(module).__name__} has no polyattn state for attn_implementation={kind!r}. Load the model "
                f"with from_pretrained(..., attn_implementation={kind!r}) or call hf_polyattn.convert(model, "
                f"hf_polyattn.PolyAttnConfig(kind={kind!r}, ...)); set_attn_implementation alone does not create "
                "the per-layer parameters."
            )
        if pa.config.kind != kind:
            raise ValueError(
                f"config._attn_implementation is {kind!r} but the polyattn modules were built for "
                f"{pa.config.kind!r}: call hf_polyattn.convert(model, PolyAttnConfig(kind={kind!r})) to rebuild them"
            )
        pa.check_ready()
        _check_common(module, dropout, kwargs)
        window = kwargs.get("sliding_window")
        if window is not None and window != module.__dict__.get("_polyattn_replaced_window"):
            # the kind replaces a sliding window only where convert planned it (sliding_layers='kind')
            raise ValueError(f"{type(module).__name__} was converted as a full-attention layer and is called with "
                             f"sliding_window={window}: convert the model again (hf_polyattn.convert)")
        # a bias, sinks, ...: refused, never dropped; a soft-cap where the layer applies one (read at convert)
        check_call_kwargs(module, kwargs, EXACT_WINDOW_KWARGS if pa.softcap is not None else ())
        softcap = kwargs.get("softcap")
        if softcap != pa.softcap:  # the cap the layer applies was read from the model at convert / from_pretrained
            raise ValueError(f"{type(module).__name__} (layer {pa.layer_idx}) was converted with softcap={pa.softcap} "
                             f"(read from the model at convert / from_pretrained) and is now called with "
                             f"softcap={softcap}: convert the model again")
        if cross_blocker(pa.config) and getattr(module, "_polyattn_cross_call", False):
            raise local_exact_cross_call_error(module, pa.config)
        causal = _is_causal(module, kwargs)
        if not causal and local_option(pa.config) and query.shape[2] != key.shape[2]:
            raise ValueError(
                f"{type(module).__name__}: bidirectional attention with q_len {query.shape[2]} != kv_len "
                f"{key.shape[2]} and {local_option(pa.config)} is not supported (the exact local part needs "
                "aligned queries and keys)"
            )
        return _run_layer(module, pa, causal, query, key, value, attention_mask, scaling)

    polyattn_attention.__name__ = polyattn_attention.__qualname__ = f"polyattn_{kind}_attention"
    return polyattn_attention


ATTENTION_FUNCTIONS: dict[str, Callable] = {}
_REGISTERED = False


def _register_kind(spec: registry.KindSpec) -> None:
    """Give transformers the attention and mask functions of one kind (a user's kind too, when registered)."""
    fn = ATTENTION_FUNCTIONS.setdefault(spec.name, _make_attention_function(spec.name))
    AttentionInterface.register(spec.name, fn)
    AttentionMaskInterface.register(spec.name, polyattn_mask)


def register_all() -> None:
    """Register every kind, now and whenever one is added (idempotent), and install the construction hook."""
    global _REGISTERED
    if not _REGISTERED:
        registry.on_register(_register_kind)
    install_construction_hook()
    _REGISTERED = True
