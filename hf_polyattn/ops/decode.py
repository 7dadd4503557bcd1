"""Token-by-token decoding with a sliding window, on a state updated in place (``WindowRing``).

The generic recurrent step (``RecurrentMixin._decode_window``) rebuilds its window every token: it concatenates the
kept keys with the new one, recomputes every window key's gate from its value, re-applies the kernel inputs to all of
them, gathers the sink slots and slices the window back out. On SmolLM2-135M with the long-context recipe that was
about 400 tensor operations per layer per token, most of them on 128 x 64 tensors, where each costs its dispatch and
not its arithmetic (a 2-core CPU spent about half of a decoding step outside the weights' matmuls and attention).

``WindowRing`` keeps the same information in fixed-size buffers written in place:

* ``keys`` / ``vext`` (B, Hkv, S + W, d) and (.., d + 1): S sink slots, then a ring of W window slots (the model's
  own keys and their [v, 1]; zero keys and zero [v, 1] rows at empty or padded slots, so a step reads every slot
  without a mask), ``valid`` (B, S + W) which slots hold a real key;
* ``logg`` (B, Hkv, W): the log-gates of the ring's keys (``decay``), stored once when the key arrives instead of
  recomputed from the values every token;
* ``kv`` (B, Hkv, F, d + 1): the kernel state, referenced at the last folded key exactly as ``RecurrentState.kv``,
  so a query reads it times exp(sum of the ring's log-gates) (the gates of the keys after the folded one) and nothing
  is ever divided;
* with ``sparse_cache`` (``ops/sparse.py``) ``extra`` slots between the sinks and the ring: the sparse cache, then the
  block of keys waiting for selection (read exactly like the ring's), written by ``sparse.ring_leave`` where a key
  leaving the window would be folded.

One step writes the new key into the ring slot of the key that leaves the window, after folding that key into ``kv``
(or keeping it as a sink: a row's first ``sinks`` real keys), and reads the S + W slots exactly and the state through
the features: the same arithmetic as the generic step (tested to agree with it, and with the chunked path, token by
token), in about 30 operations a layer. Positions inside the ring do not matter: softmax (or the polynomial window)
over a set of keys does not depend on their order, and RoPE was applied to each key before it arrived.

One unpadded sequence whose ring is steady (full of real keys, every sink filled, no sink waiting in a sparse
cache's block: ``fused_ready``) takes ``fused_step`` instead, with a softmax window and an elementwise feature map
(elu + 1, relu) or Hedgehog's: the same arithmetic up to float rounding, the queries and the key leaving the window
mapped as rows of one pass, the ring's buffers read through views made once, the sinks' query turned by a matrix
(``RopeRotation.matrix_by``), a sparse cache's slots read without their mask and the leaving key copied into its
block through views. On the demo's SmolLM2 layer (3 kv heads, window 128, 4 sinks, gate, projection to 64, q/k
LayerNorm) it dispatches 48 top-level operations (108 with the ones they call) against ``ring_step``'s 93 (193),
counted with the profiler inside the attention function; on the linear-only preset's layer (Hedgehog, a 512-key
sparse cache) 68 against 155 dispatched operations in tests/ops/test_sparse_cache.py's small layer
(``PolyAttention.fused_decode`` switches it off: the general step is its reference in the tests).

A state converts from and back to ``RecurrentState`` (``from_recurrent`` / ``to_recurrent``), so a multi-token call
after decoding (a second prompt turn, speculative tokens) and a call with gradients take the generic path; the
in-place writes are only made when no gradient is recorded (``torch.is_grad_enabled()`` False, as in ``generate()``).

Pure PyTorch: never imports transformers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

import torch

from .common import soft_cap
from .feature_maps import EluFeatureMap, HedgehogFeatureMap, ReluFeatureMap
from .sketches import project
from .sparse import pending_log, ring_leave, ring_query, ring_select, sparse_from_recurrent, sparse_to_recurrent
from .state import RecurrentState

__all__ = ["WindowRing", "compiled_ring_step", "fused_ready", "fused_step", "ring_decodes", "ring_supported"]


# the fields ``make_static`` sets: copies of ``head`` and ``seen`` / ``length`` as device counters
_STATIC = ("at", "real")


@dataclass
class WindowRing:
    """Decoding state of a windowed kernel layer, in fixed-size buffers (module docstring). ``head``: the ring slot
    the next key goes to; ``count``: how many ring slots were ever written (<= W); ``length``, ``seen``: as
    ``RecurrentState``; ``filled`` (B,) int64: sink slots filled per row, None once every row has all of them
    (``sinks_full``); ``key_dtype``: the dtype of the model's keys, restored by ``to_recurrent``. ``extra``: the
    sparse cache's slots after the sinks (``cache`` of them the cache, then the waiting block), 0 without one;
    ``kin``, ``slot_log``, ``pending``: their kernel inputs, log-decays and waiting keys per row (``ops/sparse.py``,
    ``ring_leave``); ``q_hist``, ``q_real``, ``score``: what ``sparse_score='attention'`` chooses by."""

    kv: torch.Tensor
    keys: torch.Tensor
    vext: torch.Tensor
    valid: torch.Tensor
    logg: torch.Tensor | None
    filled: torch.Tensor | None
    head: int
    count: int
    length: int
    seen: torch.Tensor | None
    sinks: int
    key_dtype: torch.dtype
    extra: int = 0
    cache: int = 0
    kin: torch.Tensor | None = None
    slot_log: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    # sparse_score='attention': the last sparse_chunk queries (B, Hkv, G, C, d) oldest first, which are real (B, C),
    # and the cache's scores (B, Hkv, cache) (``sparse.ring_query``)
    q_hist: torch.Tensor | None = None
    q_real: torch.Tensor | None = None
    score: torch.Tensor | None = None
    # ``head`` as a (1,) int64 tensor on the ring's device, set by ``make_static``: the step then reads and writes
    # its slot through it (index_select / index_copy_) and advances it in place, so a captured CUDA graph replays
    # every later token (``integration/graphs.py``); the Python ``head`` is kept equal to it. ``real`` (B,) int64:
    # the real keys each row has seen, counted on the device from then on (what ``seen`` / ``length`` count)
    at: torch.Tensor | None = None
    real: torch.Tensor | None = None
    # the keys written since the last padded one (a ``mask`` given to the step): once it reaches the window, every
    # ring slot holds a real key (a zero key and a zero [v, 1] row otherwise), so ``fused_step`` can leave the slot's
    # 1 and ``valid`` as they are
    real_run: int = 0
    # a sink's key waits in the sparse cache's block (it left the window while the sinks filled: it keeps its slot
    # for its gate, with its key and [v, 1], but ``valid`` False) until the block's selection empties it; the block
    # is then read with its mask, not by ``fused_step``
    sink_waiting: bool = False

    def tensors(self) -> list[torch.Tensor]:
        """The state's tensors (not ``at``, a copy of ``head``)."""
        return [t for f in fields(self)
                if f.name not in _STATIC and isinstance(t := getattr(self, f.name), torch.Tensor)]

    def map(self, fn) -> WindowRing:
        """A new ring of ``fn`` of every tensor (batch rows reordered, repeated, moved), not static (its ``seen``
        made from ``real`` before: ``to_recurrent``'s rule)."""
        if self.at is not None and self.seen is not None:
            self.seen = self.real.clone()
        return replace(self, at=None, real=None,
                       **{f.name: fn(t) for f in fields(self)
                          if f.name not in _STATIC and isinstance(t := getattr(self, f.name), torch.Tensor)})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def index_select(self, index: torch.Tensor) -> WindowRing:
        """Reorder/select batch rows (beam search, num_return_sequences)."""
        return self.map(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_interleave(self, repeats: int) -> WindowRing:
        return self.map(lambda t: t.repeat_interleave(repeats, dim=0))

    @property
    def window(self) -> int:
        return self.keys.shape[2] - self.sinks - self.extra

    @property
    def steady(self) -> bool:
        """Whether every later step takes the same branches: the ring full, every row's sinks filled and no sparse
        cache (its selection moves keys between slots by Python indices)."""
        return self.count == self.window and self.filled is None and not self.extra

    def make_static(self) -> None:
        """Give the ring its slot (``at``) and each row's count of real keys (``real``, read for the sinks' query
        shift) as device tensors, so that a step can be captured and replayed; only in the ``steady`` state
        (ValueError otherwise)."""
        if not self.steady:
            raise ValueError(f"a ring can be made static only when full with its sinks filled and without a sparse "
                             f"cache (count={self.count} of {self.window}, sinks filling: {self.filled is not None}, "
                             f"sparse slots: {self.extra})")
        if self.at is None:
            self.at = torch.full((1,), self.head, dtype=torch.long, device=self.keys.device)
            b = self.keys.shape[0]
            self.real = (self.seen.clone() if self.seen is not None
                         else torch.full((b,), self.length, dtype=torch.long, device=self.keys.device))

    def advance(self) -> None:
        """The Python side of one steady step (what ``ring_step`` does to ``head`` and ``length``), for a step whose
        tensor work was replayed from a graph."""
        self.head = (self.head + 1) % self.window
        self.length += 1
        self.real_run += 1  # a recorded step is replayed for unpadded tokens only (``integration/graphs.py``)

    def _ring_order(self) -> torch.Tensor | slice:
        """The ring slots from the oldest key to the newest."""
        w = self.window
        if self.count < w:
            return slice(0, self.count)
        return (torch.arange(w, device=self.keys.device) + self.head) % w

    def to_recurrent(self) -> RecurrentState:
        """The same state as a ``RecurrentState`` (window keys in order, the sinks that left it), for the generic
        path."""
        if self.extra:
            return sparse_to_recurrent(self)
        seen = self.real.clone() if self.at is not None and self.seen is not None else self.seen
        s, d = self.sinks, self.keys.shape[-1]
        order = self._ring_order()
        ring_k = self.keys[:, :, s:][:, :, order]
        ring_v = self.vext[:, :, s:, :d][:, :, order]
        ring_valid = self.valid[:, s:][:, order]
        k = v = mask = None
        if ring_k.shape[2]:
            k, v = ring_k.to(self.key_dtype), ring_v.to(self.key_dtype)
            mask = None if bool(ring_valid.all()) else ring_valid
        sink_k = sink_v = sink_mask = None
        if s and bool(self.valid[:, :s].any()):
            sink_k = self.keys[:, :, :s].to(self.key_dtype)
            sink_v = self.vext[:, :, :s, :d].to(self.key_dtype)
            sink_mask = self.valid[:, :s].clone()
        return RecurrentState(self.kv.unsqueeze(2), k, v, mask, self.length, sink_k, sink_v, sink_mask, seen)


def ring_supported(module, state) -> bool:
    """Whether ``module`` (a ``PolyAttention``) decodes ``state`` with a ``WindowRing``: a sliding window, no
    learned sink slots and no short convolution (their state is not in the ring), the kernel-product path with a
    state of folded keys, no gradient recorded."""
    return ring_decodes(module) and not torch.is_grad_enabled() and isinstance(state, (RecurrentState, WindowRing))


def ring_decodes(module) -> bool:
    """Whether ``module``'s single-token steps without gradients run on a ``WindowRing`` (``ring_supported``'s
    settings part): the module says so (``PolyAttention.decodes_on_ring``); a module of any other class never does.
    The class is asked rather than imported here because ops/attention.py imports this file."""
    decodes_on_ring = getattr(module, "decodes_on_ring", None)
    return decodes_on_ring is not None and bool(decodes_on_ring())


def from_recurrent(module, state: RecurrentState, batch: int, device, work: torch.dtype,
                   key_dtype: torch.dtype) -> WindowRing:
    """A ``WindowRing`` holding what ``state`` (the generic state after a prefill, or an empty one) holds."""
    cfg = module.config
    s, w, d, hkv = cfg.sinks, cfg.window, module.head_dim, module.num_kv_heads
    extra = cfg.sparse_cache + cfg.sparse_chunk if cfg.sparse_cache else 0
    keys = torch.zeros(batch, hkv, s + extra + w, d, dtype=work, device=device)
    vext = torch.zeros(batch, hkv, s + extra + w, d + 1, dtype=work, device=device)
    valid = torch.zeros(batch, s + extra + w, dtype=torch.bool, device=device)
    logg = None if cfg.decay == "none" else torch.zeros(batch, hkv, w, dtype=work, device=device)
    if state.kv is None:
        kv = torch.zeros(batch, hkv, module.num_features, d + 1, dtype=work, device=device)
    else:
        kv = state.kv.to(work).squeeze(2).expand(batch, -1, -1, -1).clone()

    def put(at: slice, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor) -> None:
        # a padded key as an empty slot: a zero key and a zero [v, 1] (``ring_step``)
        keep = real[:, None, :, None].to(work)
        keys[:, :, at] = k.to(work) * keep
        vext[:, :, at, :d] = v.to(work)
        vext[:, :, at, d] = 1.0
        vext[:, :, at] *= keep
        valid[:, at] = real

    filled = None
    if s:
        filled = torch.zeros(batch, dtype=torch.long, device=device)
        if state.sink_k is not None:
            put(slice(0, s), state.sink_k, state.sink_v, state.sink_mask)
            filled = state.sink_mask.sum(-1)
        if bool((filled == s).all()):
            filled = None
    held = 0 if state.k is None else state.k.shape[2]
    count = min(held, w) if extra else held  # a sparse cache's state holds the waiting block before the window
    if count:
        if count > w:
            raise AssertionError(f"a windowed state keeps at most {w} keys, got {count}")
        k, v, m = state.k[:, :, held - count :], state.v[:, :, held - count :], state.mask
        m = None if m is None else m[:, held - count :]
        real = m if m is not None else torch.ones(batch, count, dtype=torch.bool, device=device)
        put(slice(s + extra, s + extra + count), k, v, real)
        if logg is not None:
            logg[..., :count] = module.log_gates(v.to(work).unsqueeze(2), m).squeeze(2)
    real_run = count if count and (state.mask is None or bool(real.all())) else 0  # one read, once per ring
    ring = WindowRing(kv, keys, vext, valid, logg, filled, count % w, count, state.length, state.seen, s, key_dtype,
                      real_run=real_run)
    if extra:
        sparse_from_recurrent(module, ring, state, held - count)
    return ring


@dataclass
class _Side:
    """What maps one side (queries or keys) of a layer to its kernel inputs in a decoding step: the projection as
    (Hkv, d, d') for one batched matmul over the kv heads (``proj``) or the module's weight for ``project``
    (``proj_weight``: a batch of sequences, or a weight in another dtype), the q/k LayerNorm's affine as (Hkv, R, d')
    and its eps."""

    proj: torch.Tensor | None
    proj_weight: torch.Tensor | None
    norm_weight: torch.Tensor | None
    norm_bias: torch.Tensor | None
    eps: float


@dataclass
class _StepPlan:
    """A layer's learned tensors and settings as ``ring_step`` reads them, made once per layer, working dtype,
    device and scale (``_plan``): views of the parameters in the shapes the step multiplies them in, so a step
    dispatches no reshaping of them, and its settings as plain attributes (a module attribute goes through
    ``nn.Module.__getattr__``, a parameter's reshaping is a dispatched operation). Views alias the parameters, so
    an in-place update is read; ``owners`` / ``ptrs`` detect a parameter replaced or moved (``_plan`` then makes a
    new plan)."""

    key: tuple
    config: object
    owners: tuple
    ptrs: tuple
    q: _Side
    k: _Side
    feature_scale: float | None
    feature_map: object
    log_scaled: bool
    gate_weight: torch.Tensor | None
    gate_bias: torch.Tensor | None
    gate_cap: float | None  # the config's max_log_gate (None: no bound)
    softmax: bool
    softcap: float | None
    offset: float
    window_mix: torch.Tensor | None
    smallest: float
    # ``fused_step`` serves the layer: softmax window without a soft-cap, an elementwise feature map (elu + 1,
    # relu) on unscaled inputs or Hedgehog's, the projection as one batched matmul, one LayerNorm eps for both
    # sides; ``act_`` the elementwise map applied in place, ``map_weight`` (Hkv, d', d') Hedgehog's W
    fused: bool = False
    act_: object = None
    map_weight: torch.Tensor | None = None
    zero: torch.Tensor | None = None  # (1, 1, 1): the input of a matmul with beta=0


def _map_rows(plan: _StepPlan, x: torch.Tensor) -> torch.Tensor:
    """The features of the kernel inputs x (Hkv, R, d') of ``fused_step``: an elementwise map in place (x is the
    step's own tensor or a view of it), Hedgehog's [softmax(x W), softmax(-x W)] as one batched matmul over the kv
    heads (``HedgehogFeatureMap.forward``'s arithmetic)."""
    if plan.act_ is not None:
        return plan.act_(x)
    z = torch.bmm(x, plan.map_weight)
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(z.neg_(), dim=-1)], dim=-1)


