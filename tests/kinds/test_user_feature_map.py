"""A feature map added with register_feature_map is a valid feature_map= choice of the linear kind (PolyAttnConfig
checked feature_map against a fixed tuple before the registry, so a registered map could never be chosen)."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import FEATURE_MAPS, FeatureMap, PolyAttention, reference_attention, register_feature_map


@pytest.fixture
def squared_map():
    @register_feature_map("test_squared")
    class SquaredFeatureMap(FeatureMap):
        """phi(x) = x^2 coordinatewise (non-negative)."""

        def __init__(self, dim: int):
            super().__init__()
            self.num_features = dim

        def forward(self, x, is_query):
            return x * x

    yield SquaredFeatureMap
    del FEATURE_MAPS["test_squared"]


def test_registered_map_is_selectable_and_used(squared_map):
    cfg = PolyAttnConfig(kind="linear", feature_map="test_squared")
    mod = PolyAttention(cfg, 4, 8, 2)
    assert isinstance(mod.feature_map, squared_map)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    for causal in (True, False):
        torch.testing.assert_close(mod(q, k, v, causal=causal), reference_attention(mod, q, k, v, causal=causal),
                                   rtol=1e-10, atol=1e-12)


def test_unknown_and_kind_built_maps_are_refused():
    with pytest.raises(ValueError, match=r"feature_map must be one of \[.*'taylor'.*\], got 'test_missing'"):
        PolyAttnConfig(kind="linear", feature_map="test_missing")
    with pytest.raises(ValueError, match="feature_map must be one of"):
        PolyAttnConfig(kind="linear", feature_map="performer")  # built by its own kind, not selectable
