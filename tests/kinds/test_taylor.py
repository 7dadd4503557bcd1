"""kind 'taylor' (seed 002's first-order Taylor kernel by name) is the linear kind with feature_map='taylor'."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, reference_attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("opts", [{}, {"window": 3}, {"local_exact": True, "block_size": 4}])
def test_taylor_kind_is_linear_with_the_taylor_map(causal, opts):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 11, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    by_name = PolyAttention(PolyAttnConfig(kind="taylor", **opts), 4, 8, 2)
    linear = PolyAttention(PolyAttnConfig(kind="linear", feature_map="taylor", **opts), 4, 8, 2)
    out = by_name(q, k, v, causal=causal)
    torch.testing.assert_close(out, linear(q, k, v, causal=causal), rtol=0, atol=0)
    torch.testing.assert_close(out, reference_attention(by_name, q, k, v, causal=causal), rtol=1e-10, atol=1e-12)


def test_taylor_weights_are_one_plus_normalised_dot():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 5, 8, generator=gen), torch.randn(1, 1, 7, 8, generator=gen)
    mod = PolyAttention(PolyAttnConfig(kind="taylor"), 1, 8)
    fq, fk = mod.feature_map(q, True), mod.feature_map(k, False)
    want = 1 + torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(k, dim=-1).transpose(-1, -2)
    torch.testing.assert_close(fq @ fk.transpose(-1, -2), want, rtol=1e-5, atol=1e-6)


def test_taylor_refuses_a_feature_map():
    with pytest.raises(ValueError, match="kind='taylor' does not read feature_map"):
        PolyAttnConfig(kind="taylor", feature_map="relu")