# the smallest positive float32 (float64): a denominator clamped to it is itself wherever it is > 0, and a row whose
# denominator is 0 (every weight 0, hence every numerator 0: the weights and features are >= 0) reads 0 / it = 0,
# as ``_safe_divide`` returns, in one operation instead of five
_SMALLEST = {torch.float32: 2.0 ** -149, torch.float64: 2.0 ** -1074}


def _elu_plus_one_(x: torch.Tensor) -> torch.Tensor:
    # ``common.ACTIVATIONS['elu']`` (elu(x) + 1) in place; the 1 a 0-dim tensor (a Python number is wrapped into
    # one at every call)
    return torch.nn.functional.elu_(x).add_(_one(x.dtype, x.device))


@functools.cache
def _one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # read by later calls, which may run outside inference mode
        return torch.ones((), dtype=dtype, device=device)


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.zeros(1, 1, 1, dtype=dtype, device=device)


# the elementwise feature maps ``fused_step`` applies in place on its own rows (the same arithmetic as their forward)
_IN_PLACE_MAPS = {EluFeatureMap: _elu_plus_one_, ReluFeatureMap: torch.relu_}


def _plan(module, work: torch.dtype, device: torch.device, scale: float) -> _StepPlan:
    """The layer's ``_StepPlan`` for this working dtype, device and scale: the cached one while its parameters are
    the same tensors, else a new one (cached only when every parameter is in the working dtype: a converted copy
    would not see an in-place update)."""
    key = (work, device, scale, module.softcap)
    cfg = module.config
    plan = module.__dict__.get("_ring_plan")
    if (plan is not None and plan.key == key and plan.config is cfg and plan.feature_map is module.feature_map
            and all(owner[name] is t and t.data_ptr() == ptr
                    for (owner, name, t), ptr in zip(plan.owners, plan.ptrs))):
        return plan
    hkv = module.num_kv_heads
    owners = []

    def param(owner_module, name: str) -> torch.Tensor:
        t = owner_module._parameters[name]
        owners.append((owner_module._parameters, name, t))
        return t.detach().to(device=device, dtype=work)

    def side(is_query: bool) -> _Side:
        proj = proj_weight = norm_w = norm_b = None
        eps = 0.0
        if cfg.feature_proj:
            proj_weight = module.feature_proj.weight
            w = param(module.feature_proj, "weight")  # (Hkv, 1, d, d')
            if proj_weight.dtype == work or device.type != "cuda":  # else ``project``'s tensor-core rule
                proj = w.view(hkv, w.shape[-2], w.shape[-1])
        if cfg.qk_norm:
            norm = module.q_norm if is_query else module.k_norm
            rows = norm.weight.shape[1]  # G for the queries, 1 for the keys
            norm_w = param(norm, "weight").view(hkv, rows, -1)
            norm_b = param(norm, "bias").view(hkv, rows, -1)
            eps = norm.eps
        return _Side(proj, proj_weight, norm_w, norm_b, eps)

    gate_w = gate_b = mix = None
    if cfg.decay == "gate":
        gate_w = param(module, "gate_weight").view(hkv, -1, 1)
        gate_b = param(module, "gate_bias").view(hkv, 1, 1)
    if cfg.window_mix:
        mix = param(module, "window_mix").view(hkv, module.groups, 1)
    fmap = module.feature_map
    q_side, k_side = side(True), side(False)
    act_ = _IN_PLACE_MAPS.get(type(fmap))
    map_weight = None
    if type(fmap) is HedgehogFeatureMap and (fmap.weight.dtype == work or device.type != "cuda"):  # ``project``
        w = param(fmap, "weight")  # (Hkv, 1, d', d')
        map_weight = w.view(hkv, w.shape[-2], w.shape[-1])
    fused = ((act_ is not None or map_weight is not None) and not fmap.scaled_inputs and not fmap.log_scaled
             and cfg.resolved_local_kernel == "softmax" and module.softcap is None
             and (q_side.proj is not None or not cfg.feature_proj) and q_side.eps == k_side.eps)
    plan = _StepPlan(key, cfg, tuple(owners), tuple(t.data_ptr() for _, _, t in owners), q_side, k_side,
                     math.sqrt(scale) if fmap.scaled_inputs else None, fmap, fmap.log_scaled, gate_w, gate_b,
                     cfg.max_log_gate,
                     cfg.resolved_local_kernel == "softmax", module.softcap, float(cfg.denominator_offset), mix,
                     _SMALLEST[work], fused, act_, map_weight, _zero(work, device))
    if all(t.dtype == work and t.device == device for _, _, t in owners):
        module.__dict__["_ring_plan"] = plan
    return plan


