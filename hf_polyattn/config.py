"""PolyAttnConfig: every option of every attention kind, validated in one place.

Pure Python (no torch, no transformers) so that ``hf_polyattn.ops`` and the
integration layer can both import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

KINDS = ("polynomial", "polysketch", "linear", "performer")
SKETCHES = ("gaussian", "srht", "learned")
FEATURE_MAPS = ("elu", "relu", "taylor")
LOCAL_KERNELS = ("polynomial", "softmax")
EXACT_PATHS = ("auto", "quadratic", "tensor")
CAUSAL_ALGORITHMS = ("block", "cumsum")


def _is_power_of_two(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


@dataclass
class PolyAttnConfig:
    """Settings of a polynomial / PolySketch / linear / Performer attention.

    Polynomial attention replaces exp(q.k) by (q.k)^p (PolySketchFormer, arXiv:2310.01655;
    Kacham, Mirrokni, Zhong); polysketch approximates it with phi(x) = (x^{(p/2)} S)^{(2)}
    in linear time; linear is Katharopoulos et al. (arXiv:2006.16236); performer is FAVOR+
    (Choromanski et al., arXiv:2009.14794).
    """

    kind: str = field(default="polysketch", metadata={"help": f"attention kind, one of {list(KINDS)}"})
    degree: int = field(
        default=4,
        metadata={"help": "polynomial degree p: even for 'polynomial', a power of two for 'polysketch'"},
    )
    sketch: str = field(default="gaussian", metadata={"help": f"polysketch sketch, one of {list(SKETCHES)}"})
    sketch_size: int = field(default=32, metadata={"help": "polysketch sketch size r (r(r+1)/2 features)"})
    feature_map: str = field(default="elu", metadata={"help": f"linear feature map, one of {list(FEATURE_MAPS)}"})
    num_features: int = field(default=256, metadata={"help": "performer: number of random features m"})
    local_exact: bool = field(
        default=False,
        metadata={"help": "diagonal blocks use exact attention (local_kernel), the rest stays linear"},
    )
    local_kernel: str | None = field(
        default=None,
        metadata={
            "help": "kernel of the exact diagonal blocks: 'polynomial' (degree p, the paper's mixed mode; "
            "default for polysketch) or 'softmax' (LoLCATs-style window; default for linear/performer)"
        },
    )
    block_size: int = field(default=256, metadata={"help": "block size b of the causal LT multiplication"})
    qk_norm: bool = field(default=False, metadata={"help": "learnable per-head LayerNorm on q and k"})
    alpha: float = field(default=0.0, metadata={"help": "polynomial kernel bias: ((s q.k + alpha)/beta)^p"})
    beta: float = field(default=1.0, metadata={"help": "polynomial kernel scale: ((s q.k + alpha)/beta)^p"})
    denominator_offset: float = field(
        default=0.0, metadata={"help": "added to the normaliser (the thesis' '1 +' for stability)"}
    )
    poly_coefficients: tuple[float, ...] | None = field(
        default=None,
        metadata={
            "help": "polynomial kind only: coefficients a_0..a_D of (sum_i a_i x^i)^2 "
            "(squares of general polynomials) instead of x^degree"
        },
    )
    learn_coefficients: bool = field(default=False, metadata={"help": "make poly_coefficients trainable"})
    exact_path: str = field(
        default="auto",
        metadata={"help": "polynomial kind: 'quadratic', 'tensor' (exact linear time) or 'auto'"},
    )
    max_tensor_features: int = field(
        default=4096, metadata={"help": "'auto' takes the tensor path only up to this many features"}
    )
    causal_algorithm: str = field(
        default="block", metadata={"help": "'block' (Section 3 of the paper) or 'cumsum' (per token)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the random sketches / features (per layer offset)"})

    def __post_init__(self) -> None:
        _check_choice("kind", self.kind, KINDS)
        _check_int("degree", self.degree, 1)
        if self.kind == "polynomial" and self.poly_coefficients is None and self.degree % 2:
            raise ValueError(f"degree must be even for kind='polynomial' (got {self.degree}): odd powers go negative")
        if self.kind == "polysketch" and (self.degree < 2 or not _is_power_of_two(self.degree)):
            raise ValueError(f"degree must be a power of two >= 2 for kind='polysketch', got {self.degree}")
        _check_choice("sketch", self.sketch, SKETCHES)
        _check_int("sketch_size", self.sketch_size, 1)
        _check_choice("feature_map", self.feature_map, FEATURE_MAPS)
        _check_int("num_features", self.num_features, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_tensor_features", self.max_tensor_features, 1)
        _check_int("seed", self.seed, 0)
        _check_choice("exact_path", self.exact_path, EXACT_PATHS)
        _check_choice("causal_algorithm", self.causal_algorithm, CAUSAL_ALGORITHMS)
        if not isinstance(self.local_exact, bool):
            raise ValueError(f"local_exact must be a bool, got {self.local_exact!r}")
        if self.local_kernel is not None:
            _check_choice("local_kernel", self.local_kernel, LOCAL_KERNELS)
        if self.local_exact and self.kind == "polynomial":
            raise ValueError("local_exact applies to the linear-time kinds (polysketch, linear, performer); "
                             "kind='polynomial' is exact everywhere already")
        if self.local_exact and self.causal_algorithm == "cumsum":
            raise ValueError("local_exact needs causal_algorithm='block' (the exact part lives in the diagonal blocks)")
        if self.kind != "polynomial" and (self.alpha != 0.0 or self.beta != 1.0):
            raise ValueError("alpha and beta shape the exact polynomial kernel ((s q.k + alpha)/beta)^p: "
                             "kind='polynomial' only")
        if float(self.beta) == 0.0:
            raise ValueError("beta must be non-zero")
        if self.denominator_offset < 0:
            raise ValueError(f"denominator_offset must be >= 0, got {self.denominator_offset}")
        if self.denominator_offset and (self.kind == "performer" or self.resolved_local_kernel == "softmax"):
            raise ValueError("denominator_offset is not allowed with exp-based weights (performer, softmax local "
                             "blocks): their per-query stabiliser would change its meaning")
        if self.poly_coefficients is not None:
            if self.kind != "polynomial":
                raise ValueError("poly_coefficients is only for kind='polynomial'")
            coeffs = tuple(float(c) for c in self.poly_coefficients)
            if not coeffs or all(c == 0 for c in coeffs):
                raise ValueError("poly_coefficients must hold at least one non-zero coefficient a_0..a_D")
            self.poly_coefficients = coeffs
        elif self.learn_coefficients:
            raise ValueError("learn_coefficients needs poly_coefficients (the initial a_0..a_D)")

    @property
    def resolved_local_kernel(self) -> str | None:
        """The diagonal-block kernel actually used, or None without local_exact."""
        if not self.local_exact:
            return None
        if self.local_kernel is not None:
            return self.local_kernel
        return "polynomial" if self.kind == "polysketch" else "softmax"

    @property
    def is_linear_time(self) -> bool:
        return self.kind != "polynomial"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["poly_coefficients"] is not None:
            d["poly_coefficients"] = list(d["poly_coefficients"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolyAttnConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown PolyAttnConfig fields {unknown}; allowed: {sorted(known)}")
        d = dict(d)
        if d.get("poly_coefficients") is not None:
            d["poly_coefficients"] = tuple(d["poly_coefficients"])
        return cls(**d)

    def replace(self, **changes: Any) -> PolyAttnConfig:
        return dataclasses.replace(self, **changes)
