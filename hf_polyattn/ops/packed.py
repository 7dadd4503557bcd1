"""One sequence's kernel-head state in fixed-size buffers: what a serving engine keeps per request.

A serving engine (vLLM's state layers, ``serving/vllm``) allocates every request's state up front, as a few tensors
of fixed shapes per layer, and hands the layer the slot of each request. ``RecurrentState`` (``state.py``) is what
the kinds' modules read and return between calls; for a windowed kernel layer it holds, per sequence:

* ``kv`` (1, H, 1, F, D + 1): the folded keys' sum of phi(k)^T [v 1] (None until the first key is folded);
* ``k`` / ``v`` (1, H, n, D): the n <= ``keys`` raw keys not folded yet (the window, or an incomplete block);
* ``sink_k`` / ``sink_v`` (1, H, S, D), ``sink_mask`` (1, S): the sinks (None until the first key leaves the
  window);
* ``length``: the keys seen.

``PackedLayout`` names the buffers (``shapes`` / ``dtypes``: what the engine allocates), ``pack`` writes a state
into one slot's buffers and ``unpack`` reads it back: ``unpack(pack(s)) == s``, tested field by field, and a module
called on the unpacked state gives the outputs it gives on the original (``tests/ops/test_packed.py``). The
buffers hold ``heads`` kv heads, the most any layer's kernel part has, so that every layer of a model shares one
layout (an engine pads its state pages to one size); a layer with fewer uses the first ones.

A state with anything else (a padded key's mask, per-row ``seen``, a short convolution's or a sparse cache's
tensors) is refused by name: those need buffers this layout does not have (a sparse cache is packed as a ring).

``RingLayout`` packs the other form of the same state, the ``WindowRing`` (``decode.py``) a windowed layer decodes
on: its buffers are fixed-size already, so ``unpack_ring`` hands the module views of the slot (no copy) and the
decoding step writes the slot in place (on SmolLM2's layer, 3 kv heads, window 128: 0.6 ms a step on the ring
against 5.6 ms for unpack, step and pack of a ``RecurrentState``, one thread, the CPU shared with other work). A
prompt chunk runs on the ``RecurrentState`` of the ring (``WindowRing.to_recurrent``) and is packed back through
``decode.from_recurrent``: the same conversions the transformers cache makes between a prefill and decoding. A ring
with a sparse cache (``ops/sparse.py``) adds its fields as buffers of sizes the config fixes (``RingLayout``): the
cache's and the waiting block's slots, their kernel inputs and log-decays, the keys waiting, and for
``sparse_score='attention'`` the last queries and the cache's scores; such a ring steps alone, never in
``gather_rings``' batch.

Pure PyTorch: never imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..validation import check_int
from .common import work_dtype
from .decode import WindowRing, from_recurrent
from .state import RecurrentState

__all__ = ["PackedLayout", "RingLayout", "gather_rings", "pack", "pack_ring", "ring_steady", "scatter_rings", "unpack",
           "unpack_ring"]

# the fields ``pack`` writes; any other field of ``RecurrentState`` holding a tensor is refused
_PACKED_FIELDS = {"kv", "k", "v", "mask", "length", "sink_k", "sink_v", "sink_mask", "seen"}
# meta buffer: length, raw keys held, kv present, sinks present, then the S sink flags
_META = 4


class _SlotLayout:
    """What both layouts share: their fields' checks (``_sizes`` >= 1, ``sinks`` >= 0, a floating ``key_dtype``),
    the bytes of one slot and zeroed buffers; each defines ``shapes`` and ``dtypes``."""

    _sizes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in self._sizes:
            check_int(name, getattr(self, name), 1)
        check_int("sinks", self.sinks, 0)
        if not isinstance(self.key_dtype, torch.dtype) or not self.key_dtype.is_floating_point:
            raise ValueError(f"key_dtype must be a floating torch.dtype, got {self.key_dtype!r}")

    def nbytes(self) -> int:
        """Bytes of one slot."""
        return sum(torch.Size(s).numel() * torch.empty((), dtype=t).element_size()
                   for s, t in zip(self.shapes(), self.dtypes()))

    def empty(self, slots: int, device=None) -> list[torch.Tensor]:
        """Zeroed buffers for ``slots`` sequences: one tensor per entry of ``shapes``, slot first."""
        return [torch.zeros(slots, *s, dtype=t, device=device) for s, t in zip(self.shapes(), self.dtypes())]


@dataclass(frozen=True)
class PackedLayout(_SlotLayout):
    """The fixed-size buffers of one sequence's kernel-head state in one layer (module docstring).

    ``heads``: kv heads held; ``features``: F, the feature dimension of the kernel state; ``head_dim``: D;
    ``keys``: the raw keys held at most (the window, or ``block_size`` without one); ``sinks``: S; ``key_dtype``:
    the dtype of the model's keys and values (the state's kernel sum is float32 whatever it is)."""

    heads: int
    features: int
    head_dim: int
    keys: int
    sinks: int
    key_dtype: torch.dtype = torch.float32

    _sizes = ("heads", "features", "head_dim", "keys")

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-slot shapes: kv, meta, k, v, sink_k, sink_v (the order of ``dtypes``); the float32 buffers first,
        so that every buffer starts at a multiple of its element size in a packed page."""
        h, d, s = self.heads, self.head_dim, max(self.sinks, 1)
        return ((h, self.features, d + 1), (_META + s,), (h, self.keys, d), (h, self.keys, d), (h, s, d), (h, s, d))

    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.float32, *(self.key_dtype,) * 4)


    def length(self, buffers) -> int:
        """The tokens the state packed in one slot's ``buffers`` has seen."""
        return int(buffers[1][0].item())