def _log_gate(module, plan: _StepPlan, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """log g of the new token's values v (B, Hkv, 1, d) as (B, Hkv, 1): ``PolyAttention.log_gates`` for one key; for
    one sequence the gate's dot product and bias as one batched multiply-add over the kv heads (12 dispatched
    operations down to 2)."""
    if plan.gate_weight is None:
        return module.log_gates(v.unsqueeze(2), mask).squeeze(2)
    b, hkv, _, d = v.shape
    if b == 1:
        z = torch.baddbmm(plan.gate_bias, v.view(hkv, 1, d), plan.gate_weight).view(1, hkv, 1)
    else:
        z = (v * plan.gate_weight.view(1, hkv, 1, d)).sum(-1) + plan.gate_bias.view(1, hkv, 1)
    lg = torch.nn.functional.logsigmoid(z)
    if plan.gate_cap is not None:
        lg = lg.clamp(max=plan.gate_cap)
    return lg if mask is None else torch.where(mask[:, None, :], lg, 0.0)


def _features(plan: _StepPlan, side: _Side, x: torch.Tensor, is_query: bool):
    """(features (B, Hkv, R, F), FAVOR+'s query log scale (B, Hkv, R, 1) or None) of R rows x (B, Hkv, R, d) of one
    side in the working dtype: ``kernel_input`` (projection, then the q/k LayerNorm), ``_feature_inputs`` and the
    feature map, with the projection of one sequence as one batched matmul over the kv heads (a broadcast 5-D
    matmul dispatched five operations for it) and the LayerNorm's affine as one multiply-add."""
    b, hkv, rows, _ = x.shape
    if side.proj is not None and b == 1:
        x = torch.bmm(x.view(hkv, rows, -1), side.proj).view(1, hkv, rows, -1)
    elif side.proj_weight is not None:
        x = project(x.unsqueeze(3), side.proj_weight).squeeze(3)
    if side.norm_weight is not None:
        x = torch.addcmul(side.norm_bias, torch.layer_norm(x, x.shape[-1:], None, None, side.eps), side.norm_weight)
    if plan.feature_scale is not None:
        x = x * plan.feature_scale
    x = x.unsqueeze(3)  # the maps take the 5-D layout (B, Hkv, R, L, d)
    if is_query and plan.log_scaled:
        f, log_scale = plan.feature_map.forward_with_log_scale(x, True)
        return f.squeeze(3), log_scale.view(b, hkv, rows, 1)
    return plan.feature_map(x, is_query).squeeze(3), None


# the shapes and branches one model's layers take (kv heads per layer's kernel part, the ring slot 0 that inductor
# specialises, a sink still filling, a padded row) gave 6 compiled variants on the demo's model; the default limit
# of 8 would send a model with more of them back to eager without a word
_RECOMPILE_LIMIT = 64


@functools.cache
def compiled_ring_step():
    """``ring_step`` under ``torch.compile(dynamic=True)`` (made once per process): the ring's slot, count and length
    are symbolic, so a decoding step does not recompile as they move. Used by a layer whose ``compile_decode`` is
    set (``hf_polyattn.compile_decode``); the eager ``ring_step`` stays the default and the reference. On the
    project's 2-core CPU it made the demo's decoding step 2-5 % faster than the eager step it had then; against the
    leaner eager step (``_StepPlan``) it is 5-7 % slower (90.9 against 86.5 ms at 4k, 119.5 against 111.6 at 16k,
    after 90 s of compiling into an empty cache: recipes/results/decode_floor/demo_compile): guard checks and the
    compiled graph's own calls cost more than the eager step's small operations."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), _RECOMPILE_LIMIT))
            break
    return torch.compile(ring_step, dynamic=True)


def ring_step(module, q5: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float, ring: WindowRing, sink_q: torch.Tensor | None,
              plan: _StepPlan | None = None) -> torch.Tensor:
    """One token: the layer's (B, Hkv, G, d) output and ``ring`` updated in place.

    q5 (B, Hkv, G, 1, d) the model's own query in the working dtype, key/value (B, Hkv, 1, d) the new token's as the
    model gave them, ``mask`` (B, 1) bool or None, ``sink_q`` the query re-rotated for the sinks (``Sinks.q``) or
    None. The products run on 3-D views (B Hkv, rows, cols), a kv head's G queries as the rows of one matmul (a 5-D
    broadcast over G copied the keys G times). A slot that holds no real key (never written, a padded key, a sink
    not yet filled) holds a zero key and a zero [v, 1] row: it adds nothing to a numerator or a denominator, and its
    score 0 leaves the softmax stabiliser (the row max clamped at 0) as it is, so the plain ring reads every slot
    without a mask (a masked fill and its index per layer and token); the sparse cache's slots keep their mask.
    """
    b, hkv, g, _, d = q5.shape
    s, w = ring.sinks, ring.window
    work = q5.dtype
    if plan is None:
        plan = _plan(module, work, q5.device, scale)
    k_new, v_new = key.to(work), value.to(work)  # (B, Hkv, 1, d)
    if ring.at is not None:  # static (``make_static``): every slot read and written through the device index
        return _static_step(module, plan, q5, k_new, v_new, mask, scale, ring, sink_q)
    slot = s + ring.extra + ring.head
    if ring.count == w:  # the key in this slot leaves the window: into the state, or kept as a sink
        k_old, vx_old = ring.keys.narrow(2, slot, 1), ring.vext.narrow(2, slot, 1)
        is_sink = None
        if ring.filled is not None:
            is_sink = ring.valid[:, slot] & (ring.filled < s)  # (B,): one of its row's first `sinks` real keys
            into = (torch.arange(s, device=q5.device) == ring.filled[:, None]) & is_sink[:, None]  # (B, S)
            at = into[:, None, :, None]
            ring.keys[:, :, :s] = torch.where(at, k_old, ring.keys[:, :, :s])
            ring.vext[:, :, :s] = torch.where(at, vx_old, ring.vext[:, :, :s])
            ring.valid[:, :s] |= into
            ring.filled += is_sink.long()
            # a key that became a sink is attended through its slot from now on: its kernel weight is not folded
            vx_old = vx_old * (~is_sink).to(work)[:, None, None, None]
            if bool((ring.filled == s).all()):
                ring.filled = None
        if ring.extra:  # into the block waiting for the sparse cache's selection instead (a sink too, for its gate)
            ring_leave(module, ring, slot, is_sink, scale)
        else:
            _fold(plan, ring, k_old, vx_old, None if ring.logg is None else ring.logg.narrow(2, ring.head, 1).exp())
    # the new key takes the slot (a padded key as a zero key: the docstring's empty slot)
    vx = ring.vext.select(2, slot)
    if mask is None:
        ring.keys.narrow(2, slot, 1).copy_(k_new)
        vx.narrow(-1, 0, d).copy_(v_new.squeeze(2))
        vx.select(-1, d).fill_(1.0)
        ring.valid.select(1, slot).fill_(True)
    else:
        real = mask.to(work)  # (B, 1)
        ring.keys.narrow(2, slot, 1).copy_(k_new * real[:, :, None, None])
        vx.narrow(-1, 0, d).copy_(v_new.squeeze(2) * real[:, :, None])
        vx.select(-1, d).copy_(real)
        ring.valid.select(1, slot).copy_(mask.squeeze(1))
    if ring.logg is not None:
        ring.logg.narrow(2, ring.head, 1).copy_(_log_gate(module, plan, v_new, mask))
    ring.head = (ring.head + 1) % w
    ring.count = min(ring.count + 1, w)
    ring.length += 1
    ring.real_run = ring.real_run + 1 if mask is None else 0
    if ring.q_hist is not None:  # after the selection: a selection is scored by the queries before its step's
        ring_query(ring, q5, mask)
    return _read(module, plan, q5, scale, ring, sink_q)


def _fold(plan: _StepPlan, ring: WindowRing, k_old: torch.Tensor, vx_old: torch.Tensor,
          gate: torch.Tensor | None) -> None:
    """The key leaving the window, k_old (B, Hkv, 1, d) with its [v, 1] vx_old, added to the state in place, the
    state first decayed by that key's gate (``gate`` (B, Hkv, 1) = exp of its log-gate, None without decay)."""
    b, hkv, _, _ = k_old.shape
    bh, e = b * hkv, ring.vext.shape[-1]
    feats, _ = _features(plan, plan.k, k_old, False)  # (B, Hkv, 1, F)
    if gate is not None:  # the reference moves to the folded key: the state decays by its gate
        ring.kv.mul_(gate.unsqueeze(-1))
    # the outer product phi(k)^T [v 1] added in place: (B Hkv, F, 1) x (B Hkv, 1, d + 1)
    ring.kv.view(bh, -1, e).baddbmm_(feats.reshape(bh, 1, -1).transpose(1, 2), vx_old.reshape(bh, 1, e))


