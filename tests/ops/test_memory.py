"""Peak memory of one attention layer's forward + backward, counted on the CPU by tensor storages.

``_PeakLive`` adds up the bytes of every storage created inside it while they are alive (a weak reference
frees them): what an allocator would hold at least, on any device. The bound is in units of one fp32 tensor
shaped like the query (B, H, n, d), so it does not depend on n.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention


class _PeakLive(TorchDispatchMode):
    """The largest sum of live storage bytes created inside (inputs made outside are not counted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)

        def free(key=key, size=size):
            self.live -= size
            self.seen.discard(key)

        weakref.finalize(storage, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def _peak_units(opts: dict, n: int, heads: int = 4, kv_heads: int = 2, d: int = 32) -> float:
    pa = PolyAttention(PolyAttnConfig(block_size=64, **opts), heads, d, kv_heads)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, n, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, d, generator=gen, requires_grad=True) for _ in range(2))
    tracker = _PeakLive()
    with tracker:
        pa(q, k, v, causal=True).sum().backward()
    return tracker.peak / q.numel() / 4


@pytest.mark.parametrize("n", [256, 512])
def test_learned_polysketch_layer_peak(n):
    """Learned polysketch + local exact blocks (r = 16, d = 32, GQA 4/2): at most 20 query-sized fp32 tensors at
    the peak of forward + backward. With the feature maps' intermediates kept for backward it was 24.3 (n = 256)
    and 24.1 (n = 512); recomputing each side's sketches in backward (PolyAttention._linear) gives 18.0 / 17.9."""
    units = _peak_units(dict(kind="polysketch", sketch="learned", sketch_size=16, local_exact=True), n)
    assert units <= 20.0, units


def test_tracker_counts_what_is_alive():
    """The tracker itself: 3 live tensors of 1 MiB at once (the fourth made after one is freed) peak at 3 MiB."""
    tracker = _PeakLive()
    with tracker:
        a, b, c = (torch.ones(2**18) for _ in range(3))
        del a
        d = torch.ones(2**18)
    assert tracker.peak == 3 * 2**20 and tracker.live == 3 * 2**20
    del b, c, d
    assert tracker.live == 0
