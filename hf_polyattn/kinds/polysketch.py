"""kind 'polysketch': the polynomial kernel through sketches, phi(x) = (x^{(p/2)} S)^{(2)}, in linear time
(PolySketchFormer, arXiv:2310.01655); the block algorithm squares the r-dim sketches per block."""

from __future__ import annotations

from ..ops.attention import PolyAttention
from ..ops.feature_maps import PolySketchFeatureMap
from ..ops.reference import reference_attention
from ..registry import KindSpec, register_kind
from ..validation import is_power_of_two
from ._kernel import DECAY_FIELDS, KERNEL_FIELDS, LOCAL_FIELDS, kernel_memory, local_label

# polysketch builds 2p - 1 sketch factors per head (a binary tree of degree-2 products): degree 1024 took 9.7 s
# for one forward, 2**40 never returned. The paper uses p = 2, 4, 8; 64 leaves room without a hang.
MAX_SKETCH_DEGREE = 64


class PolySketchAttention(PolyAttention):
    def build_feature_map(self, dim: int, seed: int) -> PolySketchFeatureMap:
        cfg = self.config
        return PolySketchFeatureMap(self.num_kv_heads, dim, cfg.degree, cfg.sketch_size, cfg.sketch, seed)


def _validate(config) -> None:
    if config.degree < 2 or not is_power_of_two(config.degree) or config.degree > MAX_SKETCH_DEGREE:
        raise ValueError(f"degree must be a power of two in [2, {MAX_SKETCH_DEGREE}] for kind='polysketch', got "
                         f"{config.degree}")


def _label(config) -> str:
    return ", ".join([f"{config.sketch} r={config.sketch_size}, p={config.degree}", *local_label(config)])


SPEC = register_kind(KindSpec(
    name="polysketch",
    module=PolySketchAttention,
    title="PolySketch attention (sketched polynomial kernel in linear time, arXiv:2310.01655)",
    reference=reference_attention,
    fields=("degree", "sketch", "sketch_size", *LOCAL_FIELDS, *DECAY_FIELDS, *KERNEL_FIELDS),
    validate=_validate,
    label=_label,
    memory=kernel_memory,
    block_kernel="polynomial",  # the paper's mixed mode: exact (q.k)^p on the diagonal blocks
    bench={
        "polysketch-local": dict(kind="polysketch", sketch_size=32, local_exact=True, block_size=256),
        "polysketch": dict(kind="polysketch", sketch_size=32, block_size=256),
        "polysketch-cumsum": dict(kind="polysketch", sketch_size=32, causal_algorithm="cumsum"),
        # the sliding-window hybrid of the demo (exact softmax on the previous 128 keys, the kernel beyond)
        "polysketch-window128": dict(kind="polysketch", sketch_size=32, window=128, feature_proj=64, block_size=256),
    },
))
