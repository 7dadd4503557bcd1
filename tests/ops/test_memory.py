"""Peak memory of one attention layer's forward + backward, counted on the CPU by tensor storages.

``PeakLive`` (hf_polyattn/live_memory.py) adds up the bytes of every storage created inside it while they are alive
(a weak reference frees them): what an allocator would hold at least, on any device. The bounds are in units of one
tensor shaped like the query (B, H, n, d) in the layer's dtype, so they barely depend on n.
"""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.live_memory import PeakLive
from hf_polyattn.ops import PolyAttention


def _peak_units(opts: dict, n: int, heads: int = 4, kv_heads: int = 2, d: int = 32) -> float:
    pa = PolyAttention(PolyAttnConfig(block_size=64, **opts), heads, d, kv_heads)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, n, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, d, generator=gen, requires_grad=True) for _ in range(2))
    tracker = PeakLive()
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
    tracker = PeakLive()
    with tracker:
        a, b, c = (torch.ones(2**18) for _ in range(3))
        del a
        d = torch.ones(2**18)
    assert tracker.peak == 3 * 2**20 and tracker.live == 3 * 2**20
    del b, c, d
    assert tracker.live == 0


def test_tracker_skips_storages_made_outside():
    """Views and in-place results of a tensor made before own no new memory; a copy of it does (1 MiB)."""
    x = torch.ones(2**18)
    tracker = PeakLive(top=2)
    with tracker:
        y = x.view(2, -1)[1:]
        x.add_(1.0)
        z = x.clone()
    assert tracker.peak == 2**20 and [a.op for a in tracker.at_peak] == ["aten.clone.default"]
    del y, z
