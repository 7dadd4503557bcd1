"""One decoding step of many sequences' steady rings, read and written in place in their slots of packed buffers.

A server keeps each sequence's ``WindowRing`` in a slot of fixed-size buffers (``ops.packed.RingLayout``: kv, keys,
vext, valid, logg, meta; stacked over the layers of a run, (slots, P, ...) each). Unpacking a slot into a ring
object, stepping it with ``ring_step`` / ``fused_step`` and packing it back costs tens of dispatched operations and
a few Python decisions per sequence and layer, most of its time dispatch, not arithmetic. ``slot_step`` is the same
arithmetic for B sequences at once, written as one function of tensors that reads each slot through its index and
writes back only what a step changes (the state, the new key, its [v, 1] and log-gate, the counters). Under
``torch.compile`` (``compiled_slot_step``) it becomes a few fused kernels and matmuls; ``ops/cpu/slot_step.c``
(``ops.cpu_kernels``) is the same arithmetic as one native call for float32 on the CPU. The demo's layer, batch 1:
0.59 ms eager, 0.47 ms compiled, 0.08 ms native (recipes/results/benchmark_slot_step/cpu-2threads.json, the 2-core
CPU).

It serves the steady state of ``fused_step``'s layers (``slot_plan``): every ring slot holds a real key and every
sink is filled (the ring has seen at least window + sinks tokens, no padding), a softmax window without a soft-cap,
an elementwise feature map (elu + 1, relu) or Hedgehog's, the optional shared projection and q/k LayerNorm, decay
'none', 'scalar' or 'gate', ``window_mix``, the denominator offset, and the sinks' queries turned by the model's
RoPE (``sink_position='window'``, rotate-half pairs) by min(0, span - length). Each slot's ring position is its own
(``meta``'s head): the leaving key is read at it, folded into the state (decayed by its gate), and the new key
written in its place; the read covers every slot, whose order does not matter to a softmax. No sparse cache.

Eager ``slot_step`` is the reference the compiled one is tested against, and both against ``ring_step`` on
unpacked rings (tests/ops/test_slot_step.py). Pure PyTorch: never imports transformers or vLLM.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .decode import _plan, ring_decodes
from .feature_maps import EluFeatureMap, HedgehogFeatureMap, ReluFeatureMap

__all__ = ["SlotPlan", "compiled_slot_step", "run_slot_step", "slot_buffers", "slot_plan", "slot_state", "slot_step",
           "slot_step_reason", "slot_write"]

_MAPS = {EluFeatureMap: "elu", ReluFeatureMap: "relu", HedgehogFeatureMap: "hedgehog"}


@dataclass
class SlotPlan:
    """What ``slot_step`` reads of one layer: its tensors (in the working dtype, on the buffers' device; None where
    the layer has no such part) and its settings (plain numbers)."""

    proj: torch.Tensor | None  # (Hkv, d, d') the shared feature projection
    q_norm_weight: torch.Tensor | None  # (Hkv, G, d') q LayerNorm's affine
    q_norm_bias: torch.Tensor | None
    k_norm_weight: torch.Tensor | None  # (Hkv, 1, d')
    k_norm_bias: torch.Tensor | None
    map_weight: torch.Tensor | None  # (Hkv, d', d'') Hedgehog's W
    gate_weight: torch.Tensor | None  # (Hkv, d, 1) decay 'gate'
    gate_bias: torch.Tensor | None  # (Hkv, 1, 1)
    scalar_log_gate: torch.Tensor | None  # (Hkv,) decay 'scalar': every key's log-gate
    window_mix: torch.Tensor | None  # (Hkv, G, 1)
    inv_freq: torch.Tensor | None  # (rotary_dim / 2,) float64: the sinks' query rotation, or None
    feature: str  # 'elu', 'relu' or 'hedgehog'
    eps: float
    gate_cap: float | None
    offset: float
    smallest: float
    span: int  # sink_position='window': the farthest position the sinks are scored from
    rotary_dim: int
    scale: float
    sinks: int
    window: int

    def tensors(self) -> tuple:
        return (self.proj, self.q_norm_weight, self.q_norm_bias, self.k_norm_weight, self.k_norm_bias,
                self.map_weight, self.gate_weight, self.gate_bias, self.scalar_log_gate, self.window_mix,
                self.inv_freq)

    def settings(self) -> dict:
        return {"feature": self.feature, "eps": self.eps, "gate_cap": self.gate_cap, "offset": self.offset,
                "smallest": self.smallest, "span": self.span, "rotary_dim": self.rotary_dim, "scale": self.scale,
                "sinks": self.sinks, "window": self.window}


def slot_step_reason(module) -> str | None:
    """Why ``slot_step`` cannot take ``module``'s decoding steps (a sentence), or None when it can: the checks that
    do not depend on a dtype or device (``slot_plan`` checks the rest)."""
    cfg = module.config
    if not cfg.window:
        return "no window (the state is not a ring)"
    if cfg.sparse_cache:
        return "a sparse cache"
    if cfg.decay not in ("none", "scalar", "gate"):
        return f"decay {cfg.decay!r}"
    if type(module.feature_map) not in _MAPS:
        return f"the feature map {type(module.feature_map).__name__}"
    if not ring_decodes(module):
        return "its decoding steps do not run on a WindowRing (learned sinks, short convolutions)"
    rope = getattr(module, "rope", None)
    if cfg.sinks and cfg.sink_position == "window" and rope is not None and getattr(rope, "pairs", None) is not None:
        return "a RoPE whose rotation pairs are not rotate-half's"
    return None


def slot_plan(module, work: torch.dtype, device: torch.device, scale: float) -> SlotPlan | None:
    """``module``'s ``SlotPlan`` for this working dtype, device and scale, or None when ``slot_step`` does not serve
    its steps (``slot_step_reason``, or a step ``fused_step`` would not take: ``ops.decode._plan``'s ``fused``). Made
    from the module's ``_StepPlan`` (its cached views of the parameters), kept while that plan is the same."""
    if slot_step_reason(module) is not None:
        return None
    step = _plan(module, work, device, scale)
    if not step.fused:
        return None
    hit = module.__dict__.get("_slot_plan")
    if hit is not None and hit[0] is step:
        return hit[1]
    cfg = module.config
    scalar = None
    if cfg.decay == "scalar":
        scalar = -torch.exp(module.decay_theta.detach().to(device=device, dtype=work)).view(-1)
    inv_freq, rotary_dim, span = None, 0, 0
    rope = getattr(module, "rope", None)
    if cfg.sinks and cfg.sink_position == "window" and rope is not None:
        inv_freq = rope.inv_freq.detach().to(device=device, dtype=torch.float64)
        rotary_dim, span = int(rope.rotary_dim), int(cfg.resolved_sink_span)
    plan = SlotPlan(step.q.proj, step.q.norm_weight, step.q.norm_bias, step.k.norm_weight, step.k.norm_bias,
                    step.map_weight, step.gate_weight, step.gate_bias, scalar, step.window_mix, inv_freq,
                    _MAPS[type(module.feature_map)], float(step.q.eps), step.gate_cap, float(step.offset),
                    float(step.smallest), span, rotary_dim, float(scale), int(cfg.sinks), int(cfg.window))
    module.__dict__["_slot_plan"] = (step, plan)
    return plan


def _features(x: torch.Tensor, feature: str, map_weight: torch.Tensor | None) -> torch.Tensor:
    if feature == "elu":
        return F.elu(x) + 1.0
    if feature == "relu":
        return torch.relu(x)
    z = torch.matmul(x, map_weight)  # Hedgehog: [softmax(x W), softmax(-x W)]
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


def slot_buffers(layout, slots: int, per_module: int = 1, device=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(a zeroed state of ``slots`` slots, its ``layout`` buffers stacked over ``per_module`` entries as views of it)
    laid out as vLLM lays out a state layer: one page per slot holding the six buffers one after another, the pages
    padded (the view ``slot_step`` reads: ``slot_state``)."""
    shapes = [(per_module, *shape) for shape in layout.shapes()]
    sizes = [math.prod(shape) for shape in shapes]
    page = sum(sizes) + 32  # padded as vLLM pads a state page: a slot's stride is not the buffers' size
    raw = torch.zeros(slots * page, dtype=layout.work, device=device)
    buffers, offset = [], 0
    for shape, size in zip(shapes, sizes):
        buffers.append(raw.as_strided((slots, *shape), (page, *_contiguous(shape)), offset))
        offset += size
    return raw, buffers


def _contiguous(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def slot_state(buffers) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(the (slots, span) view of the memory of a state layer's buffers, each buffer's offset in a slot's row), or
    None when the buffers are not laid out that way (each (slots, ...) with the same slot stride, contiguous
    within a slot, in one storage).

    ``slot_step`` takes the buffers as this one view: six views of one storage passed to a compiled function as six
    inputs are aliased inputs, which torch.compile cannot trace with symbolic sizes (a fake-tensor error on the
    storage size); inside the step they are views of its one input."""
    first = buffers[0]
    stride = first.stride(0)
    storage = first.untyped_storage().data_ptr()
    base = min(t.storage_offset() for t in buffers)
    span = 0
    for t in buffers:
        if (t.untyped_storage().data_ptr() != storage or t.stride(0) != stride or t.dtype != first.dtype
                or t.device != first.device or t.shape[0] != first.shape[0]
                or tuple(t.stride()[1:]) != _contiguous(t.shape[1:])):
            return None
        span = max(span, t.storage_offset() - base + math.prod(t.shape[1:]))
    if span > stride and first.shape[0] > 1:  # the slots' rows would overlap
        return None
    view = first.as_strided((first.shape[0], span), (stride, 1), base)
    return view, tuple(t.storage_offset() - base for t in buffers)


def slot_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, sub: torch.Tensor,
              state: torch.Tensor, proj, q_norm_weight, q_norm_bias, k_norm_weight, k_norm_bias, map_weight,
              gate_weight, gate_bias, scalar_log_gate, window_mix, inv_freq, *, offsets: tuple[int, ...],
              dims: tuple[int, ...], feature: str, eps: float, gate_cap: float | None, offset: float,
              smallest: float, span: int, rotary_dim: int, scale: float, sinks: int,
              window: int) -> torch.Tensor:
    """One token of B sequences whose rings are steady, each in slot ``slots[b]``, entry ``sub`` (a (1,) int64
    tensor: a 0-d index would be read as a Python number, which a compiled step cannot) of the buffers: (the
    (B, Hkv, G, d) output in the working dtype, the flat positions in ``state``'s memory the step writes and their
    values) for ``slot_write`` (``run_slot_step`` runs both).

    q (B, Hkv, G, d), k / v (B, Hkv, d): the model's (any float dtype). ``state`` and ``offsets``: the buffers'
    memory and where each starts in a slot's row (``slot_state``); ``dims`` (P, Hmax, F, d, decay): the buffers'
    entries, kv heads, features, head dim and whether they keep log-gates (``RingLayout``: kv (P, Hmax, F, d + 1),
    keys (P, Hmax, S + W, d), vext (.., d + 1), logg (P, Hmax, W), meta (P, 6): length, head, count, filled,
    real_run, waiting); Hkv <= Hmax. The rest: a ``SlotPlan``'s tensors and settings.

    The step writes nothing itself: a compiled step that wrote its input's views in place had inductor copy the
    whole state at every call (seconds a call for a state layer of 300 slots), so the new key enters the read
    through a mask at its slot and the writes are returned as positions and values."""
    b, hkv, g, d = q.shape
    p_, hmax, nf, dh, decay = dims
    n = sinks + window
    rows = state.shape[0]

    def part(i: int, shape: tuple) -> torch.Tensor:
        return state[:, offsets[i]:offsets[i] + math.prod(shape)].view(rows, *shape)

    kv, keys, vext = part(0, (p_, hmax, nf, dh + 1)), part(1, (p_, hmax, n, dh)), part(2, (p_, hmax, n, dh + 1))
    logg, meta = (part(4, (p_, hmax, window)) if decay else None), part(5, (p_, 6))
    work = state.dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    r, h = slots[:, None], torch.arange(hkv, device=q.device)[None, :]  # (B, 1), (1, Hkv): with ``sub``
    m_rows = meta[slots, sub]  # (B, 6)
    length, head = m_rows[:, 0], m_rows[:, 1].long()
    keys_all, vext_all, kv_all = keys[r, sub, h], vext[r, sub, h], kv[r, sub, h]  # (B, Hkv, S + W, d), ..
    slot = (sinks + head)[:, None]  # (B, 1): the ring slot of the key leaving the window, where the new one goes
    k_old, vx_old = keys[r, sub, h, slot], vext[r, sub, h, slot]  # (B, Hkv, d), (B, Hkv, d + 1)
    at = (torch.arange(n, device=q.device)[None, :] == slot)[:, None, None, :]  # (B, 1, 1, S + W)

    # its features and the queries', as the rows of one pass (``fused_step``): projection, LayerNorm, map
    x = torch.cat([q, k_old[:, :, None]], 2)  # (B, Hkv, G + 1, d)
    if proj is not None:
        x = torch.matmul(x, proj)
    if q_norm_weight is not None:
        y = F.layer_norm(x, x.shape[-1:], eps=eps)
        xq, xk = y[:, :, :g] * q_norm_weight + q_norm_bias, y[:, :, g:] * k_norm_weight + k_norm_bias
    else:
        xq, xk = x[:, :, :g], x[:, :, g:]
    fq, fk = _features(xq, feature, map_weight), _features(xk, feature, map_weight)

    # the state takes the leaving key, decayed by its gate first (``_fold``); the new key's log-gate
    vx_new = torch.cat([v, torch.ones_like(v[..., :1])], -1)  # (B, Hkv, d + 1)
    lg_new = logg_all = at_w = None
    if logg is not None:
        logg_all = logg[r, sub, h]  # (B, Hkv, W)
        at_w = (torch.arange(window, device=q.device)[None, :] == head[:, None])[:, None, :]  # (B, 1, W)
        kv_all = kv_all * logg[r, sub, h, head[:, None]].exp()[..., None, None]
        if gate_weight is not None:
            lg_new = F.logsigmoid(torch.matmul(v[:, :, None, :], gate_weight)[..., 0, 0] + gate_bias[:, 0, 0])
        else:
            lg_new = scalar_log_gate.expand(b, hkv)
        if gate_cap is not None:
            lg_new = lg_new.clamp(max=gate_cap)
        logg_all = torch.where(at_w, lg_new[:, :, None], logg_all)
    kv_all = kv_all + fk.transpose(-1, -2) * vx_old[:, :, None, :]  # (B, Hkv, F, d + 1)

    # the read (``_read``): the sinks and the window exactly, one normaliser, the state through the query features;
    # the keys as they were, the new key's score and [v, 1] put in at its slot (a copy of the keys with it would
    # cost a pass over them: the sinks' slots never take it)
    scores = torch.matmul(q, keys_all.transpose(-1, -2)) * scale  # (B, Hkv, G, S + W)
    scores = torch.where(at, (q * k[:, :, None]).sum(-1, keepdim=True) * scale, scores)
    if inv_freq is not None and sinks:  # the sinks' query turned by min(0, span - length) (``window.sink_shifts``)
        angle = (span - length).clamp(max=0).to(inv_freq.dtype)[:, None] * inv_freq  # (B, rotary_dim / 2)
        c, s = angle.cos().to(work)[:, None, None], angle.sin().to(work)[:, None, None]
        half = rotary_dim // 2
        q1, q2 = q[..., :half], q[..., half:rotary_dim]
        sq = torch.cat([q1 * c - q2 * s, q2 * c + q1 * s, q[..., rotary_dim:]], -1)
        sink_scores = torch.matmul(sq, keys_all[:, :, :sinks].transpose(-1, -2)) * scale
        scores = torch.cat([sink_scores, scores[..., sinks:]], -1)
    m = scores.amax(-1, keepdim=True).clamp_min(0.0)
    weights = (scores - m).exp()
    num = torch.matmul(weights, vext_all)  # (B, Hkv, G, d + 1): the old key's [v, 1] at the slot, then replaced
    num = num + (weights * at).sum(-1, keepdim=True) * (vx_new - vx_old)[:, :, None]
    far = torch.matmul(fq, kv_all)
    log_factor = -m if logg_all is None else logg_all.sum(-1)[..., None, None] - m
    factor = log_factor.exp()
    if window_mix is not None:
        factor = factor * window_mix.abs()
    num = num + far * factor
    out = num[..., :d] / (num[..., d:] + offset).clamp_min(smallest)

    # what the step writes (the state, the new key in the leaving key's slot, its log-gate, the counters) as the
    # flat positions in ``state``'s memory and their values: one ``index_copy_`` outside (``slot_write``)
    page = state.stride(0)
    first = slots * page  # (B,)

    def at_(i: int, entry: int, inner: torch.Tensor) -> torch.Tensor:
        return first.view(-1, *([1] * (inner.dim() - 1))) + offsets[i] + sub * entry + inner

    e = dh + 1
    kv_at = at_(0, hmax * nf * e, h[..., None] * (nf * e) + torch.arange(nf * e, device=q.device))
    slot = slot[:, :, None]  # (B, 1, 1)
    keys_at = at_(1, hmax * n * dh, h[..., None] * (n * dh) + slot * dh + torch.arange(dh, device=q.device))
    vext_at = at_(2, hmax * n * e, h[..., None] * (n * e) + slot * e + torch.arange(e, device=q.device))
    meta_at = at_(5, 6, torch.arange(6, device=q.device)[None, :])
    new_rows = torch.cat([(length + 1)[:, None], ((head + 1) % window).to(work)[:, None], m_rows[:, 2:4],
                          (m_rows[:, 4] + 1)[:, None], m_rows[:, 5:]], 1)
    index = [kv_at.reshape(-1), keys_at.reshape(-1), vext_at.reshape(-1), meta_at.reshape(-1)]
    values = [kv_all.reshape(-1), k.reshape(-1), vx_new.reshape(-1), new_rows.reshape(-1)]
    if logg is not None:
        index.append(at_(4, hmax * window, h * window + head[:, None]).reshape(-1))
        values.append(lg_new.reshape(-1))
    return out, torch.cat(index), torch.cat(values)


def slot_write(state: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``slot_step``'s values at their flat positions in ``state``'s memory (one ``index_copy_``; inside a
    compiled step the same write made inductor copy the whole state: a mutation of a view of an input)."""
    rows, span = state.shape
    flat = state.as_strided(((rows - 1) * state.stride(0) + span,), (1,))
    flat.index_copy_(0, index, values)


def run_slot_step(step, q, k, v, slots, sub, state, plan: SlotPlan, offsets: tuple[int, ...],
                  dims: tuple) -> torch.Tensor:
    """``step`` (``slot_step`` or ``compiled_slot_step()``) and its writes: the (B, Hkv, G, d) output."""
    out, index, values = step(q, k, v, slots, sub, state, *plan.tensors(), offsets=offsets, dims=dims,
                              **plan.settings())
    slot_write(state, index, values)
    return out


# compiled variants kept per process: sizes of 1 are specialised (a batch of one sequence, a layer of one kv head:
# up to 4 variants a model), and more where an engine's tensors differ in what dynamo guards on
_RECOMPILE_LIMIT = 64


@functools.cache
def compiled_slot_step():
    """``slot_step`` under ``torch.compile(dynamic=True, fullgraph=True)``, made once per process; traced with sizes
    that are not unified because they happen to be equal (duck sizing: a layer of 3 kv heads and 3 queries a head
    would be compiled again for a layer of 2), so that one graph serves every batch of two or more sequences and
    every layer of two or more kv heads, and one more each the batch of one and the layer of one kv head
    (specialised by dynamo; its size-oblivious mode cannot trace the step's views of the state)."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), _RECOMPILE_LIMIT))
            break
    compiled = torch.compile(slot_step, dynamic=True, fullgraph=True)
    shapes = fx_config.patch(use_duck_shape=False)

    def step(*args, **kwargs):
        with shapes:  # read when a call traces; a call that hits a compiled graph only pays the context
            return compiled(*args, **kwargs)

    return step
