"""kind 'taylor': linear attention with the first-order Taylor kernel of exp, 1 + q^.k^ with L2-normalised q, k
(seed 002, "The Math behind transformers"). phi(x) = [1, x / |x|] gives <phi(q), phi(k)> = 1 + q^.k^ in [0, 2]:
non-negative without a feature map's elu, O(n d^2). The same attention as kind='linear' with feature_map='taylor',
named on its own so that attn_implementation="taylor" reaches it."""

from __future__ import annotations

from ..ops.attention import PolyAttention
from ..ops.feature_maps import TaylorFeatureMap
from ..ops.reference import reference_attention
from ..registry import KindSpec, register_kind
from ._kernel import DECAY_FIELDS, KERNEL_FIELDS, LOCAL_FIELDS, kernel_memory, local_label


class TaylorAttention(PolyAttention):
    def build_feature_map(self, dim: int, seed: int) -> TaylorFeatureMap:
        return TaylorFeatureMap(dim)


SPEC = register_kind(KindSpec(
    name="taylor",
    module=TaylorAttention,
    title="first-order Taylor linear attention (1 + q^.k^ with L2-normalised q, k; linear attention, "
          "Katharopoulos et al., arXiv:2006.16236)",
    reference=reference_attention,
    fields=(*LOCAL_FIELDS, *DECAY_FIELDS, *KERNEL_FIELDS),
    label=lambda config: ", ".join(["1 + q^.k^", *local_label(config)]),
    memory=kernel_memory,
    bench={"taylor": dict(kind="taylor", block_size=256)},
))
