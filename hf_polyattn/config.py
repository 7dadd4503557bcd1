"""PolyAttnConfig: every option of every attention kind, validated in one place.

Pure Python (no torch, no transformers) so that ``hf_polyattn.ops`` and the
integration layer can both import it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

KINDS = ("polynomial", "polysketch", "linear", "performer", "sliding_window")
SKETCHES = ("gaussian", "srht", "learned")
FEATURE_MAPS = ("elu", "relu", "taylor", "hedgehog")
LOCAL_KERNELS = ("polynomial", "softmax")
EXACT_PATHS = ("auto", "quadratic", "tensor")
CAUSAL_ALGORITHMS = ("block", "cumsum")
BACKENDS = ("auto", "loop", "batched", "triton")
# polysketch builds 2p - 1 sketch factors per head (a binary tree of degree-2 products): degree 1024 took 9.7 s
# for one forward, 2**40 never returned. The paper uses p = 2, 4, 8; 64 leaves room without a hang.
MAX_SKETCH_DEGREE = 64
# Fields a kind needs besides the shared defaults when it is named alone (attn_implementation="sliding_window",
# convert(model, "sliding_window")): 256 keys, Longformer's one-sided window (its 512 spans both sides).
KIND_DEFAULTS: dict[str, dict[str, Any]] = {"sliding_window": {"window": 256}}

# Allowed values of every str field and the minimum of every int field: __post_init__
# validates each field by its annotation, so a new field without an entry here fails loudly.
_CHOICES: dict[str, tuple[str, ...]] = {
    "kind": KINDS,
    "sketch": SKETCHES,
    "feature_map": FEATURE_MAPS,
    "local_kernel": LOCAL_KERNELS,
    "exact_path": EXACT_PATHS,
    "causal_algorithm": CAUSAL_ALGORITHMS,
    "backend": BACKENDS,
}
_INT_MINIMUM = {"degree": 1, "sketch_size": 1, "num_features": 1, "block_size": 1, "max_tensor_features": 1, "seed": 0,
                "window": 0, "feature_proj": 0}
# ops.attention.layer_seed reduces seed * 1_000_003 modulo 2**62: a larger seed would silently draw the
# sketches / features of a smaller one (2**62 those of 0).
_INT_MAXIMUM = {"seed": 2**62 - 1}
# Every float option enters the kernels, which compute in float32: 1e300 is finite in Python but
# inf there (a denominator_offset of 1e300 zeroes the attention like inf did).
FLOAT32_MAX = 3.4028234663852886e38


def _is_power_of_two(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    # bool is an int subclass (True would be degree 1); floats such as 4.0 are refused, not truncated.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value!r}")
    return int(value)


def _real(name: str, value: Any, what: str, shown: str) -> float:
    # NaN/inf would not fail here or in the kernels: NaN compares False with everything and
    # silently zeroes (or NaNs) the attention weights downstream; so would a float32 overflow.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be {what}, got {shown}")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must be {what} of magnitude <= {FLOAT32_MAX:.8g} (float32, the kernels' "
                         f"working precision), got {shown}")
    return float(value)


def _check_float(name: str, value: Any) -> float:
    return _real(name, value, "a finite real number (int or float)", repr(value))


def _check_bool(name: str, value: Any) -> bool:
    # A string such as "no" or "false" is truthy: it would switch the option ON.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def _check_coefficients(name: str, value: Any) -> tuple[float, ...]:
    # A str is a sequence too: "12" would become (1.0, 2.0).
    what = "a list or tuple of finite real numbers a_0..a_D"
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return tuple(_real(name, c, what, f"{c!r} at index {i} of {value!r}") for i, c in enumerate(value))


_CHECKS = {
    "bool": lambda name, value: _check_bool(name, value),
    "int": lambda name, value: _check_int(name, value, _INT_MINIMUM[name], _INT_MAXIMUM.get(name)),
    "float": _check_float,
    "str": lambda name, value: _check_choice(name, value, _CHOICES[name]),
    "tuple[float, ...]": _check_coefficients,
}


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
            "help": "kernel of the exact local part (local_exact blocks or the sliding window): 'polynomial' "
            "(degree p; default for polysketch blocks, the paper's mixed mode) or 'softmax' (default otherwise)"
        },
    )
    window: int = field(
        default=0,
        metadata={
            "help": "sliding window w: each query attends exactly (local_kernel) to its previous w keys (|i-j| < w "
            "bidirectional) and through the kernel to all keys before them, one normaliser (LoLCATs); 0 = off"
        },
    )
    window_mix: bool = field(
        default=False, metadata={"help": "learnable per-head factor on the kernel part of a window (init 1)"}
    )
    block_size: int = field(default=256, metadata={"help": "block size b of the causal LT multiplication"})
    qk_norm: bool = field(default=False, metadata={"help": "learnable per-head LayerNorm on q and k"})
    feature_proj: int = field(
        default=0,
        metadata={
            "help": "learnable per-head projection of q and k to this many dimensions (>= head_dim) before the "
            "kernel, then qk_norm; starts as the identity padded with zeros (today's kernel exactly when equal to "
            "head_dim); 0 = off"
        },
    )
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
    backend: str = field(
        default="auto",
        metadata={
            "help": "causal product implementation: 'auto' (triton on CUDA when installed, batched on other "
            "accelerators, loop on CPU), 'loop', 'batched' or 'triton' (forces one); env HF_POLYATTN_BACKEND "
            "overrides 'auto'"
        },
    )

    def __post_init__(self) -> None:
        self._check_types()
        if self.kind == "sliding_window":
            self._check_sliding_window()
        if self.kind == "polynomial" and self.poly_coefficients is None and self.degree % 2:
            raise ValueError(f"degree must be even for kind='polynomial' (got {self.degree}): odd powers go negative")
        if self.kind == "polysketch" and (self.degree < 2 or not _is_power_of_two(self.degree)
                                          or self.degree > MAX_SKETCH_DEGREE):
            raise ValueError(f"degree must be a power of two in [2, {MAX_SKETCH_DEGREE}] for kind='polysketch', got "
                             f"{self.degree}")
        if self.local_exact and self.kind == "polynomial":
            raise ValueError("local_exact applies to the linear-time kinds (polysketch, linear, performer); "
                             "kind='polynomial' is exact everywhere already")
        if self.local_exact and self.causal_algorithm == "cumsum":
            raise ValueError("local_exact needs causal_algorithm='block' (the exact part lives in the diagonal blocks)")
        if self.window:
            if self.kind == "polynomial":
                raise ValueError("window applies to the linear-time kinds (polysketch, linear, performer); "
                                 "kind='polynomial' is exact everywhere already")
            if self.local_exact:
                raise ValueError("window and local_exact are two forms of the exact local part (sliding vs "
                                 "block-diagonal): set one of them")
            if self.causal_algorithm == "cumsum":
                raise ValueError("window needs causal_algorithm='block'")
        if self.window_mix and not self.window:
            raise ValueError("window_mix needs window > 0 (it weights the kernel part beyond the window)")
        if self.local_kernel is not None and not (self.local_exact or self.window):
            raise ValueError(f"local_kernel={self.local_kernel!r} needs local_exact=True or window > 0 "
                             "(it is the kernel of the exact local part)")
        if self.kind != "polynomial" and (self.alpha != 0.0 or self.beta != 1.0):
            raise ValueError("alpha and beta shape the exact polynomial kernel ((s q.k + alpha)/beta)^p: "
                             "kind='polynomial' only")
        if self.beta == 0.0:
            raise ValueError("beta must be a non-zero finite real number, got 0.0")
        if self.denominator_offset < 0:
            raise ValueError(f"denominator_offset must be a finite real number >= 0, got {self.denominator_offset}")
        if self.denominator_offset and (self.kind == "performer" or self.resolved_local_kernel == "softmax"):
            raise ValueError("denominator_offset is not allowed with exp-based weights (performer, softmax local "
                             "blocks): their per-query stabiliser would change its meaning")
        if self.poly_coefficients is not None:
            if self.kind != "polynomial":
                raise ValueError("poly_coefficients is only for kind='polynomial'")
            if not self.poly_coefficients or all(c == 0 for c in self.poly_coefficients):
                raise ValueError("poly_coefficients must hold at least one non-zero coefficient a_0..a_D")
        elif self.learn_coefficients:
            raise ValueError("learn_coefficients needs poly_coefficients (the initial a_0..a_D)")

    @classmethod
    def for_kind(cls, kind: str, **overrides: Any) -> PolyAttnConfig:
        """The settings of ``kind`` named alone: the shared defaults, the kind's own (KIND_DEFAULTS), overrides."""
        return cls(kind=kind, **{**KIND_DEFAULTS.get(kind, {}), **overrides})

    def _check_sliding_window(self) -> None:
        """kind='sliding_window' is the window alone (Longformer-style local attention): no kernel beyond it."""
        if not self.window:
            raise ValueError("kind='sliding_window' needs window >= 1: the number of previous keys each query "
                             "attends to (|i - j| < window bidirectional)")
        for name, off in (("local_exact", False), ("window_mix", False), ("qk_norm", False), ("feature_proj", 0)):
            if getattr(self, name) != off:
                raise ValueError(f"{name} shapes the kernel beyond the window; kind='sliding_window' has no kernel "
                                 f"there: leave {name}={off!r}")
        if self.local_kernel == "polynomial" and self.degree % 2:
            raise ValueError(f"degree must be even for a polynomial window (got {self.degree}): odd powers go "
                             "negative")

    def _check_types(self) -> None:
        """Validate (and normalise: ints to int, reals to float, coefficients to a tuple) every field by its
        annotation, so that no option can be silently misread (``"no"`` as True, NaN as a number)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            annotation = str(f.type)
            optional = annotation.endswith(" | None")
            if optional and value is None:
                continue
            check = _CHECKS.get(annotation.removesuffix(" | None"))
            if check is None:  # a field added without validation: a bug of this file, not of the caller
                raise TypeError(f"PolyAttnConfig.{f.name}: no validation for annotation {annotation!r}")
            setattr(self, f.name, check(f.name, value))

    @property
    def resolved_local_kernel(self) -> str | None:
        """The kernel of the exact local part actually used (blocks or window), or None without one."""
        if not (self.local_exact or self.window):
            return None
        if self.local_kernel is not None:
            return self.local_kernel
        # blocks: the paper's mixed mode for polysketch; windows: softmax (LoLCATs; the PEERS.md
        # probe: 62.6 perplexity with a 64-token softmax window vs 95.3 without on SmolLM2)
        return "polynomial" if self.kind == "polysketch" and self.local_exact else "softmax"

    @property
    def is_linear_time(self) -> bool:
        return self.kind != "polynomial"  # sliding_window: O(n w) with w fixed

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
        return cls(**d)  # __post_init__ turns a JSON list of coefficients into a tuple

    def replace(self, **changes: Any) -> PolyAttnConfig:
        return dataclasses.replace(self, **changes)
