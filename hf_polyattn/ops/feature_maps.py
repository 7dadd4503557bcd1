"""Feature maps phi with <phi(q), phi(k)> = the attention kernel, one registry entry each.

Every map takes the *kernel input* (already LayerNorm-ed and scaled by the attention
module), works in float32 or float64, and returns (..., num_features). ``is_query`` lets
a map treat the two sides differently (Performer's stabiliser, the sign split of a
polynomial with negative coefficients).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from .common import ACTIVATIONS, head_layer_norm
from .sketches import PolynomialSketch, project, symmetric_power, symmetric_square

__all__ = [
    "FEATURE_MAPS",
    "EluFeatureMap",
    "FeatureMap",
    "HedgehogFeatureMap",
    "PerformerFeatureMap",
    "PolySketchFeatureMap",
    "PolynomialFeatureMap",
    "ReluFeatureMap",
    "TaylorFeatureMap",
    "activation_features",
    "compiled_activation_features",
    "polynomial_num_features",
    "register_feature_map",
    "selectable_feature_maps",
    "squared_polynomial_coefficients",
]


class FeatureMap(nn.Module):
    """Base class: ``num_features`` and ``forward(x, is_query)``.

    Every map is row-wise: a token's features depend on that token's input alone (recurrent decoding forms them a
    token at a time, and a training forward + backward recomputes them in chunks of rows, ``attention.FEATURE_CHUNKS``).

    Class flags read by ``PolyAttention`` (instead of the kind's name):
    ``scaled_inputs``: the map receives sqrt(s) q, sqrt(s) k (polynomial / exp targets, s = the
    attention scaling) instead of the raw q, k (linear attention, Katharopoulos et al.);
    ``squares``: ``sketch_features`` gives r-dim sketches whose symmetric squares are the features
    (the block algorithm squares them per block, never storing r(r+1)/2 features);
    ``log_scaled``: ``forward_with_log_scale`` gives query features divided by a per-row exp(c);
    ``per_head``: built as ``cls(kv_heads, dim)`` instead of ``cls(dim)``;
    ``selectable``: a ``feature_map=`` choice of the linear kind (False for maps built by their own kind);
    ``activation``: the map is this elementwise function of ``lt_product(activation=...)`` ('elu', 'relu'), which
    the Triton kernels apply as they load q and k (a subclass that changes ``forward`` must set it back to None).
    """

    num_features: int
    scaled_inputs = False
    squares = False
    log_scaled = False
    per_head = False
    selectable = True
    activation: str | None = None

    def forward(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Deterministic (re-)initialisation; maps without state do nothing."""


FEATURE_MAPS: dict[str, type[FeatureMap]] = {}


def selectable_feature_maps() -> list[str]:
    """The ``feature_map=`` choices: every registered map but those a kind builds itself (``selectable``)."""
    return [name for name, cls in FEATURE_MAPS.items() if cls.selectable]


def register_feature_map(name: str) -> Callable[[type[FeatureMap]], type[FeatureMap]]:
    def deco(cls: type[FeatureMap]) -> type[FeatureMap]:
        if name in FEATURE_MAPS:
            raise ValueError(f"feature map {name!r} is registered already")
        FEATURE_MAPS[name] = cls
        return cls

    return deco


@register_feature_map("elu")
class EluFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020): positive, so weights are > 0."""

    activation = "elu"

    def __init__(self, dim: int):
        super().__init__()
        self.num_features = dim

    def forward(self, x, is_query):
        return ACTIVATIONS["elu"](x)


@register_feature_map("relu")
class ReluFeatureMap(FeatureMap):
    """phi(x) = relu(x); a row whose weights are all zero returns 0 rather than NaN."""

    activation = "relu"

    def __init__(self, dim: int):
        super().__init__()
        self.num_features = dim

    def forward(self, x, is_query):
        return ACTIVATIONS["relu"](x)


@register_feature_map("taylor")
class TaylorFeatureMap(FeatureMap):
    """phi(x) = [1, x/|x|]: <phi(q), phi(k)> = 1 + q^.k^ in [0, 2] (first-order Taylor of exp,
    seed 002)."""

    def __init__(self, dim: int):
        super().__init__()
        self.num_features = dim + 1

    def forward(self, x, is_query):
        xn = F.normalize(x, dim=-1, eps=1e-6)
        return torch.cat([torch.ones_like(xn[..., :1]), xn], dim=-1)


@register_feature_map("hedgehog")
class HedgehogFeatureMap(FeatureMap):
    """Hedgehog (Zhang et al., arXiv:2402.04347): phi(x) = [softmax(x W), softmax(-x W)] over the
    features, with a learnable per-kv-head W (d x d, initialised to the identity).

    Positive and spiky like softmax's weights: trained by attention transfer it mimics them where
    elu+1 cannot (the paper's motivation). 2d features. ``per_head``: built with the number of kv
    heads (PolyAttention reads this flag).
    """

    per_head = True

    def __init__(self, heads: int, dim: int):
        super().__init__()
        self.num_features = 2 * dim
        self.weight = nn.Parameter(torch.zeros(heads, 1, dim, dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        eye = torch.eye(self.weight.shape[-1], dtype=torch.float64, device="cpu")
        self.weight.copy_(eye.expand(self.weight.shape).to(self.weight.dtype))

    def forward(self, x, is_query):
        z = project(x, self.weight)
        return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


@register_feature_map("performer")
class PerformerFeatureMap(FeatureMap):
    """FAVOR+ positive orthogonal random features: phi(x) = exp(w.x - |x|^2/2) / sqrt(m),
    E[<phi(q), phi(k)>] = exp(q.k).

    Stabilisers: a query's row max is subtracted (a per-query constant, cancels in the
    ratio). Keys get a *data-independent* shift c = max(0, max_j |w_j|^2/2 - 30): since
    w.x - |x|^2/2 <= |w|^2/2, key features stay <= e^30 ~ 1e13 whatever the input, with
    no dependence on other tokens (a max over the sequence would leak future tokens into
    the float rounding of causal outputs and is impossible in recurrent decoding).
    """

    scaled_inputs, log_scaled, selectable = True, True, False

    def __init__(self, heads: int, dim: int, num_features: int = 256, seed: int = 0):
        super().__init__()
        self.heads, self.dim, self.num_features, self.seed = heads, dim, num_features, seed
        self.register_buffer("omega", torch.zeros(heads, 1, dim, num_features))
        self.reset_parameters()

    @torch.no_grad()
    def redraw(self, seed: int | None = None) -> None:
        """Draw new orthogonal features (from ``seed``, or the next seed)."""
        self.seed = self.seed + 1 if seed is None else seed
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # CPU float64 draws whatever the device/dtype/ambient device context: same seed, same features.
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        d, m = self.dim, self.num_features
        heads = []
        for _ in range(self.heads):
            blocks = []
            for _ in range(-(-m // d)):
                g = torch.randn(d, d, generator=gen, dtype=torch.float64, device="cpu")
                q, _ = torch.linalg.qr(g)
                blocks.append(q.T)
            w = torch.cat(blocks, 0)[:m]
            # rows of a Gaussian matrix have chi(d) norms: keep that marginal (FAVOR+).
            norms = torch.randn(m, d, generator=gen, dtype=torch.float64, device="cpu").norm(dim=1)
            heads.append((w * norms[:, None]).T)
        self.omega.copy_(torch.stack(heads).unsqueeze(1).to(self.omega.dtype))

    def forward(self, x, is_query):
        return self.forward_with_log_scale(x, is_query)[0]

    def forward_with_log_scale(self, x: torch.Tensor, is_query: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Features divided by exp(c) and c (per row for queries, one constant for keys).

        n x m fp32 at m = 256 is 8 bf16 query units a side: ``proj`` (a fresh matmul product) is shifted in place
        and 1/sqrt(m) taken into the exponent, so the features are exp's own output (which its backward keeps)
        and no second n x m copy is made; the same values up to rounding (exp(a - log sqrt m) for exp(a) / sqrt m).
        """
        proj = project(x, self.omega).sub_(0.5 * (x * x).sum(-1, keepdim=True))
        with torch.no_grad():
            if is_query:
                c = proj.amax(dim=-1, keepdim=True)
            else:
                half_norm = 0.5 * self.omega.to(x.dtype).pow(2).sum(-2, keepdim=True).amax(-1, keepdim=True)
                c = (half_norm - 30.0).clamp_min(0.0)
        return torch.exp(proj.sub_(c + 0.5 * math.log(self.num_features))), c


