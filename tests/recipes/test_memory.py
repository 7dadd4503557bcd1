"""Peak memory of one attention layer's forward + backward, counted on the CPU by tensor storages.

``PeakLive`` (recipes/live_memory.py) adds up the bytes of every storage created inside it while they are alive
(a weak reference frees them): what an allocator would hold at least, on any device. The bounds are in units of one
tensor shaped like the query (B, H, n, d) in the layer's dtype, so they barely depend on n.
"""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention
from hf_polyattn.ops.common import rowwise_recompute
from recipes.live_memory import PeakLive, attention_peak, layer_config
from tests.ops.test_memory import _learned_side, triton_only


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


@triton_only
@pytest.mark.parametrize("layer", ["polysketch-local", "polysketch", "linear-elu", "performer", "polysketch-window128"])
def test_bf16_triton_inputs_stay_half(layer, monkeypatch):
    """The bf16 layer with q, k, v handed to the kernels in bf16 gives the output it gave with the fp32 copies, to
    the bit (the kernels convert on load, the feature maps upcast their own inputs), and its gradients up to bf16
    rounding (where two parts of the layer add their bf16 gradients of one input)."""
    cfg = layer_config(layer, **(dict(num_features=32) if layer == "performer" else {}))
    gen = torch.Generator().manual_seed(8)
    mod = cfg.spec.module_class()(cfg, 2, 64)
    with torch.no_grad():  # a trained layer: learned sketches and projections away from their identity start
        for p in mod.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    mod = mod.to(torch.bfloat16)
    x = [torch.randn(1, 2, 320, 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    g = torch.randn(1, 2, 320, 64, generator=gen).to(torch.bfloat16)
    results = []
    for keep_half in (True, False):
        monkeypatch.setattr(type(mod), "_half_on_triton", lambda self, *a, keep=keep_half: keep)
        xs = [t.clone().requires_grad_() for t in x]
        out = mod(*xs, causal=True)
        results.append((out, torch.autograd.grad(out, xs, g)))
    (out, grads), (out_fp32, grads_fp32) = results
    assert out.dtype == torch.bfloat16 and torch.equal(out, out_fp32)
    for a, b in zip(grads, grads_fp32):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b.float()).norm() <= 2**-7 * b.float().norm()


def test_rowwise_recompute_holds_a_chunk_of_intermediates():
    """Forward + backward of a learned sketch side (n = 4096, r = d = 64, fp32): in 4 chunks its peak is under 0.6x
    the one-chunk peak (torch.utils.checkpoint's: every row's intermediates at once)."""
    sk, fn = _learned_side(torch.float32, heads=2, d=64, r=64)
    x = torch.randn(1, 2, 1, 4096, 64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    peaks = {}
    for chunks in (1, 4):
        tracker = PeakLive()
        with tracker:
            rowwise_recompute(fn, x, list(sk.parameters()), chunks)[0].sum().backward()
        peaks[chunks] = tracker.peak
    assert peaks[4] <= 0.6 * peaks[1], peaks


def test_sdpa_count_is_its_outputs():
    """The reference of the bounds below: SDPA (bf16, causal, forward + backward) holds its output, dq, dk, dv and
    the fp32 logsumexp, 4 + 1/32 bf16 query units (inputs made outside)."""
    tracker, unit = attention_peak(None, 512, 2)
    assert 4.031 <= tracker.peak / unit <= 4.032, tracker.peak / unit


BF16_BOUNDS = {
    "polysketch-local": (512, 2, 15.0),
    "polysketch": (512, 2, 9.0),
    "linear-elu": (512, 2, 8.06),  # 2 x SDPA's 4.03: issue 11's memory target (test_bf16_linear_elu_...)
    "performer": (512, 2, 38.0),
    "polysketch-window128": (512, 2, 12.2),
}


@triton_only
@pytest.mark.parametrize("layer", [pytest.param(k, marks=pytest.mark.slow(seconds=93)) if k == "performer"
                                   else k for k in BF16_BOUNDS])
def test_bf16_triton_layer_peak(layer):
    """Issue 11's layers as a bf16 model builds them (module.to(bf16), bf16 q, k, v, backend='triton', block 256,
    r = 32, d = 64, causal), forward + backward in Triton's interpreter, peak in bf16 query units (n = 512, H = 2;
    SDPA: 4.03). Counted on a 2-core CPU, before the memory work -> after it -> with the kernels' gradients stored
    in their inputs' dtype and the state chunk rule -> with elu + 1 applied in the kernels and no fp32 copy of a
    bf16 incoming gradient in normalised_sum -> with the features recomputed in chunks of rows (2 here, 4 from
    n = 1024) and the normalised sum formed in its numerator's columns: polysketch-local 22.71 -> 15.69 -> 15.69
    -> 15.69 -> 14.13, polysketch 20.10 -> 12.19 -> 11.18 -> 9.18 -> 8.15, linear-elu 22.10 -> 15.87 -> 13.84 ->
    7.84 -> 7.84, performer 49.03 -> 39.11 -> 37.08 -> 37.08 -> 37.08, polysketch-window128 26.76 -> 16.19 ->
    13.21 -> 13.21 -> 11.39 (gone: fp32 copies of q, k, v and [v, 1], the normalisation's autograd temporaries,
    the feature projection kept for backward, FAVOR+'s second n x m copy, fp32 gradient buffers, linear's n x d
    feature tensors and their gradients, every row's feature intermediates at once, n x (d + 1) sums, the row
    sums' n x d temporary). The bounds sit about 0.8 units above these counts, linear-elu's at 2x SDPA
    (recipes/memory_layers.py lists the largest storages at each peak)."""
    n, heads, bound = BF16_BOUNDS[layer]
    tracker, unit = attention_peak(layer_config(layer), n, heads)
    assert tracker.peak / unit <= bound, tracker.peak / unit


@triton_only
def test_bf16_linear_elu_within_twice_sdpa():
    """Issue 11's memory target, met by the bf16 linear elu+1 layer on the Triton kernels (raw q, k in, elu + 1
    applied on load): its counted peak at most 2x SDPA's in the same run (7.84 vs 4.03 units at n = 512, H = 2;
    the chunk states, 2 F / T = 2 units at T = 64 for n >> T, are 1.75 of them here)."""
    sdpa, _ = attention_peak(None, 512, 2)
    lin, _ = attention_peak(layer_config("linear-elu"), 512, 2)
    assert lin.peak <= 2 * sdpa.peak, (lin.peak, sdpa.peak)