def _static_step(module, plan: _StepPlan, q5: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 mask: torch.Tensor | None, scale: float, ring: WindowRing, sink_q: torch.Tensor | None):
    """``ring_step`` on a static ring (``make_static``: steady, so the key leaving the window is always folded and
    never a sink): the same arithmetic with the slot as the device index ``ring.at``, no Python value read from a
    tensor and none that changes between steps, so the step can be captured in a CUDA graph and replayed."""
    s, w = ring.sinks, ring.window
    at = ring.at
    slot = at + s if s else at
    gate = None if ring.logg is None else ring.logg.index_select(2, at).exp()
    _fold(plan, ring, ring.keys.index_select(2, slot), ring.vext.index_select(2, slot), gate)
    ones = torch.ones_like(v_new[..., :1])
    if mask is None:
        ring.keys.index_copy_(2, slot, k_new)
        ring.vext.index_copy_(2, slot, torch.cat([v_new, ones], -1))
        ring.valid.index_fill_(1, slot, True)
    else:
        real = mask.to(k_new.dtype)[:, :, None, None]  # (B, 1, 1, 1)
        ring.keys.index_copy_(2, slot, k_new * real)
        ring.vext.index_copy_(2, slot, torch.cat([v_new, ones], -1) * real)
        ring.valid.index_copy_(1, slot, mask)
    if ring.logg is not None:
        ring.logg.index_copy_(2, at, _log_gate(module, plan, v_new, mask))
    at.add_(1).remainder_(w)
    ring.head = (ring.head + 1) % w
    ring.length += 1
    ring.real_run = ring.real_run + 1 if mask is None else 0
    return _read(module, plan, q5, scale, ring, sink_q)


