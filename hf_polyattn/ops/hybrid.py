"""Selective hybrid attention: a few kv heads stay exact softmax, the others run a linear-time kind.

DuoAttention (Xiao et al. 2024, arXiv:2410.10819) keeps the few "retrieval heads" of a model as full softmax
attention with a full KV cache and makes the rest cheap. ``PolyAttnConfig.softmax_heads`` names such heads as
(layer, kv_head) pairs; a layer with any of them is a :class:`HybridAttention`:

* the softmax kv heads and their G query heads each (grouped-query attention shares one kv head among G query
  heads, and its cache with them) run exact softmax attention (:func:`softmax_attention`) with the layer's
  scaling, the key padding mask and causal rows bottom-right aligned, like every kind of the library;
* the other heads run the kind: its module is built for them alone (``kernel``: its parameters exist for those
  heads only, sized from the persisted config, so a reload builds the same shapes); a layer whose every kv head is
  softmax has no kernel module at all and computes exact softmax attention only (the model's own attention);
* q, k, v are split by head in :meth:`HybridAttention.split` and the outputs merged in :meth:`HybridAttention.merge`
  (the only two places that know the head layout).

Decoding keeps a :class:`HybridState`: the softmax heads' keys and values in full (growing by one per token, like
a softmax KV cache) beside the kernel heads' own constant-size state.

Pure PyTorch: never imports transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.nn import functional as F

from ..config import PolyAttnConfig
from .base import AttentionBase, softmax_heads_of
from .common import to_work
from .sliding import sliding_window_softmax

__all__ = ["HybridAttention", "HybridState", "build_attention", "hybrid_reference", "layer_module_class",
           "softcap_refusal", "softmax_attention"]


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                      key_padding_mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Exact softmax attention (B, H, Lq, D) of q (B, H, Lq, D) over k, v (B, Hkv, Lk, D), H a multiple of Hkv.

    Causal rows are bottom-right aligned (query i at position Lk - Lq + i: a chunk after a past);
    ``key_padding_mask`` (B, Lk) bool, False = a padded key. A row that sees no key (a left-padded query) gives 0,
    as the kernel kinds' normaliser does: a NaN there would reach every later layer through 0 * NaN. Computed in
    float32 (float64 stays float64), returned in q's dtype; bf16 / fp16 on CUDA run SDPA's fused kernels in their
    own dtype, which accumulate in float32 inside (``_fused_half``). SDPA's own causal path (``is_causal``, top-left
    aligned) serves the case without padding or past; otherwise an explicit boolean mask, (B, 1, Lq, Lk) when causal
    (what transformers' own SDPA path builds for a softmax model: the exact heads cost what softmax costs).

    ``softcap`` c (Gemma 2's logit soft-capping): scores c tanh(s q.k / c), which SDPA cannot apply; computed as
    ``sliding.sliding_window_softmax`` with a window past every key (the same rows: causal bottom-right, key padding,
    0 for a row without keys), in tiles of its ``TILE`` queries: memory O(TILE Lk) per head, never Lq x Lk.
    """
    lq, lk = q.shape[2], k.shape[2]
    if softcap is not None:
        if not causal and lq != lk:
            raise ValueError(f"soft-capped softmax heads with bidirectional attention need q_len == kv_len "
                             f"(self-attention), got {lq} and {lk}")
        return sliding_window_softmax(q, k, v, window=lk + 1, causal=causal, scale=scale, softcap=softcap,
                                      key_padding_mask=key_padding_mask)
    if _fused_half(q):
        # bf16 / fp16 on CUDA: SDPA's flash and memory-efficient kernels keep fp32 accumulators and softmax statistics
        # and never form the Lq x Lk scores; with fp32 inputs and enable_gqa PyTorch 2.11 took its math path, which
        # does (the demo's model, 22 softmax kv heads, 32k-token bf16 prefill on an H200: 86 GiB peak and 1.94 s
        # against softmax SmolLM2's 1.13 GiB and 0.13 s, recipes/results/gpu_h200/model_demo). The kv heads are
        # expanded to the query heads (Lk x d each, what transformers' own SDPA path does) so no kernel is ruled out.
        groups = q.shape[1] // k.shape[1]
        qw, kw, vw = q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        gqa = False
    else:
        qw, kw, vw = to_work(q, k, v)
        gqa = q.shape[1] != k.shape[1]
    if key_padding_mask is None and (not causal or lq == lk or lq == 1):
        # one causal query after a past (a decoding step) sees every key: no mask to build
        if lq < lk and _explicit_small_query(qw):
            out = _explicit_softmax(qw, kw, vw, None, scale)
        elif _split_keys(qw, kw):
            out = _split_key_softmax(qw, kw, vw, scale)
        else:
            out = F.scaled_dot_product_attention(qw, kw, vw, is_causal=causal and lq == lk and lq > 1, scale=scale,
                                                 enable_gqa=gqa)
        return out if out.dtype == q.dtype else out.to(q.dtype)
    allowed = None
    if causal:
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)[None, None]
    if key_padding_mask is not None:
        keys = key_padding_mask[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    seen = allowed.any(-1, keepdim=True)
    # a row with no key reads every key (finite in forward and backward) and is zeroed after
    mask = allowed | ~seen
    if _explicit_small_query(qw):
        out = _explicit_softmax(qw, kw, vw, mask, scale)
    else:
        out = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.masked_fill(~seen, 0.0).to(q.dtype)


# CPU SDPA's fused kernel splits its work over (batch x query heads x query blocks): one decoding query of one
# head is one work item, and it took 1.3 ms over 4,096 keys (4.5 ms over 16,384) on the project's 2-core Xeon, where
# q @ k^T, softmax, @ v took 0.28 ms (0.46 ms); with 3 query heads SDPA was faster again (0.19 against 0.27 ms), at
# 8 queries the two met (recipes/benchmark_decode.py's model has one query head per softmax kv head)
_EXPLICIT_MAX_QUERIES = 8


def _fused_half(q: torch.Tensor) -> bool:
    """Whether the softmax heads run SDPA in q's own half precision (CUDA: ``softmax_attention``'s comment)."""
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)


