"""kind 'performer': FAVOR+ positive orthogonal random features for exp(q.k) (Choromanski et al.,
arXiv:2009.14794)."""

from __future__ import annotations

from ..ops.attention import PolyAttention
from ..ops.feature_maps import PerformerFeatureMap
from ..ops.reference import reference_attention
from ..registry import KindSpec, register_kind
from ._kernel import DECAY_FIELDS, KERNEL_FIELDS, LOCAL_FIELDS, kernel_memory, local_label


class PerformerAttention(PolyAttention):
    def build_feature_map(self, dim: int, seed: int) -> PerformerFeatureMap:
        return PerformerFeatureMap(self.num_kv_heads, dim, self.config.num_features, seed)


def _validate(config) -> None:
    if config.denominator_offset:
        raise ValueError("denominator_offset is not allowed with exp-based weights (performer, softmax local "
                         "blocks): their per-query stabiliser would change its meaning")


def _label(config) -> str:
    return ", ".join([f"{config.num_features} features", *local_label(config)])


SPEC = register_kind(KindSpec(
    name="performer",
    module=PerformerAttention,
    title="Performer FAVOR+ attention (Choromanski et al., arXiv:2009.14794)",
    reference=reference_attention,
    fields=("num_features", *LOCAL_FIELDS, *DECAY_FIELDS, *KERNEL_FIELDS),
    validate=_validate,
    label=_label,
    memory=kernel_memory,
    bench={"performer": dict(kind="performer", num_features=256, block_size=256)},
))