def _read(module, plan: _StepPlan, q5: torch.Tensor, scale: float, ring: WindowRing,
          sink_q: torch.Tensor | None) -> torch.Tensor:
    """The step's output (B, Hkv, G, d) from the ring after the new key was written."""
    b, hkv, g, _, d = q5.shape
    s, bh, e = ring.sinks, b * hkv, ring.vext.shape[-1]
    n_slots = ring.keys.shape[2]
    # exact part: the sinks (scored by the re-rotated query when given) and the window's keys, one normaliser
    kt = ring.keys.view(bh, n_slots, d).transpose(1, 2)  # (B Hkv, d, S + W)
    x = torch.bmm(q5.reshape(bh, g, d), kt)  # (B Hkv, G, S + W)
    if s and sink_q is not None:
        x.narrow(2, 0, s).copy_(torch.bmm(sink_q.reshape(bh, g, d), kt.narrow(2, 0, s)))
    x = x.view(b, hkv, g, n_slots).mul_(scale)
    allowed = ring.valid[:, None, None, :] if ring.extra else None
    if plan.softmax:  # exact_weights' softmax: exp(x - m), m = the row max clamped at 0
        x = soft_cap(x, plan.softcap)  # and its cap
        if allowed is not None:
            x = x.masked_fill(~allowed, float("-inf"))
        m = x.amax(dim=-1, keepdim=True).clamp_min_(0.0)
        weights, log_far = x.sub_(m).exp_(), None  # the far part's factor exp(-m) joins the others below
    else:
        weights, log_far = module.exact_weights(x, allowed, module.config.resolved_local_kernel)
        m = None
    num = torch.bmm(weights.view(bh, g, n_slots), ring.vext.view(bh, n_slots, e)).view(b, hkv, g, e)
    # kernel part: the state, decayed by the gates of every key after the folded one (the ring's keys), on the
    # exact part's scale (exp(-m)), FAVOR+'s query scale and window_mix: one factor, one exp
    fq, q_log_scale = _features(plan, plan.q, q5.squeeze(3), True)
    far = torch.bmm(fq.reshape(bh, g, -1), ring.kv.view(bh, -1, e)).view(b, hkv, g, e)
    logs = [t for t in (log_far, q_log_scale) if t is not None]
    if ring.logg is not None:
        total = ring.logg.sum(-1)
        if ring.extra:  # and the gates of the block waiting for selection
            total = total + pending_log(ring)
        logs.append(total.view(b, hkv, 1, 1))
    log_factor = None
    for t in logs:
        log_factor = t if log_factor is None else log_factor + t
    if m is not None:
        log_factor = -m if log_factor is None else log_factor - m
    factor = None if log_factor is None else log_factor.exp()
    if plan.window_mix is not None:
        mix = plan.window_mix.abs()
        factor = mix if factor is None else factor * mix
    if factor is None:
        num.add_(far)
    else:
        num.addcmul_(far, factor)
    den = num[..., d:]
    if plan.offset:
        den = den + plan.offset
    return num[..., :d] / den.clamp_min(plan.smallest)