def _explicit_small_query(q: torch.Tensor) -> bool:
    b, h, lq, _ = q.shape
    return q.device.type == "cpu" and b * h == 1 and lq <= _EXPLICIT_MAX_QUERIES


def _explicit_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """softmax(q k^T scale, masked) v of one sequence's one query head over its kv head (``_explicit_small_query``:
    a few queries, so the Lq x Lk scores are small); ``mask`` (1, 1, Lq, Lk) bool, every row with a True, or None
    (every key visible)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


# A decoding query over many keys of few heads: CPU SDPA splits its work by (batch x query head) only, so one
# sequence's G = 3 query heads of one kv head keep 2 threads busy for at most 2 items in turn. One kv head's keys in
# chunks of 256 as one batched product (``_split_key_softmax``) against SDPA on the project's 2-core AMD EPYC
# (caches evicted before each call; SDPA's time over the split's, recipes/results/benchmark_split_keys): 0.67x /
# 0.69x / 0.88x / 1.14x / 1.70x at 4k / 8k / 12k / 16k / 32k keys with one kv head, 0.76x / 0.98x / 1.41x / 1.51x /
# 1.90x with three (a run before it: 0.54x / 0.86x / 1.21x / 1.33x / 1.58x and 0.63x / 0.96x / 1.16x / 1.34x /
# 1.79x). From 12,288 keys on, each kv head is split.
_SPLIT_MIN_KEYS = 12288
_SPLIT_CHUNK = 256


def _split_keys(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether one query of one sequence over ``k`` runs ``_split_key_softmax`` (CPU, q (1, H, 1, d), at least
    ``_SPLIT_MIN_KEYS`` keys)."""
    b, _, lq, _ = q.shape
    return q.device.type == "cpu" and b == 1 and lq == 1 and k.shape[2] >= _SPLIT_MIN_KEYS


