"""Kernelised attention: one module per attention layer, any kind of ``PolyAttnConfig``.

Layouts: queries (B, H, Lq, D), keys/values (B, Hkv, Lk, D) with H a multiple of Hkv
(grouped-query attention). Internally the query heads are viewed as (B, Hkv, G, Lq, D)
and keys/values as (B, Hkv, 1, Lk, D), so a kv head's features and prefix states are
computed once and broadcast to its G query heads (never repeated in memory).

Causal rows are bottom-right aligned: with Lq < Lk, query i sits at position Lk - Lq + i
(a chunk of new tokens after a past). Everything is computed in float32 (float64 stays
float64) and returned in the input dtype: degree-4..8 polynomials of O(10) scores reach
1e4..1e8 per weight and sums over 32k keys ~1e12, far past float16's 65504.

Output = (num_local + s * num_far) / (den_local + s * den_far + offset), where the "far"
part is the linear-time kernel product phi(Q) phi(K)^T [V 1] (block algorithm of
``causal.lt_multiply``), the "local" part the exact kernel on the diagonal blocks when
``local_exact`` is set, and s = exp(-m) the softmax row stabiliser (1 otherwise).

Decay (``config.decay``, causal only): the far part's term (i, j) is multiplied by exp(G_i - G_j), G the
cumulative log-gates of the keys (``log_decays``: RetNet's per-head scalar gamma, or GLA-style gates read from
the values), which bounds the kernel part's horizon: a non-negative kernel's mass over n keys grows with n while
an exact window's does not (a retrofitted SmolLM2 got worse from 1k to 4k tokens; what decay does to that is not
measured yet). The exact local part is never decayed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from ..config import PolyAttnConfig
from .backend import lt_product, product_backend, resolve_backend
from .base import AttentionBase, layer_seed
from .causal import lt_multiply_cumsum
from .common import (  # noqa: F401  (_int_power, _safe_divide, _with_normaliser: re-exported)
    HALF,
    _int_power,
    _safe_divide,
    _with_normaliser,
    head_layer_norm,
    normalised_sum,
    read_state,
    row_chunks,
    rowwise_recompute,
    to_work,
    work_dtype,
)
from .conv import ShortConv
from .decode import (
    WindowRing,
    _plan,
    compiled_ring_step,
    from_recurrent,
    fused_ready,
    fused_step,
    ring_step,
    ring_supported,
)
from .feature_maps import FeatureMap, compiled_activation_features
from .flex import layer_backend
from .local import LocalExactMixin, _warn_if_misaligned_left_padding
from .recurrent import RecurrentMixin
from .sketches import project, symmetric_square
from .sparse import SparseMixin
from .state import RecurrentState
from .window import sink_shifts

__all__ = ["HeadLayerNorm", "HeadProjection", "PolyAttention", "RecurrentState", "layer_seed"]


# the linear maps' elu + 1 / relu applied by the Triton kernels as they load q, k (``_product_activation``); False
# maps fp32 copies in PyTorch and hands the kernels feature tensors, as before (recipes/profile_gpu_kernels.py
# layer_rows times both: ``triton`` and ``triton-mapped``)
KERNEL_ACTIVATIONS = True

# the recomputed feature maps of a training forward + backward (``_linear``) run in this many chunks of rows, of at
# least FEATURE_CHUNK_ROWS rows each (shorter sequences in fewer; 1 = the whole side at once, as before)
FEATURE_CHUNKS = 4
FEATURE_CHUNK_ROWS = 256

# a training forward's elementwise-map side (projection, q/k LayerNorm, elu + 1 / relu) through one compiled function
# where ``feature_maps.compiled_activation_features`` hands one out (CUDA): ``_compiled_side``. On an H100 the
# long-context default took 13.1-14.0 ms with it and 20.9-21.8 ms with the side recomputed eagerly in chunks, as
# False does (bf16, n = 32k, H = 16, forward + backward; recipes/profile_gpu_kernels.py default_rows)
COMPILED_FEATURES = True


def feature_chunks(n: int) -> int:
    """How many chunks of rows ``_linear`` recomputes the features of an n-row side in."""
    return row_chunks(n, FEATURE_CHUNKS, FEATURE_CHUNK_ROWS)


class HeadLayerNorm(nn.Module):
    """LayerNorm over the head dimension with its own affine parameters per head."""

    def __init__(self, heads: int, groups: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, groups, 1, dim))
        self.bias = nn.Parameter(torch.zeros(heads, groups, 1, dim))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)
        self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_layer_norm(x, self.weight, self.bias, self.eps)


class HeadProjection(nn.Module):
    """A learnable per-kv-head map x -> x W (d -> d') of q and k before the kernel (Hedgehog /
    LoLCATs' trainable feature projection). W starts as the identity padded with zeros, so
    (qW).(kW) = q.k: an untrained projection leaves dot-product kernels as they were (for
    d' = d every kernel; a coordinatewise map such as elu+1 also sees the d' - d zeros)."""

    def __init__(self, heads: int, dim: int, out_dim: int):
        super().__init__()
        self.dim, self.out_dim = dim, out_dim
        self.weight = nn.Parameter(torch.zeros(heads, 1, dim, out_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        eye = torch.eye(self.dim, self.out_dim, dtype=torch.float64, device="cpu")
        self.weight.copy_(eye.expand(self.weight.shape).to(self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight)


def _seeing(state: RecurrentState, seen: torch.Tensor | None, conv=None) -> RecurrentState:
    """``state`` with the real keys each row has seen (``PolyAttention._sink_queries``), when counted, and the short
    convolution's inputs it keeps (``conv`` = (queries, keys) as the call convolved them: [tail, queries] and [tail,
    the state's raw keys, the new keys], ``PolyAttention._short_conv``): the last size - 1 queries, and the size - 1
    keys before the first one the new state holds raw (``RecurrentState.conv_k``)."""
    if seen is not None:
        state = replace(state, seen=seen)
    if conv is None or conv[2] == 1:  # a one-tap convolution reads no earlier input
        return state
    q_inputs, k_inputs, size = conv
    end = k_inputs.shape[-2] - (0 if state.k is None else state.k.shape[2])
    return replace(state, conv_q=q_inputs[..., q_inputs.shape[-2] - (size - 1):, :],
                   conv_k=k_inputs[..., end - (size - 1) : end, :])


class PolyAttention(LocalExactMixin, RecurrentMixin, SparseMixin, AttentionBase):
    """One attention layer of a kernel kind (polynomial, polysketch, linear, performer, sliding window).

    Holds the layer's state (sketches, feature parameters, q/k LayerNorms, polynomial
    coefficients), all initialised deterministically from ``config.seed`` and
    ``layer_idx``. ``forward`` returns (B, H, Lq, D) in the dtype of ``query``.

    Each kernel kind subclasses it in its own file (``hf_polyattn/kinds/``), giving its feature
    map (``build_feature_map``) and, where its algorithm differs, its path (``choose_path`` /
    ``run_path``); ``PolyAttention(config, ...)`` builds the class registered for ``config.kind``.
    """

    # the exact kernel on every pair, no feature product (ExactPolynomialAttention)
    exact_everywhere = False

    # a decoding step on a WindowRing runs ops.decode.compiled_ring_step instead of ring_step
    # (hf_polyattn.compile_decode; a runtime choice, not a setting: never saved)
    compile_decode: bool = False
    # a decoding step that ops.decode.fused_step can take (one unpadded sequence, the ring steady) takes it; False:
    # the general ring_step (the reference it is tested against; a diagnostic switch, never saved)
    fused_decode: bool = True

    def __new__(cls, config=None, *args, **kwargs):
        if cls is PolyAttention and isinstance(config, PolyAttnConfig):
            target = config.spec.module_class()
            if not (isinstance(target, type) and issubclass(target, PolyAttention)):
                raise TypeError(f"kind={config.kind!r} is not a kernel kind (its module is {target.__name__}); build "
                                f"it with PolyAttnConfig.spec.module_class()(config, ...) or hf_polyattn.convert")
            cls = target
        return super().__new__(cls)

    def __init__(self, config: PolyAttnConfig, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 layer_idx: int = 0):
        super().__init__(config, num_heads, head_dim, num_kv_heads, layer_idx)
        num_kv_heads = self.num_kv_heads
        # the dimension the kernel sees: head_dim, or feature_proj after the learnable projection
        kdim = config.feature_proj or head_dim
        if config.feature_proj:
            if config.feature_proj < head_dim:
                raise ValueError(f"feature_proj must be 0 (off) or >= head_dim ({head_dim}) so that the projection "
                                 f"can start as the identity, got {config.feature_proj}")
            self.feature_proj = HeadProjection(num_kv_heads, head_dim, config.feature_proj)
        self.kernel_dim = kdim
        if config.qk_norm:
            self.q_norm = HeadLayerNorm(num_kv_heads, self.groups, kdim)
            self.k_norm = HeadLayerNorm(num_kv_heads, 1, kdim)
        if config.poly_coefficients is not None:
            coeffs = torch.tensor(config.poly_coefficients, dtype=torch.float32)
            if config.learn_coefficients:
                self.coefficients = nn.Parameter(coeffs)
            else:
                self.register_buffer("coefficients", coeffs)
        if config.window_mix:
            # LoLCATs' per-head factor on the far part (init 1 = today's plain sum)
            self.window_mix = nn.Parameter(torch.full((num_kv_heads, self.groups, 1, 1), config.window_mix_init))
        if config.learned_sinks:
            # Lizard's meta-memory: m key/value slots per kv head, shared by its query heads, scored with the model's
            # own q like the window's keys. Zero keys and values (reset_parameters): a slot then adds nothing to any
            # numerator and the weight of a score-0 key to the denominator, exp(-m_i) for a softmax window whose
            # row stabiliser is m_i >= 0 (0 for a polynomial window without alpha): the output of a row is scaled
            # by den / (den + m exp(-m_i)), den >= 1 when its largest score is >= 0, so the untrained module stays
            # near the model (rows with one dominant score of 5: 8 slots take 5%); zero values, unlike random
            # ones, move no output direction, and zero keys give every slot the gradient of the same query mix.
            shape = (num_kv_heads, 1, config.learned_sinks, head_dim)
            self.sink_k = nn.Parameter(torch.zeros(shape))
            self.sink_v = nn.Parameter(torch.zeros(shape))
        # per kv head: one kernel state serves a kv head's query heads, so they share its decay
        if config.decay == "scalar":
            self.decay_theta = nn.Parameter(torch.empty(num_kv_heads))  # log gamma = -exp(theta): gamma in (0, 1)
        elif config.decay == "gate":
            self.gate_weight = nn.Parameter(torch.empty(num_kv_heads, head_dim))
            self.gate_bias = nn.Parameter(torch.empty(num_kv_heads))
        self._reset_decay()
        if config.short_conv:
            # the causal depthwise convolution on q and k before the kernel (ops/conv.py), identity at the start
            self.conv_q = ShortConv(num_kv_heads, self.groups, head_dim, config.short_conv)
            self.conv_k = ShortConv(num_kv_heads, 1, head_dim, config.short_conv)
        self.feature_map = self.build_feature_map(kdim, self.seed)

    @classmethod
    def scoreless_part(cls, config: PolyAttnConfig) -> bool:
        """Whether layers of this class under ``config`` compute part of their attention as phi(q).phi(k) (the
        kernel part beyond the window / blocks), which forms no score that a logit soft-cap could apply to."""
        return not cls.exact_everywhere

    @classmethod
    def softcap_refusal(cls, config: PolyAttnConfig, layer_idx: int, num_kv_heads: int,
                        exact_elsewhere: bool = False) -> str | None:
        """``AttentionBase.softcap_refusal``: the cap is applied to every score the layer forms (``exact_weights``:
        the window, sinks, learned slots, local_exact blocks, the sparse cache's exact keys); the kernel part forms
        none, so a layer with one needs ``softcap_mode='exact_parts'`` (it then approximates the capped softmax),
        and a layer with nothing but a kernel part is refused either way."""
        scoreless = cls.scoreless_part(config)
        if scoreless and not exact_elsewhere and config.resolved_local_kernel is None:
            return (f"kind={config.kind!r} has no exact part in layer {layer_idx} (no window, no local_exact blocks, "
                    "no softmax heads there): every weight is a kernel product phi(q).phi(k), which forms no score to "
                    "soft-cap, so nothing would apply the model's attention logit soft-capping c tanh(score / c), not "
                    "even with softcap_mode='exact_parts'. Give the layer an exact part (window=..., sinks=..., "
                    "softmax_heads) or use kind='polynomial'")
        if scoreless and config.softcap_mode == "refuse":
            return (f"kind={config.kind!r}: the kernel part phi(q).phi(k) beyond the layer's exact parts forms no "
                    "attention score, so the model's attention logit soft-capping c tanh(score / c) cannot be applied "
                    "there (softcap_mode='refuse', the default). Pass softcap_mode='exact_parts' to apply the cap "
                    "wherever the layer forms a score (window, sinks, local_exact blocks, softmax heads) and let the "
                    "kernel part approximate the capped softmax (attention transfer trains it against the capped "
                    "model)")
        return None

    def build_feature_map(self, dim: int, seed: int) -> FeatureMap | None:
        """The kind's feature map on ``dim``-dimensional kernel inputs (None: no kernel part)."""
        raise NotImplementedError(f"{type(self).__name__} must define build_feature_map")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter and buffer deterministically from the seed."""
        super().reset_parameters()
        if self.config.poly_coefficients is not None:
            self.coefficients.copy_(torch.tensor(self.config.poly_coefficients, dtype=torch.float64, device="cpu"))
        if self.config.window_mix:
            self.window_mix.fill_(self.config.window_mix_init)
        if self.config.learned_sinks:
            self.sink_k.zero_()
            self.sink_v.zero_()
        self._reset_decay()

    @torch.no_grad()
    def _reset_decay(self) -> None:
        """The decay's initial horizon h = ``decay_horizon`` tokens: scalar log gamma = -exp(theta) = -1/h; gates
        g = sigmoid(v . 0 + log(h - 1)) = 1 - 1/h for every token until trained."""
        horizon = self.config.decay_horizon
        if self.config.decay == "scalar":
            self.decay_theta.fill_(-math.log(horizon))
        elif self.config.decay == "gate":
            self.gate_weight.zero_()
            self.gate_bias.fill_(math.log(horizon - 1.0))

    def log_gates(self, v5: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """log g_t of the keys whose values are v5 (B, Hkv, 1, L, D), as (B, Hkv, 1, L), or None without decay: log
        gamma per kv head ('scalar'), logsigmoid(v_t . w + b) ('gate'; from the value, as RoPE rotates k), at most -1 /
        ``decay_max_horizon`` when set; 0 at padded keys (mask False), so padding decays nothing and left padding
        changes no row. Float32 (float64 inputs: float64); callers take the cumulative sum G in this dtype: G's absolute
        error is about |G| 2^-24, 2e-6 at the default horizon over 32k tokens (|G| <= 32), and 0.06 for gates near 0
        (log g = -30, |G| = 1e6) on weights of exp(-30) and below."""
        decay = self.config.decay
        if decay == "none":
            return None
        dt = work_dtype(v5.dtype)
        if decay == "scalar":
            lg = -torch.exp(self.decay_theta.to(dt)).view(-1, 1, 1).expand(v5.shape[0], -1, 1, v5.shape[3])
        else:
            z = torch.matmul(v5.to(dt), self.gate_weight.to(dt).view(-1, 1, v5.shape[-1], 1)).squeeze(-1)
            lg = F.logsigmoid(z + self.gate_bias.to(dt).view(-1, 1, 1))
        if self.config.max_log_gate is not None:  # the bounded memory (decay_max_horizon)
            lg = lg.clamp(max=self.config.max_log_gate)
        return lg if mask is None else torch.where(mask[:, None, None, :], lg, 0.0)

    def log_decays(self, v5: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """G (B, Hkv, 1, L), G_t = sum_{s <= t} log g_s over these keys (``log_gates``), from the key before the
        first (a recurrent state's reference), or None without decay."""
        gates = self.log_gates(v5, mask)
        return None if gates is None else gates.cumsum(-1)

    @property
    def num_features(self) -> int:
        return 0 if self.feature_map is None else self.feature_map.num_features

    def choose_path(self, q_len: int, kv_len: int, causal: bool) -> str:
        """The algorithm of one call: 'linear' (the kernel product), 'sparse' (with ``sparse_cache``, causal:
        ``ops/sparse.py``); a kind's class may add its own."""
        return "sparse" if self.config.sparse_cache and causal else "linear"

    def _recurrent_path(self) -> str:
        """The path of a recurrent state (fixed for the whole generation)."""
        return "sparse" if self.config.sparse_cache else "linear"

    def decodes_by_step(self, path: str) -> bool:
        """Whether a single token with a state takes ``_decode_step`` (a few matmuls) on this path."""
        return path == "linear"

    def decodes_on_ring(self) -> bool:
        """Whether this module's single-token steps without gradients run on a ``WindowRing``
        (``ops.decode.ring_decodes`` asks the module: that file cannot import this class, which imports it)."""
        cfg, cls = self.config, type(self)
        return (bool(cfg.window) and not cfg.learned_sinks and not cfg.short_conv and self.feature_map is not None
                and (self.decodes_by_step(self._recurrent_path()) or self._recurrent_path() == "sparse")
                # a kind with its own path or input precision (the polynomial kind's float64 tensor features) keeps
                # the generic step, which computes what its path computes
                and cls.run_path is PolyAttention.run_path and cls.path_inputs is PolyAttention.path_inputs)

    def path_inputs(self, path, q5, k5, v5):
        """q, k, v in the precision the path computes in (the working dtype unless a path needs more)."""
        return q5, k5, v5

    def run_path(self, path, q5, k5, v5, mask, causal, scale, kv0, raw, tf32=None, sinks=None):
        """(output, key features, [v 1], state after the last key or None) of one call on ``path``. ``sinks``
        (``ops.window.Sinks``, passed only when the config has sinks or learned sinks): what a window attends
        exactly besides its keys."""
        out, fk, vext = self._linear(q5, k5, v5, mask, causal, scale, kv0, raw, tf32, sinks)
        return out, fk, vext, None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                scaling: float | None = None, key_padding_mask: torch.Tensor | None = None,
                state: RecurrentState | None = None):
        """Attention output (B, H, Lq, D); with ``state`` returns (output, new_state).

        ``scaling`` multiplies q.k before the kernel (default 1/sqrt(D), as softmax).
        ``key_padding_mask`` (B, Lk) bool: False keys contribute nothing.
        ``state``: causal only; ``query``, ``key``, ``value`` are the next Lq tokens.
        """
        lq, lk = self.check_call(query, key, value, key_padding_mask, causal, state)
        if self.config.sinks and not causal:
            raise ValueError(f"sinks={self.config.sinks} is defined for causal attention only: attention sinks are the "
                             "first tokens a causal softmax model parks its surplus attention on (StreamingLLM); "
                             "bidirectional (BERT-style) models have no such tokens to preserve. Use sinks=0 here "
                             "(learned_sinks work in both directions)")
        if not causal and self.config.sparse_cache:
            raise ValueError(f"sparse_cache={self.config.sparse_cache} is defined for causal attention only (it keeps "
                             "keys that left a causal window); this call is bidirectional: use sparse_cache=0 there")
        if not causal and self.config.decay != "none":
            raise ValueError(f"decay={self.config.decay!r} is defined for causal attention only (a key decays "
                             "towards the queries after it); this call is bidirectional (an encoder or "
                             "cross-attention): use decay='none' there")
        scale = 1.0 / math.sqrt(self.head_dim) if scaling is None else float(scaling)
        if state is not None and lq == 1 and ring_supported(self, state):
            return self._ring_decode(query, key, value, key_padding_mask, scale, state)
        if isinstance(state, WindowRing):  # a call the ring does not serve: back to the generic state
            state = state.to_recurrent()
        out_dtype = query.dtype
        path = self._recurrent_path() if state is not None else self.choose_path(lq, lk, causal)
        work = work_dtype(query.dtype)
        if state is None and query.dtype in HALF and self._half_on_triton(path, causal, query.device, query.dtype):
            # the kernels load bf16/fp16 and convert on chip: fp32 copies of q, k, v (2 bf16 query units each, kept
            # for backward) and an fp32 [v, 1] were 2 to 7 units of a bf16 layer's peak (recipes/memory_layers.py)
            work = query.dtype
        bsz = query.shape[0]
        q5 = query.to(work).reshape(bsz, self.num_kv_heads, self.groups, lq, self.head_dim)
        k5 = key.to(work).unsqueeze(2)
        v5 = value.to(work).unsqueeze(2)
        mask = key_padding_mask
        kv0 = None
        if state is not None:
            if state.k is not None:
                k5 = torch.cat([state.k.to(work).unsqueeze(2), k5], dim=3)
                v5 = torch.cat([state.v.to(work).unsqueeze(2), v5], dim=3)
                if state.mask is not None or mask is not None:
                    old = state.mask if state.mask is not None else torch.ones(
                        bsz, state.k.shape[2], dtype=torch.bool, device=query.device)
                    new = mask if mask is not None else torch.ones(bsz, lk, dtype=torch.bool, device=query.device)
                    mask = torch.cat([old, new], dim=1)
            kv0 = state.kv

        raw = (q5, k5)  # the model's own q, k: a sliding window's exact part scores with them
        sink_q, seen = self._sink_queries(q5, key_padding_mask, lk, state)
        conv = None
        if self.config.short_conv:
            q5, k5, conv = self._short_conv(q5, k5, key_padding_mask, mask, state)
        if not self._maps_with_features(path, state):
            q5, k5 = self.kernel_inputs(q5, k5)
        q5, k5, v5 = self.path_inputs(path, q5, k5, v5)
        if state is not None and lq == 1 and self.decodes_by_step(path):
            out, new_state = self._decode_step(q5, k5, v5, mask, scale, state, key, value, raw, sink_q)
            return out.reshape(bsz, self.num_heads, 1, self.head_dim).to(out_dtype), _seeing(new_state, seen, conv)
        # half-precision models: the Triton kernels' dots take tf32 operands (fp32 accumulation)
        tf32 = True if out_dtype in HALF else None
        if path == "sparse":  # ops/sparse.py
            out, new_state = self._sparse_call(q5, k5, v5, mask, scale, state, raw, sink_q, key, value)
            out = out.reshape(bsz, self.num_heads, lq, self.head_dim).to(out_dtype)
            return out if state is None else (out, _seeing(new_state, seen, conv))
        sinks = self._window_sinks(raw[1], v5, mask, None if state is None else state.sinks, sink_q=sink_q)
        extra = {} if sinks is None else {"sinks": sinks}  # a kind's own run_path without sinks keeps its signature
        out, fk, vext, kv_end = self.run_path(path, q5, k5, v5, mask, causal, scale, kv0, raw, tf32, **extra)
        out = out.reshape(bsz, self.num_heads, lq, self.head_dim).to(out_dtype)
        if state is None:
            return out
        if kv_end is not None:  # the path computed the state after its last key itself
            return out, _seeing(RecurrentState(kv_end, None, None, None, state.length + lk), seen, conv)
        return out, _seeing(self._next_state(state, key, value, key_padding_mask, k5, v5, mask, fk, vext, path,
                                             None if sinks is None else sinks.flags), seen, conv)

    def _short_conv(self, q5: torch.Tensor, k5: torch.Tensor, query_mask: torch.Tensor | None,
                    key_mask: torch.Tensor | None, state: RecurrentState | None):
        """(q, k convolved, (their inputs, size)) with ``short_conv`` (``ops/conv.py``): q5 the call's queries, k5 the
        state's raw keys then the call's, ``query_mask`` / ``key_mask`` their padding (None: none), padded rows zeroed
        before the convolution; a state's ``conv_q`` / ``conv_k`` are the inputs before them. The queries of a
        causal call sit on its last keys, so each query's earlier queries are known only when the call has a query
        for every key or a state: other calls are refused."""
        lq, lk = q5.shape[3], k5.shape[3]
        if state is None and lq != lk:
            raise ValueError(f"short_conv={self.config.short_conv} convolves the queries of every key: it needs q_len "
                             f"== kv_len without a recurrent state (self-attention over one sequence), got {lq} and "
                             f"{lk}")
        q5, k5 = to_work(q5, k5)
        if query_mask is not None:
            q5 = q5 * query_mask[:, None, None, :, None].to(q5.dtype)
        if key_mask is not None:
            k5 = k5 * key_mask[:, None, None, :, None].to(k5.dtype)
        q_out, q_inputs = self.conv_q(q5, None if state is None else state.conv_q)
        k_out, k_inputs = self.conv_k(k5, None if state is None else state.conv_k)
        return q_out, k_out, (q_inputs, k_inputs, self.config.short_conv)

    def decode_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                    state) -> tuple[torch.Tensor, object]:
        """``forward(query, key, value, causal=True, scaling=scaling, state=state)`` for one unpadded token of a
        call its caller has checked (``HybridAttention``'s decoding step, for the whole layer): the ring's step
        straight away where it serves the state, without ``forward``'s checks of the call."""
        if query.shape[2] == 1 and ring_supported(self, state):
            scale = 1.0 / math.sqrt(self.head_dim) if scaling is None else float(scaling)
            return self._ring_decode(query, key, value, None, scale, state)
        return self(query, key, value, causal=True, scaling=scaling, state=state)

    def _ring_decode(self, query, key, value, key_padding_mask, scale, state):
        """One token on a ``WindowRing`` (``ops/decode.py``): the generic step's arithmetic on buffers written in
        place; (output, the ring)."""
        bsz, work = query.shape[0], work_dtype(query.dtype)
        ring = state if isinstance(state, WindowRing) else from_recurrent(self, state, bsz, query.device, work,
                                                                          key.dtype)
        cfg = self.config
        shifted = bool(cfg.sinks) and cfg.sink_position == "window" and self.rope is not None
        if key_padding_mask is None and self.fused_decode and not self.compile_decode and fused_ready(ring):
            plan = _plan(self, work, query.device, scale)
            if plan.fused:  # one unpadded token of one sequence, the ring steady (``ops.decode.fused_step``)
                rot = None
                if shifted:  # ``window.sink_shifts``' delta from the real keys before the query (as below)
                    seen = ring.length if ring.seen is None else int(ring.seen)  # (1,): a left-padded prompt
                    delta = min(0, cfg.resolved_sink_span - seen)
                    rot = self.rope.matrix_by(delta, self.head_dim, query.device, work) if delta else None
                    if ring.seen is not None:
                        ring.seen = ring.seen + 1  # a new tensor: ``to_recurrent`` hands the ring's on
                out_dtype = query.dtype
                if out_dtype != work:
                    query, key, value = query.to(work), key.to(work), value.to(work)
                out = fused_step(self, plan, query, key, value, scale, ring, rot).view(bsz, self.num_heads, 1,
                                                                                      self.head_dim)
                return (out if out_dtype == work else out.to(out_dtype)), ring
        q5 = query.to(work).reshape(bsz, self.num_kv_heads, self.groups, 1, self.head_dim)
        if shifted and ring.at is not None:
            # a static ring (``WindowRing.make_static``): the delta from the real keys each row has seen, counted on
            # the device, so that a recorded step turns each later query by its own delta (``window.sink_shifts``)
            span = cfg.resolved_sink_span
            sink_q, seen = self.rope.rotate(q5, (span - ring.real).clamp(max=0).view(bsz, 1, 1, 1)), None
            if key_padding_mask is None:
                ring.real.add_(1)
            else:
                ring.real.add_(key_padding_mask[:, -1].long())
                ring.seen = ring.real  # rows now differ from ``length``: the count a later chunk reads
        elif key_padding_mask is None and ring.seen is None and shifted:
            # every row has seen `length` real keys: one delta for the whole batch (``window.sink_shifts``); 0, R(0)
            # the identity, until resolved_sink_span keys: the sinks then score with the query itself
            delta = min(0, cfg.resolved_sink_span - ring.length)
            sink_q, seen = (self.rope.rotate_by(q5, delta) if delta else None), None
        else:
            sink_q, seen = self._sink_queries(q5, key_padding_mask, 1, ring)
        step = compiled_ring_step() if self.compile_decode else ring_step
        # the plan is made here, outside a compiled step: its checks read data pointers, which torch.compile
        # cannot trace
        out = step(self, q5, key, value, key_padding_mask, scale, ring, sink_q, _plan(self, work, q5.device, scale))
        if seen is not None:
            ring.seen = seen
        return out.reshape(bsz, self.num_heads, 1, self.head_dim).to(query.dtype), ring

    def _sink_queries(self, q5: torch.Tensor, key_mask: torch.Tensor | None, lk: int,
                      state: RecurrentState | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the queries q5 (the model's own) re-rotated to where they score the sinks, or None; the real keys of each
        row after this call for the state, or None: every key so far was real, ``length`` counts them).

        Only with ``sinks``, ``sink_position='window'`` and a RoPE model's rotation (``rope``, set by the
        integration): query i turns by delta_i = min(0, S - p_i) (S = ``cfg.resolved_sink_span``: ``sink_span``, or
        w + s - 1), p_i the real keys before it in its row (``window.sink_shifts``; a state's ``seen`` or ``length``
        and the call's key padding mask)."""
        cfg = self.config
        if not (cfg.sinks and cfg.sink_position == "window" and self.rope is not None):
            return None, None
        seen = 0 if state is None else (state.length if state.seen is None else state.seen)
        shifts = sink_shifts(key_mask, q5.shape[3], lk, seen, cfg.resolved_sink_span, q5.device)
        sink_q = self.rope.rotate(q5, shifts[:, None, None, :])
        if state is None or (key_mask is None and state.seen is None):
            return sink_q, None
        return sink_q, seen + (lk if key_mask is None else key_mask.sum(-1))  # one of the two is a (B,) tensor

    def _half_on_triton(self, path: str, causal: bool, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether half-precision q, k, v go to this call's kernels as they are, without fp32 copies: on the
        'triton' backend the causal product and the exact local part (blocks, window) read bf16/fp16 and convert to fp32
        on load (on 'fla' FlexAttention runs the window in the half dtype with fp32 statistics and fla-core's products
        read a bf16 layer's features and values in bf16, an fp16 layer's in fp32: ``lt_multiply_fla``), while the
        feature maps and the q/k maps (``kernel_inputs``) upcast their own inputs. Only the kernel product path of this
        class (a subclass's own ``run_path`` keeps its fp32 inputs), without a recurrent state, causal or with a window
        (the bidirectional product without one is a PyTorch matmul), and not the per-token cumsum. Where the product or
        the local part still falls back to PyTorch under 'auto' (over 256 feature columns, head dims over 128, squared
        coefficient polynomials) they upcast there."""
        cfg = self.config
        return (path == "linear" and self.feature_map is not None and (causal or bool(cfg.window))
                and cfg.causal_algorithm != "cumsum" and not cfg.short_conv  # the convolution computes in fp32
                and type(self).run_path is PolyAttention.run_path
                and type(self).path_inputs is PolyAttention.path_inputs
                and resolve_backend(self._layer_backend(device, dtype), device) in ("triton", "fla"))

    def _layer_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        """The backend of this layer's products and exact window on ``device`` for inputs of ``dtype``: 'fla' where
        it is asked for, else the config's (``flex.layer_backend``)."""
        return layer_backend(self.config, device, dtype)

    def kernel_inputs(self, q5: torch.Tensor, k5: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k as the kernel sees them: the learnable projection (feature_proj), then the q/k
        LayerNorm (qk_norm): q' = LayerNorm(q W), the calibration probe's map in PEERS.md."""
        return self.kernel_input(q5, True), self.kernel_input(k5, False)

    @property
    def _maps_inputs(self) -> bool:
        return bool(self.config.feature_proj or self.config.qk_norm)

    def kernel_input(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """One side of ``kernel_inputs``, in the working dtype (half-precision q, k of the Triton path upcast)."""
        if not self._maps_inputs:
            return x
        (x,) = to_work(x)
        if self.config.feature_proj:
            x = self.feature_proj(x)
        if self.config.qk_norm:
            x = (self.q_norm if is_query else self.k_norm)(x)
        return x

    def _maps_with_features(self, path: str, state) -> bool:
        """Whether ``kernel_inputs`` is applied inside each side's recomputed feature map (``_linear``) instead of
        before the path: on this class's kernel product path when only the features read the mapped q, k (a
        sliding window's exact part scores the model's own q, k; block-diagonal ``local_exact`` blocks read the
        mapped ones). Recomputed, the projection's fp32 input and output (2 bf16 query units each per side) are not
        kept for backward: the bf16 polysketch + window 128 + feature_proj 64 layer peaked at 24.44 bf16 query units
        with them kept, 16.19 without (n = 1024, H = 4, counted storages on a 2-core CPU, recipes/memory_layers.py)."""
        cfg = self.config
        return (self._maps_inputs and state is None and path == "linear" and self.feature_map is not None
                and not cfg.short_conv  # the convolution mixes rows: kernel_inputs then run once before the path
                and type(self).run_path is PolyAttention.run_path
                and type(self).path_inputs is PolyAttention.path_inputs
                and (bool(cfg.window) or cfg.resolved_local_kernel is None))

    def _feature_inputs(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        # linear maps act on raw (or LayerNorm-ed) q/k as in Katharopoulos et al.; the
        # polynomial-type and FAVOR+ maps target (s q.k)^p / exp(s q.k): sqrt(s) per side.
        return x * math.sqrt(scale) if self.feature_map.scaled_inputs else x

    @property
    def _exact_power(self) -> int:
        """p of the exact weights base^p: 2 for squared coefficient polynomials, else the degree."""
        return 2 if self.config.poly_coefficients is not None else self.config.degree

    def _exact_base(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(base, p) with weights base^p for scores x = s q.k: this config's polynomial."""
        cfg = self.config
        if cfg.poly_coefficients is not None:
            a = self.coefficients.to(x.dtype)
            acc = torch.zeros_like(x) + a[-1]
            for i in range(a.shape[0] - 2, -1, -1):
                acc = acc * x + a[i]
            return acc, self._exact_power
        if cfg.alpha != 0.0 or cfg.beta != 1.0:  # set for kind='polynomial' only (validated)
            x = (x + cfg.alpha) / cfg.beta
        return x, self._exact_power

    def _exact_kernel(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """Weights from scores x = s q.k for 'polynomial' (this config's polynomial)."""
        if kernel != "polynomial":
            raise AssertionError(kernel)
        return _int_power(*self._exact_base(x))

    def _normalise(self, num: torch.Tensor, offset: torch.Tensor | float | None = None) -> torch.Tensor:
        """num[..., :d] / (num[..., d] + offset); offset defaults to the config's denominator_offset
        (a per-row tensor when the weights were rescaled, see _quadratic)."""
        d = self.head_dim
        off = self.config.denominator_offset if offset is None else offset
        return _safe_divide(num[..., :d], num[..., d:] + off)

    def _side_features(self, x, scale, is_query, map_input=False, act=None):
        """(features, FAVOR+'s query log scale or None) of one side (queries or keys) for the kernel part.

        polysketch: the r-dim sketches (the block algorithm squares them itself, block by block:
        r(r+1)/2 features never stored); other maps hand over their features. Always computed in the working
        dtype (half-precision inputs of the Triton path upcast here, inside the recomputed part).
        ``map_input``: x is the model's own q or k, ``kernel_input`` is applied here first. ``act``: the kernels
        apply the map (``_product_activation``): the side is its input.
        """
        if map_input:
            x = self.kernel_input(x, is_query)
        if act is not None:
            return x, None
        (x,) = to_work(x)
        x = self._feature_inputs(x, scale)
        if self.feature_map.squares:
            return self.feature_map.sketch_features(x), None
        if self.feature_map.log_scaled and is_query:
            # FAVOR+ query features carry a per-row stabiliser exp(-c): cancels in the ratio,
            # but the exact softmax blocks must be put on the same scale (far_scale in _linear).
            return self.feature_map.forward_with_log_scale(x, True)
        return self.feature_map(x, is_query), None

    def _compiled_side(self, x: torch.Tensor, is_query: bool, map_input: bool, act: str | None):
        """One side of a training forward (``_linear``, where the side is otherwise recomputed in chunks) through
        ``feature_maps.compiled_activation_features`` where it is handed out (CUDA) and the map is elementwise on
        unscaled inputs (elu + 1, relu): the features, or with ``act`` (the kernels apply the map on load) the
        kernel input; the projection and q/k LayerNorm too when ``map_input``. The compiled graph differentiates
        itself. None elsewhere: the eager side. Inference keeps the eager side (nothing is recomputed there, and
        prompts of every length would each need their own graph)."""
        fm = self.feature_map
        if (not COMPILED_FEATURES or fm.activation is None or fm.scaled_inputs
                or type(self).kernel_input is not PolyAttention.kernel_input
                or type(self)._side_features is not PolyAttention._side_features):
            return None
        fn = compiled_activation_features(x.device)
        if fn is None:
            return None
        cfg = self.config
        proj = self.feature_proj.weight if map_input and cfg.feature_proj else None
        norm = (self.q_norm if is_query else self.k_norm) if map_input and cfg.qk_norm else None
        return fn(x, None if act is not None else fm.activation, proj, None if norm is None else norm.weight,
                  None if norm is None else norm.bias, 1e-5 if norm is None else norm.eps)

    def _product_activation(self, causal: bool, kv0, x: torch.Tensor) -> str | None:
        """The feature map as ``lt_product``'s ``activation`` when the causal product runs on the Triton kernels,
        which apply it as they load q and k: elu + 1 / relu features and their gradients (n x d fp32 each, 2 bf16
        query units: 8 of a bf16 linear-elu layer's 13.84 at its peak, n = 512, H = 2) never exist. None elsewhere
        (the PyTorch products read feature tensors; a window or a carried state read the features themselves)."""
        fm, cfg = self.feature_map, self.config
        if (not KERNEL_ACTIVATIONS or fm.activation is None or fm.scaled_inputs or not causal or kv0 is not None
                or cfg.window or cfg.causal_algorithm == "cumsum"):
            return None
        which = product_backend(self._layer_backend(x.device, x.dtype), x.device, x.dtype, fm.num_features)
        return fm.activation if which == "triton" else None

    def _linear(self, q5, k5, v5, mask, causal, scale, kv0, raw, tf32=None, sinks=None):
        cfg = self.config
        lq, lk = q5.shape[3], k5.shape[3]
        square = self.feature_map.squares
        # forward left kernel_inputs to the features (_maps_with_features): q5, k5 are still the model's own
        map_input = self._maps_inputs and q5 is raw[0]
        act = self._product_activation(causal, kv0, q5)
        params = [p for p in (self.parameters() if map_input else self.feature_map.parameters()) if p.requires_grad]
        sides = []
        for x, is_query in ((q5, True), (k5, False)):
            if act is not None and not map_input:  # the kernels form the features from q, k themselves
                sides.append((x, None))
            elif not (torch.is_grad_enabled() and (x.requires_grad or params)):
                sides.append(self._side_features(x, scale, is_query, map_input, act))
            elif (compiled := self._compiled_side(x, is_query, map_input, act)) is not None:
                sides.append((compiled, None))
            else:
                # Recomputed in backward, each side on its own: the feature maps' intermediates were the
                # largest thing a layer kept. Learned polysketch (r = 32, d = 64): its sketch trees'
                # activations were 7 of the 18.4 (n x H x d fp32)-sized tensors alive after a polysketch +
                # local exact forward; the features are a few thin matmuls (~3% of the layer's flops).
                # In chunks of rows (every feature map is row-wise: recurrent decoding forms them a token at a
                # time), so the recomputation's intermediates are a chunk's (``feature_chunks``).
                sides.append(rowwise_recompute(partial(self._side_features, scale=scale, is_query=is_query,
                                                       map_input=map_input, act=act),
                                               x, params, feature_chunks(x.shape[-2])))
        (fq, q_log_scale), (fk, _) = sides

        def full(x):
            return symmetric_square(x) if square else x

        # the keys' gates before the sinks leave the kernel part: a sink decays like any real key (as in decoding,
        # _next_state); being its row's first real keys, the sinks' gates multiply no kernel term either way
        logs = self.log_decays(v5, mask)
        if sinks is not None:  # the sinks are attended through their slots: the rest reads them as padding
            mask = sinks.rest(mask)
        vext = _with_normaliser(v5, mask)
        if cfg.window:
            out = self._windowed(raw[0], raw[1], fq, fk, vext, mask, causal, scale, kv0, q_log_scale, square, tf32,
                                 sinks, logs)
            return out, (fk, square), vext
        local = cfg.resolved_local_kernel
        block = cfg.block_size
        if local is not None and mask is not None and kv0 is None:
            _warn_if_misaligned_left_padding(mask, block)
        loc = far_scale = None
        if causal:
            if lq < lk:
                fq = F.pad(fq, (0, 0, lk - lq, 0))
            decay = None if logs is None else (logs, logs)
            if cfg.causal_algorithm == "cumsum":
                far = lt_multiply_cumsum(full(fq), full(fk), vext, decay=decay)
            else:
                far = lt_product(fq, fk, vext, block, local is None, square, self._layer_backend(fq.device, q5.dtype),
                                 tf32, act, decay)
            if kv0 is not None:
                far = far + read_state(full(fq), kv0, logs)
            if local is not None:
                qs = F.pad(q5, (0, 0, lk - lq, 0)) if lq < lk else q5
                if q_log_scale is not None:
                    q_log_scale = F.pad(q_log_scale, (0, 0, lk - lq, 0)) if lq < lk else q_log_scale
                loc, far_scale = self._local_exact(qs, k5, vext, mask, True, scale, local, q_log_scale, tf32)
                loc = loc[..., lk - lq :, :]
                far_scale = None if far_scale is None else far_scale[..., lk - lq :, :]
            far = far[..., lk - lq :, :]
        else:
            fq, fk = full(fq), full(fk)
            kv = torch.matmul(fk.transpose(-1, -2), vext)
            if local is None:
                far = torch.matmul(fq, kv)
            else:
                if lq != lk:
                    raise ValueError("local_exact with bidirectional attention needs q_len == kv_len "
                                     f"(self-attention), got {lq} and {lk}")
                n_pad = -(-lk // block) * block
                fqb = F.pad(fq, (0, 0, 0, n_pad - lq)).unflatten(3, (n_pad // block, block))
                fkb = F.pad(fk, (0, 0, 0, n_pad - lk)).unflatten(3, (n_pad // block, block))
                vb = F.pad(vext, (0, 0, 0, n_pad - lk)).unflatten(3, (n_pad // block, block))
                own = torch.matmul(fkb.transpose(-1, -2), vb)  # (.., nb, F, e)
                far = torch.matmul(fqb, kv.unsqueeze(3) - own).flatten(3, 4)[..., :lq, :]
                loc, far_scale = self._local_exact(q5, k5, vext, mask, False, scale, local, q_log_scale, tf32)
        out = normalised_sum(far, loc, far_scale, self.config.denominator_offset, vext.dtype)
        # with act, fk is the map's input: the state after these keys (_next_state) maps it first
        return out, (fk, square, act is not None), vext
