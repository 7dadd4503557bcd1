"""Sketch quality (PolySketchFormer Theorem 2.5) and the non-negativity of polysketch weights."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, PolynomialSketch, symmetric_power
from hf_polyattn.ops.feature_maps import PolySketchFeatureMap


def _unit(n, d, dtype=torch.float64):
    x = torch.randn(n, d, dtype=dtype)
    return x / x.norm(dim=-1, keepdim=True)


def _pair(d=16):
    q, k = _unit(1, d), _unit(1, d)
    q = 0.6 * q + 0.8 * k  # a sizeable q.k so the target is not ~0
    return q / q.norm(), k


def _draws(degree, sketch, r, draws, q, k):
    """z(q).z(k) and phi(q).phi(k) for ``draws`` independent sketches (one per head)."""
    fm = PolySketchFeatureMap(draws, q.shape[-1], degree, sketch_size=r, sketch=sketch, seed=11).double()
    qq, kk = q.expand(draws, 1, 1, -1), k.expand(draws, 1, 1, -1)
    inner = (fm.sketch_features(qq) * fm.sketch_features(kk)).sum(-1).flatten()
    outer = (fm(qq, True) * fm(kk, False)).sum(-1).flatten()
    return inner, outer


@pytest.mark.parametrize("sketch", ["gaussian", "srht", "learned"])
@pytest.mark.parametrize("degree", [2, 4, 8])
def test_polysketch_mean_over_seeds(sketch, degree):
    """Theorem 2.5's ingredients, checked over 2000 independent sketches.

    The degree-p/2 sketch z is unbiased: mean z(q).z(k) = (q.k)^{p/2} within a 99.9% interval.
    The tensored phi = z^{(2)} is not: E[(z_q.z_k)^2] = (q.k)^p + Var(z_q.z_k), an upward bias
    of order 1/r that Theorem 2.5 bounds in Frobenius norm. So its mean must equal
    (q.k)^p + the measured variance, again within the sampling interval.
    """
    q, k = _pair()
    half = float((q @ k.T) ** (degree // 2))
    inner, outer = _draws(degree, sketch, 16, 2000, q, k)
    se_inner = inner.std().item() / math.sqrt(len(inner))
    assert abs(inner.mean().item() - half) < 3.3 * se_inner, (inner.mean().item(), half, se_inner)
    target = half**2 + inner.var().item()
    se_outer = outer.std().item() / math.sqrt(len(outer))
    assert abs(outer.mean().item() - target) < 3.3 * se_outer + 0.1 * inner.var().item(), (outer.mean(), target)
    assert (outer >= 0).all()


@pytest.mark.parametrize("sketch", ["gaussian", "srht"])
def test_polysketch_bias_shrinks_like_one_over_r(sketch):
    q, k = _pair()
    exact = float((q @ k.T) ** 4)
    bias = []
    for r in (8, 64):
        _, outer = _draws(4, sketch, r, 2000, q, k)
        bias.append(outer.mean().item() - exact)
    assert bias[0] > 0 and abs(bias[1]) < bias[0] / 3, bias


@pytest.mark.parametrize("sketch", ["gaussian", "srht"])
def test_sketch_error_falls_with_sketch_size(sketch):
    q, k = _unit(64, 32), _unit(64, 32)
    exact = (q @ k.T) ** 4
    errs = []
    for r in (4, 16, 64):
        e = []
        for seed in range(8):
            fm = PolySketchFeatureMap(1, 32, 4, sketch_size=r, sketch=sketch, seed=seed).double()
            approx = (fm(q[None, None], True) @ fm(k[None, None], False).transpose(-1, -2))[0, 0]
            e.append(((approx - exact).norm() / exact.norm()).item())
        errs.append(sum(e) / len(e))
    assert errs[0] > errs[1] > errs[2], errs


def test_polysketch_weights_nonnegative_where_plain_sketch_is_not():
    fm = PolySketchFeatureMap(1, 16, 4, sketch_size=8, seed=3).double()
    q, k = _unit(200, 16), -_unit(200, 16)  # many negative dot products
    w = fm(q[None, None], True) @ fm(k[None, None], False).transpose(-1, -2)
    assert w.min() >= 0
    zq, zk = fm.sketch_features(q[None, None]), fm.sketch_features(k[None, None])
    assert (zq @ zk.transpose(-1, -2)).min() < 0  # the untensored sketch does go negative
    # and the full attention weights of the module are non-negative too
    mod = PolyAttention(PolyAttnConfig(kind="polysketch", sketch_size=8), 1, 16).double()
    from hf_polyattn.ops import reference_weights

    ww = reference_weights(mod, q[None, None], k[None, None], causal=False)
    assert ww.min() >= 0


def test_symmetric_power_is_the_kernel():
    a, b = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    for p in (0, 1, 2, 3, 4):
        torch.testing.assert_close(
            (symmetric_power(a, p) * symmetric_power(b, p)).sum(-1), (a * b).sum(-1) ** p)
    assert symmetric_power(a, 2).shape[-1] == 7 * 8 // 2


def test_learned_sketch_starts_as_gaussian_and_trains():
    g = PolynomialSketch(2, 16, 2, 8, "gaussian", seed=5)
    lrn = PolynomialSketch(2, 16, 2, 8, "learned", seed=5)
    x = torch.randn(2, 1, 10, 16)
    torch.testing.assert_close(g(x), lrn(x))
    assert sum(p.numel() for p in lrn.parameters()) > 0 and not list(g.parameters())
    lrn(x).pow(2).sum().backward()
    assert all(p.grad is not None for p in lrn.parameters())


def test_srht_pads_non_power_of_two_dims():
    sk = PolynomialSketch(1, 24, 2, 12, "srht", seed=0)
    assert sk(torch.randn(1, 1, 3, 24)).shape == (1, 1, 3, 12)


def _fingerprint(kind, sketch, seed):
    mod = PolyAttention(PolyAttnConfig(kind=kind, sketch=sketch, seed=seed), 2, 16, layer_idx=3)
    x = torch.linspace(-1, 1, 2 * 5 * 16).reshape(1, 2, 5, 16)
    return float(mod(x, x, x, causal=True).detach().double().sum()) + sum(float(t.detach().double().sum())
                                                                 for t in mod.state_dict().values())


SEEDED = [("polysketch", "gaussian"), ("polysketch", "srht"), ("polysketch", "learned"), ("performer", "gaussian")]


def test_same_seed_same_outputs_across_processes():
    code = ("from tests.ops.test_sketches import _fingerprint, SEEDED\n"
            "print([_fingerprint(k, s, 7) for k, s in SEEDED])\n")
    root = Path(__file__).resolve().parents[2]
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert other.strip() == str([_fingerprint(k, s, 7) for k, s in SEEDED])
    assert all(_fingerprint(k, s, 8) != _fingerprint(k, s, 7) for k, s in SEEDED)


def test_layers_get_independent_sketches():
    a = PolyAttention(PolyAttnConfig(kind="polysketch"), 2, 16, layer_idx=0)
    b = PolyAttention(PolyAttnConfig(kind="polysketch"), 2, 16, layer_idx=1)
    wa, wb = a.state_dict(), b.state_dict()
    assert any(not torch.equal(wa[key], wb[key]) for key in wa)


def test_performer_redraw_is_seeded():
    mod = PolyAttention(PolyAttnConfig(kind="performer", num_features=16), 1, 8)
    w0 = mod.feature_map.omega.clone()
    mod.feature_map.redraw(seed=123)
    w1 = mod.feature_map.omega.clone()
    mod.feature_map.redraw(seed=123)
    assert not torch.equal(w0, w1) and torch.equal(w1, mod.feature_map.omega)