def _split_key_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T scale) v of one sequence's single query (q (1, Hkv G, 1, d), k, v (1, Hkv, Lk, d), float32 or
    float64) with each kv head's keys as Lk // _SPLIT_CHUNK chunks of one batched product, so both threads read
    keys: the chunks' scores (n, G, chunk), one max over all of them (exact: no rescaling between chunks), their
    weighted values summed over the chunks, the last Lk % _SPLIT_CHUNK keys as one more product. A kv head's keys
    are read as a view of its rows (the cache's buffer keeps room after them, so the heads of a layer are not one
    batch without a copy): a loop over the kv heads (1-3 per layer here)."""
    hkv, lk, d = k.shape[1], k.shape[2], k.shape[3]
    g = q.shape[1] // hkv
    chunk = _SPLIT_CHUNK
    n = lk // chunk
    main = n * chunk
    outs = []
    for h in range(hkv):
        qh = q[0, h * g : (h + 1) * g, 0]  # (G, d)
        kh, vh = k[0, h], v[0, h]  # (Lk, d) views
        x = torch.matmul(qh, kh[:main].reshape(n, chunk, d).transpose(1, 2)).mul_(scale)  # (n, G, chunk)
        # the stabiliser, detached: its gradient cancels in the softmax, and x is overwritten below
        m = x.detach().amax(dim=(0, 2)).unsqueeze(-1)  # (G, 1)
        xt = None
        if main < lk:
            xt = (qh @ kh[main:].T).mul_(scale)  # (G, Lk - main)
            m = torch.maximum(m, xt.detach().amax(-1, keepdim=True))
        w = x.sub_(m).exp_()
        num = torch.bmm(w, vh[:main].reshape(n, chunk, d)).sum(0)  # (G, d)
        den = w.sum(dim=(0, 2)).unsqueeze(-1)
        if xt is not None:
            wt = xt.sub_(m).exp_()
            num = num.addmm_(wt, vh[main:])
            den = den + wt.sum(-1, keepdim=True)
        outs.append(num / den)
    return torch.cat(outs).view(1, hkv * g, 1, d)


def _tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class HybridState:
    """Decoding state of a hybrid layer (chunked prefill, token-by-token decoding).

    ``kernel``: the kernel heads' state (their module's ``init_state()`` type, a ``RecurrentState`` for the kernel
    kinds: constant size), None when every kv head of the layer is softmax. ``k``/``v``: the softmax kv heads'
    keys and values (B, S, capacity, D), as the model gave them (no copy in another dtype), of which the first
    ``length`` positions are the tokens seen (``keys`` / ``values``); the rest is room for the next tokens, so that
    decoding writes a token in place instead of copying every key (``torch.cat`` of 22 layers' softmax heads moved
    180 MB per token at 16k tokens of SmolLM2-135M). ``mask``: (B, capacity) bool key padding of those tokens, None
    when none is padded. ``length`` counts every token.
    """

    kernel: Any
    k: torch.Tensor | None
    v: torch.Tensor | None
    mask: torch.Tensor | None
    length: int = 0
    # ``length`` as a (1,) int64 tensor on the buffers' device, set by ``make_static``: a step writes its key at it,
    # attends over the whole buffer with the positions after it masked and advances it in place, so a captured CUDA
    # graph replays every later token (``integration/graphs.py``)
    at: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.k is None else self.k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.v is None else self.v[:, :, : self.length]

    @property
    def key_mask(self) -> torch.Tensor | None:
        return None if self.mask is None else self.mask[:, : self.length]

    def nbytes(self) -> int:
        """Bytes held: the softmax heads' key/value buffers (room for the next tokens included) and mask, and the
        kernel heads' state."""
        return _tensor_bytes(self.k, self.v, self.mask) + (0 if self.kernel is None else self.kernel.nbytes())

    @property
    def steady(self) -> bool:
        """Whether later single-token steps can run static: no padded key kept, and the kernel heads' state (if
        any) a steady ``WindowRing`` (``ops/decode.py``)."""
        from .decode import WindowRing

        return (self.k is not None and self.mask is None
                and (self.kernel is None or isinstance(self.kernel, WindowRing) and self.kernel.steady))

    def make_static(self, capacity: int) -> None:
        """Buffers of ``capacity`` positions (their unused positions zero: a masked key still enters a product,
        and 0 x NaN of a never-written one would be NaN) and ``at``, with the kernel ring made static too
        (``WindowRing.make_static``). ValueError when not ``steady`` or the buffers already hold ``capacity``
        tokens or more."""
        if not self.steady:
            raise ValueError("a hybrid layer's state can be made static only without padded keys and with its kernel "
                             "heads' ring full (ops.decode.WindowRing.steady)")
        if capacity < self.length + 1:
            raise ValueError(f"capacity={capacity} must exceed the {self.length} tokens the state holds")
        if self.kernel is not None:
            self.kernel.make_static()
        if self.k.shape[2] != capacity:
            k, v = self.k, self.v
            self.k = k.new_zeros(*k.shape[:2], capacity, k.shape[3])
            self.v = v.new_zeros(*v.shape[:2], capacity, v.shape[3])
            self.k[:, :, : self.length] = k[:, :, : self.length]
            self.v[:, :, : self.length] = v[:, :, : self.length]
        else:
            self.k[:, :, self.length:].zero_()
            self.v[:, :, self.length:].zero_()
        if self.at is None:
            self.at = torch.full((1,), self.length, dtype=torch.long, device=self.k.device)

    def advance(self) -> None:
        """The Python side of one static step (``length``, the kernel ring's slot), for a step replayed from a
        graph."""
        self.length += 1
        if self.kernel is not None:
            self.kernel.advance()

    def _map(self, tensor_fn, state_fn) -> HybridState:
        def each(t):
            return None if t is None else tensor_fn(t)

        kernel = None if self.kernel is None else state_fn(self.kernel)
        return HybridState(kernel, each(self.keys), each(self.values), each(self.key_mask), self.length)

    def index_select(self, index: torch.Tensor) -> HybridState:
        """Reorder/select batch rows (beam search, num_return_sequences)."""
        return self._map(lambda t: t.index_select(0, index.to(t.device)), lambda s: s.index_select(index))

    def repeat_interleave(self, repeats: int) -> HybridState:
        return self._map(lambda t: t.repeat_interleave(repeats, dim=0), lambda s: s.repeat_interleave(repeats))


