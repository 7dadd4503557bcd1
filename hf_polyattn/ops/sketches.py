"""Polynomial sketches (Ahle et al. 2020; PolySketchFormer Section 2; thesis Section 4.2).

A degree-q sketch (q a power of two) maps x in R^h to z in R^r with
E[z(x) . z(y)] = (x . y)^q. Degree 2 is ``(x M1) * (x M2) / sqrt(r)`` (entrywise product);
degree 2q applies the same step to two independent degree-q sketches; degree 1 is a
JL projection ``x M / sqrt(r)``.

* ``gaussian``: M has i.i.d. N(0, 1) entries (thesis Section 4.2).
* ``srht``: the paper's Definitions 2.3/2.4. The leaf SRHT (h -> r, sqrt(1/r) D H P) and
  the TensorSRHT factor (D' H P') are both fixed linear maps, so their product is folded
  into one dense h x r matrix: at h = 64, r = 32 a dense matmul is faster on CPU than a
  fast Walsh-Hadamard transform (O(h log h) flops but 6 memory passes), and the sketch
  is exactly the same function. Dimensions are zero-padded to a power of two for H.
* ``learned``: the matrices are trainable and each factor gets a residual two-layer
  network W2 gelu(W1 .) (as the published PolySketchFormer's learned sketches); W2 starts
  at zero, so an untrained learned sketch *is* the Gaussian sketch of the same seed.

``symmetric_square(z)`` is the tensoring trick phi = z^{(2)} with the r(r+1)/2 distinct
monomials (off-diagonal ones weighted sqrt 2): <phi(a), phi(b)> = (a . b)^2 >= 0 exactly
as with the r^2 Kronecker square, at about half the features (528 instead of 1024 at r=32).

All matrices carry a head axis: shape (heads, 1, in, out), broadcast over a query-group
axis (grouped-query attention shares a kv head's sketch with its query heads).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["PolynomialSketch", "symmetric_power", "symmetric_power_indices", "symmetric_square"]


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight in x's working dtype (float32/float64, see ops/attention.py).

    One exception: a half-precision weight (the model is bf16/fp16) on a GPU with a float32
    working copy multiplies in the weight's dtype on tensor cores (fp32 accumulation, the product
    rounded to the model's precision once, as every Linear layer of that model is) and returns
    float32. These thin (n x d) @ (d x r) products ran as fp32 SIMT GEMMs at ~1.1 ms each for
    n = 32k, H = 16 on an H100, 13 ms of a polysketch layer's forward+backward.
    """
    if x.is_cuda and x.dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):
        return torch.matmul(x.to(weight.dtype), weight).to(x.dtype)
    return torch.matmul(x, weight.to(x.dtype))


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def hadamard(n: int, dtype=torch.float64) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard matrix (entries +-1), n a power of two."""
    h = torch.ones(1, 1, dtype=dtype, device="cpu")
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _gaussian(gen: torch.Generator, heads: int, n_in: int, n_out: int) -> torch.Tensor:
    return torch.randn(heads, 1, n_in, n_out, generator=gen, dtype=torch.float64, device="cpu")


def _srht_factor(gen: torch.Generator, heads: int, n_in: int, n_out: int) -> torch.Tensor:
    """D H P restricted to the first n_in rows (zero padding to a power of two), per head."""
    h = _next_pow2(n_in)
    signs = torch.randint(0, 2, (heads, h, 1), generator=gen, device="cpu").to(torch.float64) * 2 - 1
    cols = torch.randint(0, h, (heads, 1, n_out), generator=gen, device="cpu")
    dh = (signs * hadamard(h))[:, :n_in, :]
    return torch.gather(dh, 2, cols.expand(heads, n_in, n_out)).unsqueeze(1)


class _Factor(nn.Module):
    """One linear factor x -> x M (plus the learned residual branch)."""

    def __init__(self, heads: int, n_in: int, n_out: int, learned: bool, leaf: bool):
        super().__init__()
        self.heads, self.n_in, self.n_out, self.learned, self.leaf = heads, n_in, n_out, learned, leaf
        shape = (heads, 1, n_in, n_out)
        if learned:
            self.weight = nn.Parameter(torch.zeros(shape))
            self.hidden = nn.Parameter(torch.zeros(heads, 1, n_in, n_out))
            self.out = nn.Parameter(torch.zeros(heads, 1, n_out, n_out))
        else:
            self.register_buffer("weight", torch.zeros(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Parameters live in the model's dtype (a bf16 model holds bf16 sketches); the
        # math runs in the input's working dtype (float32/float64, see ops/attention.py), see project().
        if self.learned:
            return _learned_factor(x, self)
        return project(x, self.weight)


class PolynomialSketch(nn.Module):
    """Degree-``degree`` sketch (degree a power of two) to ``sketch_size`` coordinates."""

    def __init__(self, heads: int, dim: int, degree: int, sketch_size: int, kind: str = "gaussian", seed: int = 0):
        super().__init__()
        if degree < 1 or degree & (degree - 1):
            raise ValueError(f"sketch degree must be a power of two >= 1, got {degree}")
        if kind not in ("gaussian", "srht", "learned"):
            raise ValueError(f"sketch must be one of ['gaussian', 'srht', 'learned'], got {kind!r}")
        self.heads, self.dim, self.degree, self.sketch_size, self.kind, self.seed = (
            heads, dim, degree, sketch_size, kind, seed)
        learned = kind == "learned"
        # Factors in a fixed depth-first order, so a seed always gives the same matrices.
        self.factors = nn.ModuleList()
        self._build(degree, dim, learned)
        self.reset_parameters()

    def _build(self, degree: int, n_in: int, learned: bool) -> None:
        r = self.sketch_size
        if degree == 1:
            self.factors.append(_Factor(self.heads, n_in, r, learned, leaf=True))
            return
        child_in = n_in if degree == 2 else r
        if degree > 2:
            self._build(degree // 2, n_in, learned)
            self._build(degree // 2, n_in, learned)
        for _ in range(2):
            self.factors.append(_Factor(self.heads, child_in, r, learned, leaf=degree == 2))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Redraw every matrix from ``seed`` (deterministic across processes and devices)."""
        # Drawn on the CPU in float64 whatever the module's device, dtype or an ambient
        # ``torch.device(...)`` context (a CPU generator cannot fill a CUDA or meta tensor),
        # then copied: the same seed gives the same sketch on every device.
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        r = self.sketch_size
        for f in self.factors:
            if self.kind == "srht":
                if f.leaf and self.degree > 1:
                    # leaf SRHT (h -> r, sqrt(1/r) D H P) composed with the TensorSRHT factor.
                    m = _srht_factor(gen, self.heads, f.n_in, r) / math.sqrt(r)
                    m = torch.matmul(m, _srht_factor(gen, self.heads, r, r))
                else:
                    m = _srht_factor(gen, self.heads, f.n_in, r)
            else:
                m = _gaussian(gen, self.heads, f.n_in, r)
            f.weight.copy_(m.to(f.weight.dtype))
        # the learned branch draws after every main matrix: same seed -> same main matrices
        # as the Gaussian sketch, so an untrained learned sketch equals it exactly.
        for f in self.factors:
            if f.learned:
                f.hidden.copy_(_gaussian(gen, self.heads, f.n_in, r).to(f.hidden.dtype) / math.sqrt(f.n_in))
                f.out.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        it = iter(self.factors)
        return self._sketch(x, self.degree, it)

    def _sketch(self, x: torch.Tensor, degree: int, it) -> torch.Tensor:
        r = self.sketch_size
        if degree == 1:
            return next(it)(x) / math.sqrt(r)
        if degree == 2:
            return _leaf_pair(x, next(it), next(it)) / math.sqrt(r)
        a = self._sketch(x, degree // 2, it)
        b = self._sketch(x, degree // 2, it)
        return next(it)(a) * next(it)(b) / math.sqrt(r)


def _leaf_pair(x: torch.Tensor, f: _Factor, g: _Factor) -> torch.Tensor:
    """f(x) * g(x) for two factors of the same input (a degree-2 node, polysketch's whole sketch at p = 4).

    Gaussian/SRHT factors: one product of x with [W_f, W_g] side by side instead of one each (on a GPU each was a
    launch, and with a bf16 model a bf16 copy of the fp32 x, ``project``); both halves are kept by the product's
    backward anyway. Column for column the same dot products as separate products.

    Learned factors keep a product per matrix: columns split from one product are views of its storage and gelu keeps
    its input for backward, so the main columns would live as long as the hidden ones, and backward would gather the
    halves' gradients into one more n x 2r tensor. The main product comes after the residual branch and is added in
    place into its output (which nothing saves for backward). A bf16 polysketch-local layer's forward + backward peak,
    bf16 query units, n = 512, H = 2 (recipes/memory_layers.py, CPU): one product of all four matrices 17.69, this
    15.69."""
    if not f.learned:
        yf, yg = project(x, torch.cat([f.weight, g.weight], dim=-1)).split([f.weight.shape[-1], g.weight.shape[-1]], -1)
        return yf * yg
    return _learned_factor(x, f) * _learned_factor(x, g)


def _learned_factor(x: torch.Tensor, f: _Factor) -> torch.Tensor:
    """x W + gelu(x H) O, the main product last and added in place (see _leaf_pair)."""
    return project(F.gelu(project(x, f.hidden)), f.out).add_(project(x, f.weight))


_INDEX_CACHE: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def symmetric_power_indices(dim: int, degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted index tuples i_1 <= ... <= i_p and sqrt(multinomial) weights."""
    key = (dim, degree)
    if key not in _INDEX_CACHE:
        with torch.inference_mode(False):  # cached for every later call: never an inference tensor, which a later
        # call recording gradients could not save for backward
            _INDEX_CACHE[key] = _build_indices(dim, degree)
    return _INDEX_CACHE[key]


def _build_indices(dim: int, degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    combos = list(itertools.combinations_with_replacement(range(dim), degree))
    idx = torch.tensor(combos, dtype=torch.long, device="cpu").reshape(len(combos), degree)
    weights = []
    for c in combos:
        counts = [c.count(v) for v in set(c)]
        mult = math.factorial(degree)
        for k in counts:
            mult //= math.factorial(k)
        weights.append(math.sqrt(mult))
    return idx, torch.tensor(weights, dtype=torch.float64, device="cpu")


def symmetric_power(x: torch.Tensor, degree: int) -> torch.Tensor:
    """phi(x) with <phi(a), phi(b)> = (a . b)^degree, C(d+p-1, p) features (the symmetric
    part of the Kronecker power x^{(p)}, which has d^p)."""
    if degree == 0:
        return x.new_ones(*x.shape[:-1], 1)
    idx, w = symmetric_power_indices(x.shape[-1], degree)
    idx, w = idx.to(x.device), w.to(device=x.device, dtype=x.dtype)
    if degree == 1:
        return x
    out = x[..., idx[:, 0]]
    for j in range(1, degree):
        out = out * x[..., idx[:, j]]
    return out * w


def symmetric_square(z: torch.Tensor) -> torch.Tensor:
    """The tensoring trick z^{(2)} with r(r+1)/2 features: <phi(a), phi(b)> = (a . b)^2."""
    return symmetric_power(z, 2)
