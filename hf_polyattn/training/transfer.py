"""Attention transfer (LoLCATs-style distillation of each layer's softmax attention).

The model is frozen; only the per-layer ``polyattn`` parameters (the PolyAttention submodule that
``hf_polyattn.convert`` attaches to every attention module) train. During transfer the model runs
with a dedicated attention function, registered as ``"polyattn_distill"``, which in every layer

1. computes the teacher: the checkpoint's softmax attention output (SDPA, no grad; with the model's logit
   soft-capping, Gemma 2's ``softcap=``, explicit capped softmax, which SDPA cannot apply),
2. computes the student: ``module.polyattn(q, k, v)`` on the *same* q, k, v,
3. records MSE(student, teacher) (optionally + a cross-entropy between the attention weights),
4. returns the **teacher** output, so the next layer sees exactly the softmax model's hidden states.

A layer with softmax heads (``PolyAttnConfig.softmax_heads``) is exact on those heads: the student there is the
kind's module of the other heads (``HybridAttention.kernel``) and the MSE compares those heads only; a layer whose
every head is softmax, or a sliding-window layer kept exact (``integration/layout.py``), has no student and adds no
loss (its output is the teacher's: SDPA under the model's sliding mask).

Step 4 makes the training layer-wise, as in LoLCATs: every layer learns to imitate its own softmax
attention on the inputs it will see once the layers below are good imitations too, and no gradient
flows between layers (q, k, v are outputs of frozen projections, so the only autograd graph is the
student's own few operations: backward costs a fraction of a forward).

The weight cross-entropy (``attn_ce_weight > 0``) uses the quadratic reference definition
``hf_polyattn.ops.reference_weights`` of the student's weights: O(L^2) memory per layer, fine at the
recipes' contexts (256 tokens), off by default.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from ..ops.common import soft_cap
from ..ops.hybrid import HybridAttention

__all__ = [
    "DISTILL_NAME",
    "DistillCollector",
    "distill_attention",
    "distillation",
    "polyattn_parameters",
    "register_distill_attention",
    "transfer_loss",
]

DISTILL_NAME = "polyattn_distill"  # no 'sdpa'/'flash'/'flex_attention' substrings, no '/'


class DistillCollector:
    """Accumulates the per-layer losses of one forward pass."""

    def __init__(self, attn_ce_weight: float = 0.0):
        self.attn_ce_weight = float(attn_ce_weight)
        self.losses: list[torch.Tensor] = []
        self.mse: list[float] = []
        self.ce: list[float] = []
        self.exact_layers = 0  # layers whose every kv head is softmax (no student): counted, not trained

    def reset(self) -> None:
        self.losses, self.mse, self.ce = [], [], []
        self.exact_layers = 0

    def loss(self) -> torch.Tensor:
        if not self.losses:
            raise RuntimeError(
                f"no attention layer ran through {DISTILL_NAME!r}: the model does not route its attention through "
                "transformers' AttentionInterface, or it was not converted with hf_polyattn.convert"
            )
        return torch.stack(self.losses).mean()


_ACTIVE: list[DistillCollector] = []


def _key_padding_from_mask(mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """2-D key padding mask (B, Lk) from the 4-D mask SDPA receives (a key is real iff some query sees it)."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask.bool()
    m = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    kpm = m.any(dim=-2)[:, 0, :kv_len]
    return None if bool(kpm.all()) else kpm