# Room made when a buffer of the softmax heads' keys grows: 1/8 of its length, at least this many tokens (copies of
# the whole buffer then happen every L/8 tokens: about 8 key copies per token amortised, against L with a cat)
_MIN_ROOM = 256


def buffer_length(tokens: int) -> int:
    """The positions of a softmax-head buffer made to hold ``tokens`` tokens while decoding: room for 1/8 more, at
    least ``_MIN_ROOM`` (what ``integration.cache.decode_memory`` counts)."""
    return tokens + max(_MIN_ROOM, tokens // 8)


def _append(buf: torch.Tensor | None, used: int, new: torch.Tensor, dim: int, in_place: bool) -> torch.Tensor:
    """``buf`` (its first ``used`` positions along ``dim`` in use) with ``new`` written after them: in place when
    ``in_place`` and there is room, else in a new buffer with room for more (``in_place``) or of the exact size (a
    recorded gradient: an in-place write would invalidate what backward needs)."""
    n = used + new.shape[dim]
    if buf is None or not in_place or buf.shape[dim] < n:
        shape = list(new.shape)
        shape[dim] = buffer_length(n) if in_place else n
        grown = new.new_empty(shape)
        if buf is not None and used:
            grown.narrow(dim, 0, used).copy_(buf.narrow(dim, 0, used))
        buf = grown
    buf.narrow(dim, used, new.shape[dim]).copy_(new)
    return buf


def _query_heads(kv_heads: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """The query heads of ``kv_heads``: query head i reads kv head i // groups (transformers' repeat_kv layout)."""
    return tuple(h * groups + g for h in kv_heads for g in range(groups))


class HybridAttention(AttentionBase):
    """One layer with some kv heads exact softmax and the others running the config's kind (module docstring).

    Built as ``HybridAttention(config, num_heads, head_dim, num_kv_heads, layer_idx)`` for a layer in which
    ``config.softmax_heads`` names at least one kv head (``build_attention`` picks the class); called like every
    kind's module. ``kernel`` is the kind's module for the other heads, or None when every kv head is softmax.
    """

    runs_softmax_heads = True

    def __init__(self, config: PolyAttnConfig, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 layer_idx: int = 0):
        super().__init__(config, num_heads, head_dim, num_kv_heads, layer_idx)
        soft = softmax_heads_of(config, layer_idx)
        if not soft:
            raise ValueError(f"HybridAttention needs softmax heads in layer {layer_idx}, and config.softmax_heads "
                             "names none there: build the kind's own module (hf_polyattn.ops.build_attention)")
        if soft[-1] >= self.num_kv_heads:
            raise ValueError(f"softmax_heads names kv head {soft[-1]} of layer {layer_idx}, which has "
                             f"{self.num_kv_heads} kv heads (0..{self.num_kv_heads - 1})")
        g = self.groups
        self.softmax_kv_heads = soft
        self.kernel_kv_heads = tuple(h for h in range(self.num_kv_heads) if h not in soft)
        self.softmax_query_heads = _query_heads(soft, g)
        self.kernel_query_heads = _query_heads(self.kernel_kv_heads, g)
        self.kernel = None
        if self.kernel_kv_heads:
            n = len(self.kernel_kv_heads)
            self.kernel = config.spec.module_class()(config.replace(softmax_heads=None), n * g, head_dim, n,
                                                     layer_idx)
        order = self.softmax_query_heads + self.kernel_query_heads
        self._heads = {"softmax_q": self.softmax_query_heads, "softmax_kv": soft,
                       "kernel_q": self.kernel_query_heads, "kernel_kv": self.kernel_kv_heads,
                       "merge": tuple(order.index(h) for h in range(num_heads))}
        self._indices: dict[tuple[str, torch.device], torch.Tensor] = {}
        # softmax heads at one end of the layer's kv heads (13 of the demo's 14 hybrid layers): a decoding step
        # splits the heads as views and merges them with one cat, 8 dispatched operations fewer than the index
        # selects and the merge's reordering (``split`` / ``merge``); None: the heads interleave
        self._softmax_first = None
        if self.kernel_kv_heads and (soft[0] == 0 or soft[-1] == self.num_kv_heads - 1) \
                and soft == tuple(range(soft[0], soft[0] + len(soft))):
            self._softmax_first = soft[0] == 0

    @property
    def num_features(self) -> int:
        return 0 if self.kernel is None else self.kernel.num_features

    @property
    def rope(self):
        """The model's RoPE (``AttentionBase.rope``); setting it sets the kind's module's too, whose sinks read it."""
        return self.__dict__.get("_rope")

    @rope.setter
    def rope(self, value) -> None:
        self.__dict__["_rope"] = value
        kernel = self._modules.get("kernel")
        if kernel is not None:
            kernel.rope = value

    @property
    def softcap(self) -> float | None:
        """``AttentionBase.softcap``; setting it sets the kind's module's too (its exact parts apply it)."""
        return self.__dict__["_softcap"]

    @softcap.setter
    def softcap(self, value) -> None:
        AttentionBase.softcap.fset(self, value)  # refuses what the layer as a whole cannot honour
        kernel = self._modules.get("kernel")
        if kernel is not None:
            # checked above for the layer: its softmax heads are an exact part even where the kernel heads have none
            kernel.__dict__["_softcap"] = self.softcap

    @classmethod
    def softcap_refusal(cls, config: PolyAttnConfig, layer_idx: int, num_kv_heads: int,
                        exact_elsewhere: bool = False) -> str | None:
        """Every kv head softmax: every score is formed and capped. Else the kind's answer for its heads, whose
        layer has an exact part in the softmax heads."""
        soft = softmax_heads_of(config, layer_idx)
        if len(soft) >= num_kv_heads:
            return None
        return config.spec.module_class().softcap_refusal(config.replace(softmax_heads=None), layer_idx,
                                                          num_kv_heads - len(soft), exact_elsewhere=True)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.kernel is not None:  # the only holder of tensors
            self.kernel.reset_parameters()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, softmax_kv_heads={list(self.softmax_kv_heads)}"

    def init_state(self) -> HybridState:
        return HybridState(None if self.kernel is None else self.kernel.init_state(), None, None, None, 0)

    def index(self, part: str, device: torch.device) -> torch.Tensor:
        """The head indices ``part`` ('softmax_q', 'softmax_kv', 'kernel_q', 'kernel_kv', 'merge') on ``device``,
        made once per device (a host-to-device copy per layer and token otherwise)."""
        key = (part, torch.device(device))
        if key not in self._indices:
            with torch.inference_mode(False):  # kept for later calls, which may record gradients
                self._indices[key] = torch.tensor(self._heads[part], dtype=torch.long, device=device)
        return self._indices[key]

    def split(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """((q, k, v) of the softmax heads, (q, k, v) of the kernel heads or None without a kernel module)."""
        if self.kernel is None:
            return (query, key, value), None
        if self._softmax_first is not None and query.shape[2] == 1:
            g, ns, nk = self.groups, len(self.softmax_kv_heads), len(self.kernel_kv_heads)
            at_s, at_k = (0, ns) if self._softmax_first else (nk, 0)

            def views(at: int, n: int):
                return query.narrow(1, at * g, n * g), key.narrow(1, at, n), value.narrow(1, at, n)

            return views(at_s, ns), views(at_k, nk)
        dev = query.device

        def heads(part: str):
            q_idx, kv_idx = self.index(f"{part}_q", dev), self.index(f"{part}_kv", dev)
            return query.index_select(1, q_idx), key.index_select(1, kv_idx), value.index_select(1, kv_idx)

        return heads("softmax"), heads("kernel")

    def merge(self, exact: torch.Tensor, kernel: torch.Tensor | None) -> torch.Tensor:
        """The layer's (B, H, Lq, D) output in head order from the softmax heads' and the kernel heads' outputs."""
        if kernel is None:
            return exact
        if kernel.dtype != exact.dtype:
            kernel = kernel.to(exact.dtype)
        if self._softmax_first is not None and exact.shape[2] == 1:  # ``split``'s views
            return torch.cat([exact, kernel] if self._softmax_first else [kernel, exact], dim=1)
        return torch.cat([exact, kernel], dim=1).index_select(1, self.index("merge", exact.device))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                scaling: float | None = None, key_padding_mask: torch.Tensor | None = None,
                state: HybridState | None = None):
        """(B, H, Lq, D) in the query's dtype; with ``state`` (causal only, the next Lq tokens) (output, new state)."""
        _, lk = self.check_call(query, key, value, key_padding_mask, causal, state)
        if state is not None and not isinstance(state, HybridState):
            raise TypeError(f"state must be a HybridState (this layer's init_state()), got {type(state).__name__}")
        scale = 1.0 / math.sqrt(self.head_dim) if scaling is None else float(scaling)
        if (state is not None and state.at is None and lk == 1 and key_padding_mask is None and state.mask is None
                and state.k is not None and state.length < state.k.shape[2] and not torch.is_grad_enabled()
                and (self.kernel is None or self._softmax_first is not None)):
            return self._decode_step(query, key, value, scaling, scale, state)
        if state is not None and state.at is not None:
            if (lk == 1 and key_padding_mask is None and not torch.is_grad_enabled()
                    and state.length < state.k.shape[2]):
                return self._static_step(query, key, value, scaling, scale, state)
            state = replace(state, at=None)  # a call a static step does not serve: the buffers as they are
        (qs, ks, vs), kernel_inputs = self.split(query, key, value)
        mask = key_padding_mask
        new_state = None
        if state is not None:
            # decoding writes into the state's buffers, never while a gradient is recorded: the attention of an
            # earlier call saved a view of them for its backward
            in_place = not torch.is_grad_enabled()
            past, b = state.length, query.shape[0]
            k_buf, v_buf = _append(state.k, past, ks, 2, in_place), _append(state.v, past, vs, 2, in_place)
            m_buf = state.mask
            if m_buf is not None or mask is not None:
                new = mask if mask is not None else torch.ones(b, lk, dtype=torch.bool, device=query.device)
                if m_buf is None:
                    m_buf = torch.ones(b, past, dtype=torch.bool, device=query.device)
                m_buf = _append(m_buf, past, new, 1, in_place)
            new_state = HybridState(None, k_buf, v_buf, m_buf, past + lk)
            ks, vs, mask = new_state.keys, new_state.values, new_state.key_mask
        exact = softmax_attention(qs, ks, vs, causal=causal, scale=scale, key_padding_mask=mask, softcap=self.softcap)
        kernel_out = kernel_state = None
        if kernel_inputs is not None:
            call = dict(causal=causal, scaling=scaling, key_padding_mask=key_padding_mask)
            if state is None:
                kernel_out = self.kernel(*kernel_inputs, **call)
            else:
                kernel_out, kernel_state = self.kernel(*kernel_inputs, **call, state=state.kernel)
        out = self.merge(exact, kernel_out)
        if state is None:
            return out
        new_state.kernel = kernel_state
        return out, new_state

    def _decode_step(self, query, key, value, scaling, scale: float, state: HybridState):
        """One unpadded token after unpadded ones, no gradient recorded, room in the softmax heads' buffers and the
        heads split as views (``split``): ``forward``'s decoding arithmetic with its branches decided, the kernel
        heads' step without their module's call checks (``PolyAttention.decode_step``: this call was checked for
        the whole layer); (output, new state)."""
        (qs, ks, vs), kernel_inputs = self.split(query, key, value)
        past = state.length
        state.k.narrow(2, past, 1).copy_(ks)  # ``_append`` in place
        state.v.narrow(2, past, 1).copy_(vs)
        exact = softmax_attention(qs, state.k.narrow(2, 0, past + 1), state.v.narrow(2, 0, past + 1), causal=True,
                                  scale=scale, softcap=self.softcap)
        kernel_out = kernel_state = None
        if kernel_inputs is not None:
            step = getattr(self.kernel, "decode_step", None)
            if step is None:
                kernel_out, kernel_state = self.kernel(*kernel_inputs, causal=True, scaling=scaling,
                                                       state=state.kernel)
            else:
                kernel_out, kernel_state = step(*kernel_inputs, scaling, state.kernel)
        return self.merge(exact, kernel_out), HybridState(kernel_state, state.k, state.v, None, past + 1)

    def _static_step(self, query, key, value, scaling, scale: float, state: HybridState):
        """One token on a static state (``HybridState.make_static``): the softmax heads' key and value written at
        ``state.at``, their attention over the whole buffer with the positions after it masked (no Python value
        read from a tensor, none that changes between steps: a CUDA graph can record it); (output, new state)."""
        (qs, ks, vs), kernel_inputs = self.split(query, key, value)
        at, n = state.at, state.k.shape[2]
        state.k.index_copy_(2, at, ks)
        state.v.index_copy_(2, at, vs)
        seen = (torch.arange(n, device=at.device) <= at).expand(query.shape[0], n)
        exact = softmax_attention(qs, state.k, state.v, causal=True, scale=scale, key_padding_mask=seen,
                                  softcap=self.softcap)
        at.add_(1)
        kernel_out = kernel_state = None
        if kernel_inputs is not None:
            kernel_out, kernel_state = self.kernel(*kernel_inputs, causal=True, scaling=scaling, state=state.kernel)
        return self.merge(exact, kernel_out), HybridState(kernel_state, state.k, state.v, None, state.length + 1, at)


def layer_module_class(config: PolyAttnConfig, layer_idx: int) -> type:
    """The module class of layer ``layer_idx``: :class:`HybridAttention` where ``config.softmax_heads`` names any of
    its kv heads, the kind's own module otherwise."""
    return HybridAttention if softmax_heads_of(config, layer_idx) else config.spec.module_class()


def softcap_refusal(config: PolyAttnConfig, layer_idx: int, num_kv_heads: int) -> str | None:
    """Why layer ``layer_idx`` (``num_kv_heads`` kv heads) built for ``config`` cannot honour a logit soft-cap, or
    None when it can (``AttentionBase.softcap_refusal`` of its module class): asked before anything is built."""
    return layer_module_class(config, layer_idx).softcap_refusal(config, layer_idx, num_kv_heads)


def build_attention(config: PolyAttnConfig, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                    layer_idx: int = 0) -> AttentionBase:
    """The attention module of one layer for ``config`` (hybrid where it names softmax heads of the layer)."""
    return layer_module_class(config, layer_idx)(config, num_heads, head_dim, num_kv_heads, layer_idx)


def hybrid_reference(module: HybridAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     scaling: float | None = None, key_padding_mask: torch.Tensor | None = None,
                     calls: list[int] | None = None) -> torch.Tensor:
    """Naive definition of a hybrid layer, one query head at a time (B, H, Lq, D).

    A query head h whose kv head h // G is softmax: exp(x - max) over the keys it may see (causal bottom-right,
    key padding), normalised, x = s q.k soft-capped to c tanh(x / c) with the layer's ``softcap`` c; 0 for a row
    that sees none. The other heads: the kind's own reference
    (``KindSpec.reference``) on ``module.kernel`` with those heads' q, k, v gathered head by head (and ``calls``,
    the queries of each call, when given: ``sparse_observe``'s call boundaries).
    """
    s = 1.0 / math.sqrt(module.head_dim) if scaling is None else float(scaling)
    g = module.groups
    lq, lk = q.shape[2], k.shape[2]
    pos_q = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    keep = (torch.arange(lk, device=q.device)[None, :] <= pos_q) if causal else torch.ones(lq, lk, dtype=torch.bool)
    keep = keep[None].to(q.device)
    if key_padding_mask is not None:
        keep = keep & key_padding_mask[:, None, :]
    kernel_heads = [h for h in range(module.num_kv_heads) if h not in module.softmax_kv_heads]
    kernel_out = None
    if kernel_heads:
        reference = module.kernel.config.spec.reference_function()
        qk = torch.cat([q[:, h * g:(h + 1) * g] for h in kernel_heads], dim=1)
        kk = torch.cat([k[:, h:h + 1] for h in kernel_heads], dim=1)
        vk = torch.cat([v[:, h:h + 1] for h in kernel_heads], dim=1)
        kernel_out = reference(module.kernel, qk, kk, vk, causal=causal, scaling=scaling,
                               key_padding_mask=key_padding_mask, **({} if calls is None else {"calls": calls}))
    outs = []
    for hq in range(module.num_heads):
        h = hq // g
        if h in kernel_heads:
            outs.append(kernel_out[:, kernel_heads.index(h) * g + hq % g])
            continue
        x = (q[:, hq] @ k[:, h].transpose(-1, -2)) * s  # (B, Lq, Lk)
        if module.softcap is not None:
            x = module.softcap * torch.tanh(x / module.softcap)
        top = torch.where(keep, x, torch.full_like(x, -math.inf)).amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = torch.where(keep, torch.exp(torch.where(keep, x, top) - top), torch.zeros_like(x))
        den = w.sum(-1, keepdim=True)
        num = w @ v[:, h]
        outs.append(torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num)))
    return torch.stack(outs, dim=1)