def fused_ready(ring: WindowRing) -> bool:
    """Whether ``fused_step`` may take ``ring``'s next token: one sequence, not static, every sink filled and every
    ring slot holding a real key (``real_run``). A sparse cache's slots are read without their mask: a slot that
    holds no key holds a zero key and a zero [v, 1] row (``ops/sparse.py``), which adds nothing, once no sink waits
    in its block (``sink_waiting``)."""
    return (ring.at is None and ring.filled is None and ring.count == ring.window and not ring.sink_waiting
            and ring.real_run >= ring.window and ring.keys.shape[0] == 1)


@dataclass
class _RingViews:
    """The views of one sequence's ring buffers ``fused_step`` reads, made once per ring (each view is a dispatched
    operation, 2-3 of them per ``narrow``): the buffers as (Hkv, rows, cols), the keys transposed, the sinks' part,
    and per ring slot its key, [v, 1], v and log-gate; ``source`` the ring's key buffer they were made from."""

    source: torch.Tensor
    keys: torch.Tensor
    kt: torch.Tensor
    sink_kt: torch.Tensor
    vext: torch.Tensor
    kv: torch.Tensor
    logg: torch.Tensor | None
    slots: list
    # with a sparse cache: per slot of the waiting block its key, [v, 1], valid flag, kernel input and log-gate
    # (None without decay), and the block's log-gates (Hkv, 1, chunk)
    waiting: list | None = None
    waiting_log: torch.Tensor | None = None