# layout -> (shapes, dtypes): a decoding step checks its slot's buffers every token and layer, and building the
# tuples again cost 0.15 ms a check (profiled on SmolLM2's layer)
_SPECS: dict = {}


def _check_buffers(layout, buffers) -> None:
    spec = _SPECS.get(layout)
    if spec is None:
        spec = _SPECS[layout] = (layout.shapes(), layout.dtypes())
    shapes, dtypes = spec
    if len(buffers) != len(shapes):
        raise ValueError(f"buffers must be the {len(shapes)} tensors of one slot (PackedLayout.shapes), "
                         f"got {len(buffers)}")
    for i, (b, s, t) in enumerate(zip(buffers, shapes, dtypes)):
        if b.shape != s or b.dtype != t:
            raise ValueError(f"buffer {i} must be {s} {t}, got {tuple(b.shape)} {b.dtype}")


def pack(state: RecurrentState, buffers, layout: PackedLayout) -> None:
    """Write ``state`` (one sequence: batch 1, at most ``layout.heads`` kv heads) into one slot's ``buffers``."""
    _check_buffers(layout, buffers)
    if isinstance(state, WindowRing):  # a single-token call's fixed-size ring: the same state (``decode.py``)
        state = state.to_recurrent()
    if not isinstance(state, RecurrentState):
        raise TypeError(f"state must be a RecurrentState or a WindowRing, got {type(state).__name__}")
    for f in fields(state):
        if f.name not in _PACKED_FIELDS and getattr(state, f.name) is not None:
            raise ValueError(f"a packed state has no room for RecurrentState.{f.name} (a short convolution or a "
                             "sparse cache): refuse the option where the state is packed")
    for name in ("mask", "seen"):
        if getattr(state, name) is not None:
            raise ValueError(f"a packed state holds one unpadded sequence; RecurrentState.{name} is set (padding)")
    present = [t for t in (state.kv, state.k, state.sink_k) if t is not None]
    if present and present[0].shape[1] > layout.heads:
        raise ValueError(f"the state has {present[0].shape[1]} kv heads; the layout {layout.heads}")
    kv_buf, meta, k_buf, v_buf, sk_buf, sv_buf = buffers
    meta.zero_()
    meta[0] = state.length
    if state.kv is not None:
        if state.kv.dtype != torch.float32:
            raise ValueError(f"the kernel state must be float32 (its sums accumulate in float32), got {state.kv.dtype}")
        if state.kv.shape[0] != 1 or state.kv.shape[2] != 1 or tuple(state.kv.shape[3:]) != tuple(kv_buf.shape[1:]):
            raise ValueError(f"RecurrentState.kv of shape {tuple(state.kv.shape)} does not fit the layout's "
                             f"(1, H, 1, {', '.join(map(str, kv_buf.shape[1:]))})")
        heads = state.kv.shape[1]
        kv_buf[:heads].copy_(state.kv[0, :, 0])
        meta[2] = 1
    if state.k is not None:
        n = state.k.shape[2]
        if state.k.shape[0] != 1 or n > layout.keys:
            raise ValueError(f"RecurrentState.k holds {n} keys of batch {state.k.shape[0]}; the layout has room for "
                             f"{layout.keys} keys of one sequence")
        heads = state.k.shape[1]
        k_buf[:heads, :n].copy_(state.k[0])
        v_buf[:heads, :n].copy_(state.v[0])
        meta[1] = n
    if state.sink_k is not None:
        s = state.sink_k.shape[2]
        if s != layout.sinks:
            raise ValueError(f"RecurrentState.sink_k holds {s} sinks; the layout {layout.sinks}")
        heads = state.sink_k.shape[1]
        sk_buf[:heads].copy_(state.sink_k[0])
        sv_buf[:heads].copy_(state.sink_v[0])
        meta[3] = 1
        meta[_META:_META + s] = state.sink_mask[0].to(meta.dtype)