def _capped_teacher(query, key, value, attention_mask, scaling, is_causal, softcap: float) -> torch.Tensor:
    """Softmax attention with logit soft-capping c tanh(x / c) (Gemma 2's, as its eager attention applies it before
    the mask), which SDPA has no hook for: scores formed explicitly in float32 (the recipes' contexts: the Lq x Lk
    weights of eager attention). ``attention_mask``: SDPA's 4-D mask (bool, True = attend; or additive), or None for
    plain causal / bidirectional attention. (B, Lq, H, D) in the query's dtype."""
    groups = query.shape[1] // key.shape[1]
    k, v = (x.float().repeat_interleave(groups, dim=1) for x in (key, value))
    s = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
    x = soft_cap(torch.matmul(query.float(), k.transpose(-1, -2)) * s, softcap)
    lq, lk = x.shape[-2:]
    if attention_mask is None:
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=x.device)
        allowed = allowed.tril(lk - lq) if is_causal else allowed
        x = x.masked_fill(~allowed, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        x = x.masked_fill(~attention_mask[..., -lk:], float("-inf"))
    else:
        x = x + attention_mask[..., -lk:].float()
    w = torch.softmax(x, dim=-1).nan_to_num(0.0)  # a row without keys: 0, as SDPA's masked rows
    return torch.matmul(w, v).transpose(1, 2).to(query.dtype)


def _teacher(module, query, key, value, attention_mask, scaling, is_causal, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    softcap = kwargs.pop("softcap", None)
    if softcap is not None:  # SDPA would drop it (its **kwargs): the teacher would be another model
        with torch.no_grad():
            return _capped_teacher(query, key, value, attention_mask, scaling, is_causal, softcap)
    with torch.no_grad():
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    return out  # (B, Lq, H, D)


def distill_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    """Attention function of the transfer phase (see module docstring). Returns the teacher output."""
    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    teacher = _teacher(module, query, key, value, attention_mask, scaling, is_causal, **kwargs)
    if not _ACTIVE:
        return teacher, None
    coll = _ACTIVE[-1]
    poly = getattr(module, "polyattn", None)
    if poly is None and "polyattn_sliding" in module._modules:
        coll.exact_layers += 1  # a sliding-window layer kept exact: the teacher is what it computes
        return teacher, None
    if poly is None:
        raise RuntimeError(f"{type(module).__name__} has no 'polyattn' submodule: run hf_polyattn.convert first")
    tgt = teacher.float()
    if isinstance(poly, HybridAttention):
        # softmax heads are exact already: the student is the kind's module on the other heads, against their part
        # of the teacher (their error is not diluted by exact heads); a layer of softmax heads only learns nothing
        if poly.kernel is None:
            coll.exact_layers += 1
            return teacher, None
        _, (query, key, value) = poly.split(query, key, value)
        tgt = tgt.index_select(2, poly.index("kernel_q", tgt.device))
        poly = poly.kernel
    kpm = _key_padding_from_mask(attention_mask, key.shape[2])
    student = poly(query, key, value, causal=bool(is_causal), scaling=scaling, key_padding_mask=kpm)
    student = student.transpose(1, 2).float()  # (B, Lq, H, D)
    row_ok = None
    if kpm is not None and query.shape[2] == key.shape[2]:
        row_ok = kpm[:, :, None, None].to(tgt.dtype)  # padded query rows do not count
    err = (student - tgt) ** 2
    if row_ok is not None:
        mse = (err * row_ok).sum() / (row_ok.sum() * err.shape[2] * err.shape[3]).clamp_min(1.0)
    else:
        mse = err.mean()
    loss = mse
    coll.mse.append(float(mse.detach()))
    if coll.attn_ce_weight > 0:
        ce = _weights_cross_entropy(poly, query, key, value, attention_mask, kpm, scaling, bool(is_causal))
        coll.ce.append(float(ce.detach()))
        loss = loss + coll.attn_ce_weight * ce
    coll.losses.append(loss)
    return teacher, None


def _weights_cross_entropy(poly, query, key, value, attention_mask, kpm, scaling, is_causal):
    """CE(teacher softmax weights || student normalised weights), averaged over real query rows."""
    from ..ops import reference_weights

    s = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
    groups = query.shape[1] // key.shape[1]
    k_rep = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    with torch.no_grad():
        logits = soft_cap(torch.matmul(query.float(), k_rep.float().transpose(-1, -2)) * s, poly.softcap)
        lq, lk = logits.shape[-2:]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=logits.device)
        if is_causal:
            allowed = torch.ones(lq, lk, dtype=torch.bool, device=logits.device).tril(lk - lq)
        allowed = allowed[None, None]
        if kpm is not None:
            allowed = allowed & kpm[:, None, None, :]
        p_t = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    w = reference_weights(poly, query.float(), key.float(), causal=is_causal, scaling=scaling, key_padding_mask=kpm,
                          value=value.float())  # decay='gate' reads the values
    w = w.clamp_min(0.0)
    p_s = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
    ce = -(p_t * torch.log(p_s.clamp_min(1e-12))).sum(-1)  # (B, H, Lq)
    if kpm is not None and lq == lk:
        valid = kpm[:, None, :].to(ce.dtype)
        return (ce * valid).sum() / (valid.sum() * ce.shape[1]).clamp_min(1.0)
    return ce.mean()


_REGISTERED = False


def register_distill_attention() -> None:
    """Register the distillation attention function and its mask function (SDPA's 4-D masks)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DISTILL_NAME, distill_attention)
    # The teacher is SDPA: give it SDPA's masks (the student derives its 2-D key padding mask from them).
    AttentionMaskInterface.register(DISTILL_NAME, sdpa_mask)
    _REGISTERED = True


def polyattn_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Names and parameters of every ``polyattn`` submodule (the only ones transfer trains)."""
    params = [(n, p) for n, p in model.named_parameters() if ".polyattn." in f".{n}"]
    hybrids = [m for m in model.modules() if isinstance(m, HybridAttention)]
    if not params and hybrids and all(m.kernel is None for m in hybrids):
        raise ValueError("the model has no '.polyattn.' parameters: PolyAttnConfig.softmax_heads names every kv head, "
                         "so every head is exact softmax and there is nothing to transfer")
    if not params:
        raise ValueError("the model has no '.polyattn.' parameters: convert it with hf_polyattn.convert(model, "
                         "PolyAttnConfig(...)) first (learned sketches / qk_norm give the transfer something to train)")
    return params


@contextlib.contextmanager
def distillation(model: torch.nn.Module, attn_ce_weight: float = 0.0) -> Iterator[DistillCollector]:
    """Switch ``model`` to the distillation attention; restore its attention implementation on exit.

    Freezes everything but the polyattn parameters (restores the previous requires_grad on exit).
    """
    register_distill_attention()
    params = polyattn_parameters(model)
    prev_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    prev_impl = model.config._attn_implementation
    trainable = {id(p) for _, p in params}
    for _, p in model.named_parameters():
        p.requires_grad_(id(p) in trainable)
    coll = DistillCollector(attn_ce_weight)
    model.set_attn_implementation(DISTILL_NAME)
    _ACTIVE.append(coll)
    try:
        yield coll
    finally:
        _ACTIVE.remove(coll)
        model.set_attn_implementation(prev_impl)
        for n, p in model.named_parameters():
            p.requires_grad_(prev_grad.get(n, p.requires_grad))


def transfer_loss(base_model: torch.nn.Module, batch: dict[str, torch.Tensor], coll: DistillCollector,
                  **model_kwargs: Any) -> torch.Tensor:
    """Run the model on a batch under ``distillation`` and return the mean per-layer loss.

    ``base_model`` is the headless model, or the whole one (a sharded model runs every forward through its
    root) with ``model_kwargs`` such as ``logits_to_keep=1``: the layers' losses do not depend on the head.
    """
    coll.reset()
    inputs: dict[str, Any] = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    inputs.update(model_kwargs)
    inner = getattr(base_model, "module", base_model)  # DDP wrapper
    if getattr(getattr(inner, "config", None), "model_type", "") in _DECODERS:
        inputs["use_cache"] = False
    base_model(**inputs)
    return coll.loss()


_DECODERS = ("llama", "mistral", "qwen2", "gpt2", "gemma3_text", "ministral", "olmo3", "exaone4")


def teacher_student_mse(model, batch) -> float:
    """Mean per-layer MSE of the current student on one batch (no training)."""
    with distillation(model) as coll, torch.no_grad():
        transfer_loss(model.base_model, batch, coll)
        return float(sum(coll.mse) / len(coll.mse))