def _ring_views(ring: WindowRing) -> _RingViews:
    views = ring.__dict__.get("_views")
    if views is not None and views.source is ring.keys:
        return views
    _, hkv, n, d = ring.keys.shape
    s, w, e = ring.sinks, ring.window, d + 1
    keys, vext = ring.keys.view(hkv, n, d), ring.vext.view(hkv, n, e)
    logg = None if ring.logg is None else ring.logg.view(hkv, 1, w)
    slots, first = [], s + ring.extra  # the ring's slots after the sinks and the sparse cache's
    for h in range(w):
        vx = vext.narrow(1, first + h, 1)
        slots.append((keys.narrow(1, first + h, 1), vx, vx.narrow(2, 0, d),
                      None if logg is None else logg.narrow(2, h, 1)))
    kt = keys.transpose(1, 2)
    views = _RingViews(ring.keys, keys, kt, kt.narrow(2, 0, s), vext, ring.kv.view(hkv, -1, e), logg, slots)
    if ring.extra:
        lam, chunk = ring.cache, ring.extra - ring.cache
        kin = ring.kin.view(hkv, ring.extra, -1)
        valid = ring.valid.view(n)
        slot_log = None if ring.slot_log is None else ring.slot_log.view(hkv, 1, ring.extra)
        views.waiting_log = None if slot_log is None else slot_log.narrow(2, lam, chunk)
        views.waiting = [(keys.narrow(1, s + lam + i, 1), vext.narrow(1, s + lam + i, 1),
                          valid.narrow(0, s + lam + i, 1), kin.narrow(1, lam + i, 1),
                          None if slot_log is None else slot_log.narrow(2, lam + i, 1)) for i in range(chunk)]
    ring.__dict__["_views"] = views  # not a field: ``map`` / ``replace`` make a ring without it
    return views


def _wait(module, ring: WindowRing, views: _RingViews, scale: float, k_slot: torch.Tensor, vx_slot: torch.Tensor,
          kin: torch.Tensor, lg_slot: torch.Tensor | None) -> None:
    """``sparse.ring_leave`` for ``fused_step``'s one sequence: the real key leaving the window (its key, [v, 1], kernel
    input (Hkv, 1, d') and log-gate) copied into the next slot of the waiting block through the ring's views, and the
    cache chosen once the block is complete (``sparse.ring_select``): 4-5 copies where ``ring_leave`` selected
    whole blocks (torch.where over (B, Hkv, chunk, d))."""
    at = int(ring.pending)  # one sequence: (1,)
    key, vx, valid, kin_slot, log_slot = views.waiting[at]
    key.copy_(k_slot)
    vx.copy_(vx_slot)
    valid.fill_(True)
    kin_slot.copy_(kin)
    if log_slot is not None:
        log_slot.copy_(lg_slot)
    ring.pending += 1
    if at + 1 == len(views.waiting):
        ring_select(module, ring, ring.pending == len(views.waiting), scale)


