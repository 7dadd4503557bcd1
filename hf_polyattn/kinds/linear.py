"""kind 'linear': phi(q).phi(k) with a feature map (elu+1: Katharopoulos et al., arXiv:2006.16236; relu; the
Taylor kernel 1 + q^.k^ of seed 002; Hedgehog; any map added with ``register_feature_map``: PolyAttnConfig
checks ``feature_map`` against the registered maps)."""

from __future__ import annotations

from ..ops.attention import PolyAttention
from ..ops.feature_maps import FEATURE_MAPS, FeatureMap
from ..ops.reference import reference_attention
from ..registry import KindSpec, register_kind
from ._kernel import DECAY_FIELDS, KERNEL_FIELDS, LOCAL_FIELDS, kernel_memory, local_label


class LinearAttention(PolyAttention):
    def build_feature_map(self, dim: int, seed: int) -> FeatureMap:
        cls = FEATURE_MAPS[self.config.feature_map]
        return cls(self.num_kv_heads, dim) if cls.per_head else cls(dim)


def _label(config) -> str:
    return ", ".join([config.feature_map, *local_label(config)])


SPEC = register_kind(KindSpec(
    name="linear",
    module=LinearAttention,
    title="linear attention (Katharopoulos et al., arXiv:2006.16236)",
    reference=reference_attention,
    fields=("feature_map", *LOCAL_FIELDS, *DECAY_FIELDS, *KERNEL_FIELDS),
    label=_label,
    memory=kernel_memory,
    bench={
        "linear-elu": dict(kind="linear", feature_map="elu", block_size=256),
        "linear-window128": dict(kind="linear", feature_map="elu", window=128, block_size=256),
        # the long-context default of a retrofitted causal LM (training/pipeline.py RECOMMENDED_LONG_CONTEXT,
        # RECOMMENDED_DECAY_HORIZON) less its projection to head_dim (a d x d matmul per side; --head-dim varies)
        "linear-elu-window128-gate": dict(kind="linear", feature_map="elu", window=128, sinks=4, decay="gate",
                                          decay_horizon=256.0, window_mix=True, window_mix_init=0.01, qk_norm=True,
                                          block_size=64),
    },
))
