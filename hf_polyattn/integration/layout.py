"""Which attention layers a kind converts: the layer layout of models with sliding-window layers.

Gemma 2 / 3, OLMo 3, EXAONE 4, Ministral, Qwen2 (``use_sliding_window``) and ModernBERT interleave sliding-window
layers with full-attention layers; Mistral, Phi-3 and Starcoder2 put one window on every layer. A sliding layer is
already linear time (O(n W)) with a decode cache bounded by its window, so by default
(``PolyAttnConfig.sliding_layers='exact'``) it stays the model's own softmax over its window
(``ops.sliding.SlidingWindowSoftmax``, the submodule ``polyattn_sliding``) and only the full-attention layers get the
kind (the submodule ``polyattn``); ``sliding_layers='kind'`` gives the kind to every layer. A model whose every
layer is sliding has nothing to convert by default: refused with a message saying so.

Where a layer's window is read: the ``sliding_window=`` keyword its forward passes the attention function (read
statically like every other keyword, ``compatibility.py``: ``self.sliding_window``, ``getattr(self.config,
"sliding_window", None)``, ``self.sliding_window if self.is_sliding else None``), which is the window transformers'
own kernels apply. The model's masks follow the config instead (``settings.config_sliding``); the two must agree,
else a window that lives in the mask alone (which hf_polyattn's 2-D padding mask cannot carry) would be lost: such a
model is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import PolyAttnConfig
from ..ops.base import softmax_heads_of
from ..ops.sliding import SlidingWindowSoftmax
from .compatibility import UNKNOWN, attention_dims, call_keyword_value, find_attention_modules
from .settings import config_sliding
from .state import HFPolyAttention

__all__ = ["converted_layers", "describe_layout", "exact_window", "has_sliding", "layer_layout", "model_window",
           "plan_layers"]


def model_window(module: nn.Module, layer_idx: int, owner: str) -> int | None:
    """The sliding window of attention ``module`` (layer ``layer_idx`` of ``owner``): what its forward passes the
    attention function as ``sliding_window``, None for a full-attention layer. ValueError where that cannot be read
    or where the model config, which its masks follow, says otherwise."""
    where = f"{owner} ({type(module).__name__}, layer {layer_idx})"
    window = call_keyword_value(module, "sliding_window")
    if window is UNKNOWN:
        raise ValueError(f"{where}: the sliding_window its forward passes to the attention function cannot be read "
                         "(a local variable), so hf_polyattn cannot tell whether the layer is a sliding-window layer")
    says = config_sliding(module.config, layer_idx)
    if window is None and says:
        raise ValueError(f"{where}: the model config makes this a sliding-window layer (config.layer_types / "
                         "config.sliding_window) but its forward passes no sliding_window to the attention function: "
                         "the window would live in the attention mask alone, which hf_polyattn's key padding mask "
                         "cannot carry; this model is not supported")
    if window is not None and not says:
        raise ValueError(f"{where}: its forward passes sliding_window={window!r} to the attention function while the "
                         "model config makes it a full-attention layer (its mask has no window): hf_polyattn cannot "
                         "tell which attention the model computes there; this model is not supported")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_window={window!r}, expected an int >= 1")
    return window


def exact_window(module: nn.Module, layer_idx: int, cfg: PolyAttnConfig, owner: str) -> int | None:
    """The window at which layer ``layer_idx`` stays the model's exact sliding-window softmax under ``cfg``, or None
    when the kind converts it."""
    window = model_window(module, layer_idx, owner)
    return window if window is not None and cfg.sliding_layers == "exact" else None


def plan_layers(found: list[tuple[str, nn.Module, int]], cfg: PolyAttnConfig, owner: str) -> list[int | None]:
    """``exact_window`` of every attention module of ``found`` (``find_attention_modules``); ValueError when no layer
    is left to convert (every layer sliding, kept exact). (``softmax_heads`` naming a layer kept exact is refused from
    the config, ``compatibility.check_softmax_heads``, which ``model_window`` keeps in step with the modules.)"""
    windows = [exact_window(mod, idx, cfg, owner) for _, mod, idx in found]
    if windows and all(w is not None for w in windows):
        sizes = sorted(set(windows))
        raise ValueError(
            f"every attention layer of {owner} is a sliding-window layer (window {', '.join(map(str, sizes))}): it is "
            "already linear time with a decode cache bounded by its window (StreamingLLM-like, without the sinks), and "
            "sliding_layers='exact' keeps such layers as they are, so nothing would be converted. Pass "
            "sliding_layers='kind' to convert them to the kind (attention beyond the window, in linear time)")
    return windows


def converted_layers(model: nn.Module, sliding_layers: str = "exact") -> list[int]:
    """The layer indices a conversion with ``PolyAttnConfig.sliding_layers`` gives the kind: every attention layer but
    the sliding-window layers kept exact (what ``softmax_heads`` may name)."""
    owner = type(model).__name__
    return sorted({idx for _, mod, idx in find_attention_modules(model)
                   if sliding_layers != "exact" or model_window(mod, idx, owner) is None})


def layer_layout(model: nn.Module, config: PolyAttnConfig | None = None) -> list[dict[str, Any]]:
    """Which layers are which: one entry per attention module, in model order.

    For a converted model (``convert`` / ``from_pretrained(..., attn_implementation=KIND)``) what it runs; with
    ``config``, what ``convert(model, config)`` would make of it (an unconverted model too). Each entry:
    ``{"layer": i, "module": name, "role": "kind" | "sliding" | "softmax" | "unconverted", "text": "..."}`` plus
    ``"window"`` (a sliding layer kept exact: its window; a converted one: the window it had), ``"softcap"`` (a
    sliding layer kept exact: its cap or None; a converted one, when soft-capped: the cap its exact parts apply),
    ``"softmax_kv_heads"`` (kv heads kept softmax in a converted layer). ``"softmax"``: a converted layer whose every
    kv head is softmax (it computes the model's own attention). JSON-ready (the model card and results.json carry it).
    """
    owner = type(model).__name__
    found = find_attention_modules(model)
    if not found:
        raise ValueError(f"{owner} has no attention module that calls ALL_ATTENTION_FUNCTIONS: no layer layout")
    if config is None and not any(isinstance(mod._modules.get(n), (SlidingWindowSoftmax, HFPolyAttention))
                                  for _, mod, _ in found for n in ("polyattn", "polyattn_sliding")):
        raise ValueError(f"{owner} is not converted (no attention module has a polyattn module): pass the "
                         "PolyAttnConfig to see the layout convert would give")
    entries = []
    for name, mod, idx in found:
        entry: dict[str, Any] = {"layer": idx, "module": name}
        if config is None:
            exact = mod._modules.get("polyattn_sliding")
            pa = mod._modules.get("polyattn")
            if not isinstance(exact, SlidingWindowSoftmax) and not isinstance(pa, HFPolyAttention):
                # e.g. a sub-model built with another attention implementation (a multimodal model's tower)
                entries.append({**entry, "role": "unconverted", "text": "the model's own attention (not converted)"})
                continue
            window = exact.window if isinstance(exact, SlidingWindowSoftmax) else None
            cfg = None if pa is None else pa.config
            had = mod.__dict__.get("_polyattn_replaced_window")
        else:
            had = model_window(mod, idx, owner)
            window = had if had is not None and config.sliding_layers == "exact" else None
            cfg = config
        if window is not None:
            softcap = call_keyword_value(mod, "softcap")
            entry.update(role="sliding", window=window, softcap=softcap if isinstance(softcap, (int, float)) else None)
            span = str(window) if getattr(mod, "is_causal", True) else f"|i - j| < {window}"  # ModernBERT's local
            entry["text"] = f"sliding (window {span}, exact softmax" + (
                f", soft-capped at {entry['softcap']})" if entry["softcap"] is not None else ")")
        else:
            heads = list(softmax_heads_of(cfg, idx))
            every = bool(heads) and len(heads) == attention_dims(mod)[2]
            entry.update(role="softmax" if every else "kind", kind=cfg.kind, softmax_kv_heads=heads)
            text = "softmax (every kv head)" if every else cfg.kind + (f", softmax kv heads {heads}" if heads else "")
            softcap = call_keyword_value(mod, "softcap")
            if isinstance(softcap, (int, float)):  # applied where the layer forms a score (softcap_mode)
                entry["softcap"] = softcap
                text += f", soft-capped at {softcap}" + ("" if every else " in its exact parts")
            if had is not None:
                entry["window"] = had
                text += f" (was a sliding-window layer, window {had})"
            entry["text"] = text
        entries.append(entry)
    return entries


def has_sliding(entries: list[dict[str, Any]]) -> bool:
    """Whether a ``layer_layout`` names sliding-window layers (kept exact, or converted from one): what cards state."""
    return any(e["role"] == "sliding" or "window" in e for e in entries)


def describe_layout(entries: list[dict[str, Any]]) -> str:
    """One line for a card: the layers grouped by role, e.g. 'linear: layers [5, 11]; sliding (window 512, exact
    softmax): layers [0, 1, 2, 3, 4, 6, ...]'."""
    groups: dict[str, list[int]] = {}
    for entry in entries:
        groups.setdefault(entry["text"], []).append(entry["layer"])
    return "; ".join(f"{text}: layers {layers}" for text, layers in groups.items())
