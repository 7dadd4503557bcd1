"""kind 'polynomial': exact polynomial attention (s q.k)^p (PolySketchFormer, arXiv:2310.01655; the thesis'
((s q.k + alpha)/beta)^p and squares of general polynomials). Algorithm: ``ops/exact.py``."""

from __future__ import annotations

from ..ops.exact import ExactPolynomialAttention
from ..ops.reference import reference_attention
from ..registry import KindSpec, register_kind
from ._kernel import KERNEL_FIELDS, local_label


def _validate(config) -> None:
    if config.poly_coefficients is None and config.degree % 2:
        raise ValueError(f"degree must be even for kind='polynomial' (got {config.degree}): odd powers go negative")
    for name in ("local_exact", "window"):
        if getattr(config, name):
            raise ValueError(f"{name} applies to the linear-time kinds (polysketch, linear, performer); "
                             "kind='polynomial' is exact everywhere already")


def _label(config) -> str:
    return ", ".join([f"p={config.degree}", *local_label(config)])


def _memory(config) -> str:
    return ("Exact polynomial attention: generation keeps tensor-power features (constant size) when they are "
            f"few enough (max_tensor_features={config.max_tensor_features}); otherwise (the quadratic path) the "
            "state keeps every key, like a softmax KV cache.")


SPEC = register_kind(KindSpec(
    name="polynomial",
    module=ExactPolynomialAttention,
    title="polynomial attention ((q.k)^p, PolySketchFormer, arXiv:2310.01655)",
    reference=reference_attention,
    linear_time=False,
    fields=("degree", "alpha", "beta", "poly_coefficients", "learn_coefficients", "exact_path", "max_tensor_features",
            *KERNEL_FIELDS),
    validate=_validate,
    label=_label,
    memory=_memory,
    bench={"polynomial-exact": dict(kind="polynomial", degree=4, exact_path="quadratic")},
))