def unpack(buffers, layout: PackedLayout, heads: int) -> RecurrentState:
    """The ``RecurrentState`` of ``heads`` kv heads that ``pack`` wrote into one slot's ``buffers`` (copies: a
    module may write into the state it is given)."""
    _check_buffers(layout, buffers)
    if isinstance(heads, bool) or not isinstance(heads, int) or not 1 <= heads <= layout.heads:
        raise ValueError(f"heads must be an int in 1..{layout.heads}, got {heads!r}")
    kv_buf, meta, k_buf, v_buf, sk_buf, sv_buf = buffers
    length, n, has_kv, has_sinks = (int(x) for x in meta[:_META].tolist())
    kv = kv_buf[:heads].unsqueeze(0).unsqueeze(2).clone() if has_kv else None
    k = k_buf[:heads, :n].unsqueeze(0).clone() if n else None
    v = v_buf[:heads, :n].unsqueeze(0).clone() if n else None
    sink_k = sink_v = sink_mask = None
    if has_sinks:
        s = layout.sinks
        sink_k = sk_buf[:heads].unsqueeze(0).clone()
        sink_v = sv_buf[:heads].unsqueeze(0).clone()
        sink_mask = (meta[_META:_META + s] > 0.5).unsqueeze(0)
    return RecurrentState(kv, k, v, None, length, sink_k=sink_k, sink_v=sink_v, sink_mask=sink_mask)


# ring meta buffer: length, head, count, filled (-1: every sink filled), real_run, sink_waiting
_RING_META = 6
# the sparse cache's meta buffer: pending (the keys waiting in the block), then the C flags of q_real
_SPARSE_META = 1