def fused_step(module, plan: _StepPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               ring: WindowRing, rot: torch.Tensor | None) -> torch.Tensor:
    """``ring_step`` for the steady state of one unpadded sequence (``fused_ready``, ``plan.fused``): the same
    arithmetic, up to float rounding, in about half the dispatched operations (module docstring); the (Hkv, G, d)
    output and ``ring`` updated in place.

    query (1, H, 1, d), key / value (1, Hkv, 1, d) the model's, in the working dtype; ``rot`` (d, d) the sinks'
    query rotation as a matrix (``RopeRotation.matrix_by``: one matmul instead of a roll and three elementwise
    operations) or None (the sinks score with the query itself). What it leaves out of the general step:

    * the G queries and the key leaving the window take the projection, the LayerNorm and the feature map as the
      rows of one pass (the two sides' affines written into its output), instead of one pass each; with a sparse
      cache the key's row stops before the map (its kernel input waits in the block, ``_wait``);
    * the new key's slot keeps its 1 in [v, 1] and its ``valid`` flag: a real key left it (``real_run``);
    * the ring's buffers are read through views made once (``_RingViews``); the scores' scale is the alpha of
      their matmul.
    """
    _, hkv, _, d = ring.keys.shape
    g = query.shape[1] // hkv
    views = _ring_views(ring)
    head = ring.head
    k_slot, vx_slot, v_slot, lg_slot = views.slots[head]
    q3 = query.view(hkv, g, d)
    x = torch.cat([q3, k_slot], 1)  # (Hkv, G + 1, d): the queries, then the key that leaves the window
    if plan.q.proj is not None:  # the one projection of both sides (``_plan``: the module's feature_proj)
        x = torch.bmm(x, plan.q.proj)
    xq, xk = x.narrow(1, 0, g), x.narrow(1, g, 1)
    if plan.q.norm_weight is not None:  # q_norm's affine on the query rows, k_norm's on the key row
        y = torch.layer_norm(x, x.shape[-1:], None, None, plan.q.eps)
        torch.addcmul(plan.q.norm_bias, y.narrow(1, 0, g), plan.q.norm_weight, out=xq)
        torch.addcmul(plan.k.norm_bias, y.narrow(1, g, 1), plan.k.norm_weight, out=xk)
    if views.waiting is None:
        f = _map_rows(plan, x)  # x is this step's own tensor (an elementwise map: in place)
        fq = f.narrow(1, 0, g)
        if lg_slot is not None:  # the state decays by the leaving key's gate, then takes it (``_fold``)
            views.kv.mul_(lg_slot.exp())
        views.kv.baddbmm_(f.narrow(1, g, 1).transpose(1, 2), vx_slot)
    else:  # the leaving key waits for the sparse cache's selection with its kernel input (``sparse.ring_leave``)
        fq = _map_rows(plan, xq)
        _wait(module, ring, views, scale, k_slot, vx_slot, xk, lg_slot)
    v3 = value.view(hkv, 1, d)
    k_slot.copy_(key.view(hkv, 1, d))
    v_slot.copy_(v3)
    if lg_slot is not None:
        if plan.gate_weight is not None:  # ``_log_gate``'s batched multiply-add over the kv heads
            lg = torch.nn.functional.logsigmoid(torch.baddbmm(plan.gate_bias, v3, plan.gate_weight))
            lg_slot.copy_(lg if plan.gate_cap is None else lg.clamp_(max=plan.gate_cap))
        else:
            lg_slot.copy_(_log_gate(module, plan, value, None).view(hkv, 1, 1))
    ring.head = (head + 1) % ring.window
    ring.length += 1
    ring.real_run += 1
    if ring.q_hist is not None:
        ring_query(ring, query.view(1, hkv, g, 1, d), None)
    # ``_read``: the sinks and the window exactly, one normaliser, the state through the query features
    zero = plan.zero
    x = torch.baddbmm(zero, q3, views.kt, beta=0.0, alpha=scale)  # (Hkv, G, S + W) scaled scores
    if rot is not None and ring.sinks:
        sq = torch.mm(query.view(hkv * g, d), rot).view(hkv, g, d)
        x.narrow(2, 0, ring.sinks).copy_(torch.baddbmm(zero, sq, views.sink_kt, beta=0.0, alpha=scale))
    m = x.amax(dim=-1, keepdim=True).clamp_min_(0.0)
    num = torch.bmm(x.sub_(m).exp_(), views.vext)  # (Hkv, G, d + 1)
    far = torch.bmm(fq, views.kv)
    if views.logg is None:
        log_factor = m.neg()
    else:  # the gates after ``kv``'s reference: the ring's keys and the keys waiting for selection (``pending_log``)
        log_factor = views.logg.sum(-1, keepdim=True) - m
        if views.waiting_log is not None:
            log_factor.add_(views.waiting_log.sum(-1, keepdim=True))
    factor = log_factor.exp_()
    if plan.window_mix is not None:
        factor.mul_(plan.window_mix.abs())
    num.addcmul_(far, factor)
    den = num.narrow(-1, d, 1)
    if plan.offset:
        den = den + plan.offset
    return num.narrow(-1, 0, d) / den.clamp_min_(plan.smallest)  # den: this step's own tensor