@register_feature_map("polysketch")
class PolySketchFeatureMap(FeatureMap):
    """phi(x) = (x^{(p/2)} S)^{(2)}: a degree-p/2 sketch to r coordinates, then the
    symmetric tensor square (r(r+1)/2 features). <phi(q), phi(k)> = <Sq, Sk>^2 >= 0 and
    its mean over sketches is (q.k)^p (Theorem 2.5)."""

    scaled_inputs, squares, selectable = True, True, False

    def __init__(self, heads: int, dim: int, degree: int = 4, sketch_size: int = 32, sketch: str = "gaussian",
                 seed: int = 0):
        super().__init__()
        self.degree = degree
        self.sketch = PolynomialSketch(heads, dim, degree // 2, sketch_size, sketch, seed)
        self.num_features = sketch_size * (sketch_size + 1) // 2

    def reset_parameters(self) -> None:
        self.sketch.reset_parameters()

    def forward(self, x, is_query):
        z = self.sketch(x)
        return symmetric_square(z)

    def sketch_features(self, x: torch.Tensor) -> torch.Tensor:
        """The untensored z = x^{(p/2)} S (its dot products may be negative)."""
        return self.sketch(x)


def squared_polynomial_coefficients(a: torch.Tensor) -> torch.Tensor:
    """b with (sum_i a_i x^i)^2 = sum_j b_j x^j (a discrete self-convolution)."""
    n = a.shape[-1]
    b = a.new_zeros(2 * n - 1)
    for i in range(n):
        b = b + F.pad(a[i] * a, (i, n - 1 - i))
    return b


def polynomial_num_features(dim: int, degrees: list[int]) -> int:
    return sum(math.comb(dim + j - 1, j) for j in degrees)


@register_feature_map("polynomial")
class PolynomialFeatureMap(FeatureMap):
    """Exact features of ((x.y + alpha)/beta)^p, or of (sum_i a_i (x.y)^i)^2.

    alpha enters as one extra coordinate (sqrt|alpha| on the query, sign(alpha) sqrt|alpha|
    on the key) and beta as 1/beta on the query side. Each monomial degree j contributes the
    symmetric power x^{(j)} (C(d+j-1, j) features); a negative coefficient b_j keeps its sign
    on the key side so <phi(q), phi(k)> is exactly the polynomial.
    """

    scaled_inputs, selectable = True, False

    def __init__(self, dim: int, degree: int = 4, alpha: float = 0.0, beta: float = 1.0,
                 coefficients: Callable[[], torch.Tensor] | None = None, num_coefficients: int = 0):
        super().__init__()
        self.dim, self.degree, self.alpha, self.beta = dim, degree, float(alpha), float(beta)
        self._coefficients = coefficients
        self.aug = 1 if self.alpha != 0.0 else 0
        if coefficients is None:
            self.num_features = polynomial_num_features(dim + self.aug, [degree])
        else:
            self.num_features = polynomial_num_features(dim, list(range(2 * num_coefficients - 1)))

    def forward(self, x, is_query):
        if self._coefficients is None:
            if self.aug:
                extra = math.sqrt(abs(self.alpha)) * (1.0 if is_query or self.alpha > 0 else -1.0)
                x = torch.cat([x, torch.full_like(x[..., :1], extra)], dim=-1)
            if is_query:
                x = x / self.beta
            return symmetric_power(x, self.degree)
        b = squared_polynomial_coefficients(self._coefficients().to(x.dtype))
        parts = []
        for j in range(b.shape[0]):
            scale = b[j].abs().sqrt()
            if not is_query:
                scale = scale * torch.sign(b[j])
            parts.append(symmetric_power(x, j) * scale)
        return torch.cat(parts, dim=-1)


# Where ``compiled_activation_features`` hands out a compiled function (tests add "cpu" to run it here). On an H100
# the recomputed eager side of the long-context default (bf16 input upcast, q/k LayerNorm over 64 columns, elu + 1,
# formed again in backward; H = 16, n = 32k) took 8.3 of the layer's 19.1 ms of GPU time, the LayerNorm kernel alone
# 3.2 ms at about 320 GB/s (recipes/results/gpu_h100_auto/run2/profile_kinds.txt)
COMPILED_FEATURE_DEVICES: tuple[str, ...] = ("cuda",)
_COMPILED_FEATURES: dict[str, Callable] = {}


def activation_features(x: torch.Tensor, activation: str | None, proj: torch.Tensor | None = None,
                        norm_weight: torch.Tensor | None = None, norm_bias: torch.Tensor | None = None,
                        eps: float = 1e-5) -> torch.Tensor:
    """An elementwise map's features from the model's q or k in one function: x in its working dtype, times the
    per-head projection ``proj`` (``sketches.project``), LayerNorm-ed with per-head ``norm_weight`` / ``norm_bias``,
    then ``ACTIVATIONS[activation]`` (None: the kernel input itself, for kernels that apply the map on load). The
    same operations as ``PolyAttention.kernel_input`` followed by the 'elu' / 'relu' map."""
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if proj is not None:
        x = project(x, proj)
    if norm_weight is not None:
        x = head_layer_norm(x, norm_weight, norm_bias, eps)
    return x if activation is None else ACTIVATIONS[activation](x)


def compiled_activation_features(device: torch.device) -> Callable | None:
    """``activation_features`` compiled with torch.compile for ``device`` (once per process; its backward is the
    compiled graph's, which keeps the input and recomputes the elementwise work in its fused kernels), or None where
    the eager chunked recomputation stays (every device but those in ``COMPILED_FEATURE_DEVICES``: compiling costs
    seconds per shape, and on the CPU the eager side is already memory-bound work of a few passes).

    Every layer calls the same function, so its graphs count against one recompilation limit: a retrofitted SmolLM2
    (30 layers whose kernel heads number 0-3 per layer, 22 softmax kv heads) went past torch.compile's default 8
    in one prefill on an H100 and failed there under ``fullgraph=True``. The calls raise the limit to
    ``RECOMPILE_LIMIT`` (a graph per side, head layout, dtype and grad mode; lengths become dynamic after the
    first change), the parameters are passed as views (torch.compile holds parameters to static shapes), and
    without ``fullgraph`` a call past the limit runs the same function eagerly."""
    if device.type not in COMPILED_FEATURE_DEVICES:
        return None
    fn = _COMPILED_FEATURES.get(device.type)
    if fn is None:
        fn = _COMPILED_FEATURES[device.type] = partial(_call_compiled, torch.compile(activation_features))
    return fn


RECOMPILE_LIMIT = 64


def _call_compiled(compiled, x, activation, proj=None, norm_weight=None, norm_bias=None, eps=1e-5):
    import torch._dynamo.config as dynamo_config

    views = [None if t is None else t.view(t.shape) for t in (proj, norm_weight, norm_bias)]
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    with dynamo_config.patch(**{limit: max(RECOMPILE_LIMIT, getattr(dynamo_config, limit))}):
        return compiled(x, activation, *views, eps)