@dataclass(frozen=True)
class RingLayout(_SlotLayout):
    """The fixed-size buffers of one sequence's ``WindowRing`` in one layer: ``heads`` kv heads (the most any layer's
    kernel part has), F ``features``, D ``head_dim``, the ``window`` and ``sinks`` slots, whether the layer decays
    (``decay``: the ring keeps its keys' log-gates), the model's ``key_dtype`` (the ring's own buffers are in the
    working dtype, ``common.work_dtype``: float32 for half-precision models).

    With a sparse cache (``ops/sparse.py``; ``cache`` = ``sparse_cache`` > 0): the ring's ``extra`` = cache +
    ``chunk`` (``sparse_chunk``) slots between the sinks and the window, their kernel inputs (``kernel_dim`` wide)
    and log-decays, the keys waiting in the block; with ``attention`` (``sparse_score='attention'``) the last C
    queries of the kv head's ``groups`` query heads and the cache's scores. Every one of these has a size the config
    fixes, so the ring stays a set of fixed-size buffers. ``observe`` (``sparse_observe``) changes no buffer: it
    says that the cache is chosen again at the end of every call of more than one token, which a serving engine
    must not split (a prompt in chunks is chosen again at each chunk's end: ``serving/vllm/config_hook.py``)."""

    heads: int
    features: int
    head_dim: int
    window: int
    sinks: int
    decay: bool
    key_dtype: torch.dtype = torch.float32
    cache: int = 0
    chunk: int = 0
    kernel_dim: int = 0
    groups: int = 0
    attention: bool = False
    observe: int = 0

    _sizes = ("heads", "features", "head_dim", "window")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("cache", self.cache, 0)
        if self.cache:
            for name in ("chunk", "kernel_dim") + (("groups",) if self.attention else ()):
                check_int(name, getattr(self, name), 1)
            check_int("observe", self.observe, 0)
        elif self.chunk or self.kernel_dim or self.groups or self.attention or self.observe:
            raise ValueError(f"chunk, kernel_dim, groups, attention and observe describe a sparse cache; with "
                             f"cache=0 they must be 0 / False, got chunk={self.chunk}, kernel_dim={self.kernel_dim}, "
                             f"groups={self.groups}, attention={self.attention}, observe={self.observe}")

    @property
    def extra(self) -> int:
        """The sparse cache's slots between the sinks and the window (``WindowRing.extra``)."""
        return self.cache + self.chunk if self.cache else 0

    @property
    def work(self) -> torch.dtype:
        return work_dtype(self.key_dtype)

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-slot shapes: kv, keys, vext, valid, logg, meta (all in ``work``; ``valid`` as 0 / 1); with a sparse
        cache then kin, slot_log (zero without decay, as ``logg``), the sparse meta (pending, the C ``q_real``
        flags) and, with ``attention``, q_hist and score (``WindowRing``'s fields of those names)."""
        h, d, n = self.heads, self.head_dim, self.sinks + self.extra + self.window
        shapes = ((h, self.features, d + 1), (h, n, d), (h, n, d + 1), (n,), (h, self.window), (_RING_META,))
        if self.cache:
            shapes += ((h, self.extra, self.kernel_dim), (h, self.extra), (_SPARSE_META + self.chunk,))
            if self.attention:
                shapes += ((h, self.groups, self.chunk, d), (h, self.cache))
        return shapes

    def dtypes(self) -> tuple[torch.dtype, ...]:
        # the cache's scores are promote(work, float32) in ``sparse.sparse_from_recurrent``: work itself, which is
        # float32 or wider
        return (self.work,) * len(self.shapes())

    def length(self, buffers) -> int:
        """The tokens the ring packed in one slot's ``buffers`` has seen."""
        return int(buffers[5][0].item())


def unpack_ring(buffers, layout: RingLayout, heads: int) -> WindowRing:
    """The ``WindowRing`` of ``heads`` kv heads in one slot's ``buffers``, its tensors views of the slot (a step
    writes them in place), ``valid`` a copy (``pack_ring`` writes it back); with a sparse cache ``pending`` and
    ``q_real`` copies too (a step replaces them), the other sparse fields views."""
    _check_buffers(layout, buffers)
    if isinstance(heads, bool) or not isinstance(heads, int) or not 1 <= heads <= layout.heads:
        raise ValueError(f"heads must be an int in 1..{layout.heads}, got {heads!r}")
    kv, keys, vext, valid, logg, meta = buffers[:6]
    length, head, count, filled, real_run, waiting = (int(x) for x in meta.tolist())
    sparse = {}
    if layout.cache:
        kin, slot_log, smeta = buffers[6:9]
        sparse = dict(extra=layout.extra, cache=layout.cache, kin=kin[:heads].unsqueeze(0),
                      slot_log=slot_log[:heads].unsqueeze(0) if layout.decay else None,
                      pending=smeta[:1].long())  # exact: pending < chunk, far below float32's 2 ** 24
        if layout.attention:
            q_hist, score = buffers[9:11]
            sparse.update(q_hist=q_hist[:heads].unsqueeze(0), q_real=(smeta[1:] > 0.5).unsqueeze(0),
                          score=score[:heads].unsqueeze(0))
    return WindowRing(kv[:heads].unsqueeze(0), keys[:heads].unsqueeze(0), vext[:heads].unsqueeze(0),
                      (valid > 0.5).unsqueeze(0), logg[:heads].unsqueeze(0) if layout.decay else None,
                      None if filled < 0 else torch.tensor([filled], device=kv.device), head, count, length, None,
                      layout.sinks, layout.key_dtype, real_run=real_run, sink_waiting=bool(waiting), **sparse)


def pack_ring(ring: WindowRing, buffers, layout: RingLayout) -> None:
    """Write ``ring`` (one sequence, no per-row ``seen``; a sparse cache exactly when the layout has one) into one
    slot's ``buffers``; tensors that are already the slot's views (``unpack_ring``, written in place) are not
    copied."""
    _check_buffers(layout, buffers)
    if not isinstance(ring, WindowRing):
        raise TypeError(f"ring must be a WindowRing, got {type(ring).__name__}")
    if ring.seen is not None or ring.at is not None:
        raise ValueError("a packed ring holds one unpadded sequence without a static step "
                         f"(seen set: {ring.seen is not None}, static: {ring.at is not None})")
    if ring.extra != layout.extra or ring.cache != layout.cache or (ring.q_hist is not None) != layout.attention:
        raise ValueError(f"the ring's sparse cache (extra={ring.extra}, cache={ring.cache}, attention scores: "
                         f"{ring.q_hist is not None}) is not the layout's (extra={layout.extra}, "
                         f"cache={layout.cache}, attention={layout.attention})")
    if ring.keys.shape[0] != 1 or ring.keys.shape[1] > layout.heads or ring.sinks != layout.sinks \
            or ring.window != layout.window:
        raise ValueError(f"the ring (batch {ring.keys.shape[0]}, {ring.keys.shape[1]} kv heads, {ring.sinks} sinks, "
                         f"window {ring.window}) does not fit the layout ({layout.heads} kv heads, {layout.sinks} "
                         f"sinks, window {layout.window})")
    if ring.keys.dtype != layout.work:
        raise ValueError(f"the ring's buffers are {ring.keys.dtype}, the layout's {layout.work}")
    kv, keys, vext, valid, logg, meta = buffers[:6]
    h = ring.keys.shape[1]
    pairs = [(kv, ring.kv), (keys, ring.keys), (vext, ring.vext), (logg, ring.logg)]
    if layout.cache:
        kin, slot_log, smeta = buffers[6:9]
        if ring.kin.shape[-1] != layout.kernel_dim:
            raise ValueError(f"the ring's kernel inputs are {ring.kin.shape[-1]} wide, the layout's "
                             f"{layout.kernel_dim}")
        pairs += [(kin, ring.kin), (slot_log, ring.slot_log)]
        smeta[0] = ring.pending[0]
        if layout.attention:
            q_hist, score = buffers[9:11]
            if tuple(ring.q_hist.shape[2:4]) != (layout.groups, layout.chunk):
                raise ValueError(f"the ring keeps {ring.q_hist.shape[3]} queries of {ring.q_hist.shape[2]} query "
                                 f"heads per kv head, the layout {layout.chunk} of {layout.groups}")
            pairs += [(q_hist, ring.q_hist), (score, ring.score)]
            smeta[1:].copy_(ring.q_real[0])
    for dst, src in pairs:
        if src is not None and src.data_ptr() != dst.data_ptr():
            dst[:h].copy_(src[0])
    valid.copy_(ring.valid[0])
    filled = -1 if ring.filled is None else int(ring.filled[0])
    meta.copy_(torch.tensor([ring.length, ring.head, ring.count, filled, ring.real_run, int(ring.sink_waiting)],
                            dtype=meta.dtype))


def ring_from_state(module, state, layout: RingLayout) -> WindowRing:
    """The ``WindowRing`` of a module's state after a prompt chunk (a ``RecurrentState``, or a ring already)."""
    if isinstance(state, WindowRing):
        return state
    return from_recurrent(module, state, 1, state_device(state), layout.work, layout.key_dtype)


def state_device(state: RecurrentState) -> torch.device:
    for t in state.tensors():
        return t.device
    return torch.device("cpu")


def ring_steady(meta_row: list, layout: RingLayout) -> bool:
    """Whether the ring whose meta buffer reads ``meta_row`` (``tolist()`` of it) is steady: full, every sink
    filled, no sink waiting (``WindowRing.steady``), so that its step can run in a batch with others'. A ring with a
    sparse cache never is: its selection moves keys between slots by Python indices, per request (``gather_rings``
    refuses it)."""
    if layout.cache:
        return False
    _, _, count, filled, _, waiting = meta_row[:_RING_META]
    return int(count) == layout.window and int(filled) < 0 and not int(waiting)


def gather_rings(buffers, layout: RingLayout, index: torch.Tensor, heads: int):
    """One ``WindowRing`` of batch B holding the steady rings of slots ``index`` (B,) of the layer's ``buffers``
    (every slot: (slots, ...) each), and the slot positions it was read from (for ``scatter_rings``).

    ``WindowRing`` has one ring position (``head``) for the whole batch, and each request's ring is at its own: the
    rows are read rotated so that every row's oldest key is at ring position 0 (a softmax over a set of keys does not
    depend on their order), and each row's count of real keys goes in ``seen`` (B,) (what its sinks' query shift
    reads)."""
    _no_sparse_batch(layout)
    kv, keys, vext, valid, logg, meta = buffers
    s, w = layout.sinks, layout.window
    rows = meta.index_select(0, index)
    head = rows[:, 1].long()
    ring_pos = (torch.arange(w, device=index.device)[None] + head[:, None]) % w  # (B, W): batch j <- slot pos
    pos = torch.cat([torch.arange(s, device=index.device).expand(index.shape[0], s), s + ring_pos], dim=1)

    rows_at, heads_at = index[:, None, None], torch.arange(heads, device=index.device)[None, :, None]

    def read(buf: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return buf[rows_at, heads_at, at[:, None, :]]

    ring = WindowRing(kv[index, :heads], _read_rows(keys, index, heads, pos), _read_rows(vext, index, heads, pos),
                      valid[index[:, None], pos] > 0.5, read(logg, ring_pos) if layout.decay else None,
                      None, 0, w, int(rows[:, 0].max()), rows[:, 0].long(), s, layout.key_dtype, real_run=w)
    return ring, pos


def _no_sparse_batch(layout: RingLayout) -> None:
    if layout.cache:
        raise ValueError(f"a batch of rings is read and written at the window's positions only; a ring with a sparse "
                         f"cache (cache={layout.cache}) moves keys between its cache and block slots in its own "
                         "steps: step it alone (unpack_ring / pack_ring)")


def _read_rows(buf: torch.Tensor, index: torch.Tensor, heads: int, at: torch.Tensor) -> torch.Tensor:
    """``buf[index[:, None, None], arange(heads)[None, :, None], at[:, None, :]]`` for a buffer (slots, H, n, r)
    whose rows of r are laid out whole (a layout's buffer, or one layer's entry of buffers stacked over layers):
    one ``index_select`` of rows over the storage instead of an advanced index (on SmolLM2's layer, batch 16: 0.08 ms
    against 0.32 ms a buffer, one thread); any other layout takes the advanced index."""
    r = buf.shape[-1]
    s0, s1, s2, s3 = buf.stride()
    rows_at, heads_at = index[:, None, None], torch.arange(heads, device=index.device)[None, :, None]
    if s3 != 1 or s2 != r or s0 % r or s1 % r or buf.storage_offset() % r:
        return buf[rows_at, heads_at, at[:, None, :]]
    count = (s0 * (buf.shape[0] - 1) + s1 * (buf.shape[1] - 1) + s2 * (buf.shape[2] - 1)) // r + 1
    rows = buf.as_strided((count, r), (r, 1))  # every row of the buffer's span, from its first
    flat = (rows_at * (s0 // r) + heads_at * (s1 // r) + at[:, None, :]).reshape(-1)
    return rows.index_select(0, flat).view(index.shape[0], heads, at.shape[1], r)


def scatter_rings(ring: WindowRing, buffers, layout: RingLayout, index: torch.Tensor, pos: torch.Tensor) -> None:
    """Write the batch ring of ``gather_rings`` back to its slots after one step, each row at its own rotation, and
    advance each slot's counters by the one token.

    A steady ring's step changes the state and one window position (the new key, its [v, 1], its log-gate, at the
    batch's ring position 0, where the oldest key was): only those are written, not the whole ring (on SmolLM2's
    layer, 3 kv heads, window 128, batch 16: 0.8 MB a layer instead of 4 MB)."""
    _no_sparse_batch(layout)
    kv, keys, vext, valid, logg, meta = buffers
    s, w = layout.sinks, layout.window
    heads = ring.keys.shape[1]
    if ring.head != 1 % w or ring.filled is not None:
        raise ValueError(f"scatter_rings writes a ring one step after gather_rings (ring position 1, every sink "
                         f"filled), got position {ring.head}, sinks filled {ring.filled is None}")

    at = pos[:, s]  # (B,): each row's slot position of the batch's ring position 0
    rows_at, heads_at = index[:, None], torch.arange(heads, device=index.device)[None, :]
    kv[index, :heads] = ring.kv
    keys[rows_at, heads_at, at[:, None]] = ring.keys[:, :, s]
    vext[rows_at, heads_at, at[:, None]] = ring.vext[:, :, s]
    valid[index, at] = ring.valid[:, s].to(valid.dtype)
    if layout.decay:
        logg[rows_at, heads_at, (at - s)[:, None]] = ring.logg[:, :, 0]
    m = meta.index_select(0, index)
    m[:, 0] += 1  # length
    m[:, 1] = (m[:, 1] + 1) % w  # head: the batch's ring advanced one position from each row's own
    m[:, 4] += 1  # real_run
    meta.index_copy_(0, index, m)
