"""The math of hf_polyattn: pure PyTorch, never imports transformers."""

from .attention import HeadLayerNorm, PolyAttention, RecurrentState, layer_seed
from .base import AttentionBase, KVCacheAttention
from .causal import lt_multiply, lt_multiply_cumsum
from .feature_maps import FEATURE_MAPS, FeatureMap, register_feature_map
from .hybrid import HybridAttention, HybridState, build_attention, softmax_attention
from .reference import reference_attention, reference_weights
from .rotary import RopeRotation
from .sketches import PolynomialSketch, symmetric_power, symmetric_square

__all__ = [
    "AttentionBase",
    "FEATURE_MAPS",
    "FeatureMap",
    "HeadLayerNorm",
    "HybridAttention",
    "HybridState",
    "KVCacheAttention",
    "PolyAttention",
    "PolynomialSketch",
    "RecurrentState",
    "RopeRotation",
    "build_attention",
    "layer_seed",
    "lt_multiply",
    "lt_multiply_cumsum",
    "reference_attention",
    "reference_weights",
    "register_feature_map",
    "softmax_attention",
    "symmetric_power",
    "symmetric_square",
]
