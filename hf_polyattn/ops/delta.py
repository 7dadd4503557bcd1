"""The gated delta rule (Gated DeltaNet, Yang, Kautz and Hatamizadeh, arXiv:2412.06464) in linear time.

A state S (d_k x d_v per kv head) is written token by token and read by the queries:

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,        o_t = S_t^T q_t

(the paper writes S^T: S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t). With a unit key, S^T k_t
after the write is a_t (1 - b_t) S_{t-1}^T k_t + b_t v_t: the write replaces what the key held by a share b_t of the
new value instead of adding to it, which is what lets a fixed-size state hold a key/value association over
thousands of tokens where an additive state blurs it. a_t in (0, 1] is the gate (decay), b_t in (0, 1) the write
strength; the caller L2-normalises k (and q).

Chunked form (``delta_rule_chunked``): within a chunk of C tokens with cumulative log-gates g_t (Gamma_t = exp g_t)
and the state S at the chunk's start, the written rows are u_t = b_t (v_t - Gamma_t S^T k_t - sum_{s<t}
exp(g_t - g_s) (k_t . k_s) u_s), a unit lower-triangular system (I + A) U = b V - b Gamma K S with A_ts =
b_t exp(g_t - g_s) k_t . k_s (s < t), solved once per chunk for the columns of V and of K (the UT transform of
DeltaNet): U = U~ - W S. Then

    O = (Gamma Q) S + (Q K^T * D) U,    S' = Gamma_C S + K^T (exp(g_C - g) U),    D_ts = exp(g_t - g_s) [s <= t]

The intra-chunk parts do not depend on S and are formed for every chunk at once; a loop over the n / C chunks
carries S. Memory O(n C) (the C x C blocks) plus one d_k x d_v state per chunk for backward: linear in n, nothing
n x n. Float32 accumulation (float64 stays float64); every exponent is <= 0 (masked before the exp).

``delta_rule_recurrent`` is the token-by-token form (decoding, a few matmuls a token); ``delta_rule_fla`` runs
fla-core's Triton kernels (``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``, the pinned [fla]
extra) on the same inputs. ``ops/reference.py`` has the definition in the paper's form, one token at a time.
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional as F

from .common import work_dtype

__all__ = ["DELTA_CHUNK", "FLA_DELTA_VERSION", "delta_rule", "delta_rule_chunked", "delta_rule_fla",
           "delta_rule_recurrent", "fla_delta_available", "l2_normalise", "resolve_delta_backend"]

# Gated DeltaNet's and fla-core's chunk: a chunk's C x C blocks stay small (C d flops per token for the solve)
DELTA_CHUNK = 64
# fla-core's release the 'fla' delta backend is written against (pyproject's [fla] extra)
FLA_DELTA_VERSION = "0.6.0"
# fla-core's l2norm epsilon, inside the square root (x / sqrt(|x|^2 + eps)): a zero row (a padded key) stays 0
L2_EPS = 1e-6


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + 1e-6) over the last dim, in x's working dtype (float32, float64 stays)."""
    x = x.to(work_dtype(x.dtype))
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)


def _check(q, k, v, beta, log_gate, state) -> None:
    b, h, _, n, dk = q.shape
    if k.shape != (b, h, 1, n, dk) or v.shape[:4] != (b, h, 1, n) or beta.shape != (b, h, 1, n):
        raise ValueError(f"delta rule: q (B, H, G, L, K), k (B, H, 1, L, K), v (B, H, 1, L, V), beta (B, H, 1, L); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(beta.shape)}")
    if log_gate is not None and log_gate.shape != beta.shape:
        raise ValueError(f"delta rule: log_gate must be (B, H, 1, L) like beta, got {tuple(log_gate.shape)}")
    if state is not None and state.shape != (b, h, 1, dk, v.shape[-1]):
        raise ValueError(f"delta rule: state must be (B, H, 1, K, V) = {(b, h, 1, dk, v.shape[-1])}, got "
                         f"{tuple(state.shape)}")


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                       log_gate: torch.Tensor | None = None, state: torch.Tensor | None = None,
                       chunk: int = DELTA_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs (B, H, G, L, V), state after the last token (B, H, 1, K, V)) of the gated delta rule (module doc).

    q (B, H, G, L, K): G query heads per state; k (B, H, 1, L, K), v (B, H, 1, L, V); beta (B, H, 1, L) the write
    strengths, log_gate (B, H, 1, L) log a_t <= 0 or None (a_t = 1); state (B, H, 1, K, V) or None (zeros). A
    token with beta 0 and log-gate 0 (a padded key) leaves the state as it was. Computed in float32 (float64
    stays float64)."""
    _check(q, k, v, beta, log_gate, state)
    dt = work_dtype(q.dtype)
    b, h, g, n, dk = q.shape
    dv = v.shape[-1]
    pad = -n % chunk
    nc = (n + pad) // chunk

    def chunks(x: torch.Tensor, features: bool = True) -> torch.Tensor:  # (..., L[, F]) -> (..., N, C[, F])
        x = x.to(dt)
        x = F.pad(x, (0, 0, 0, pad) if features else (0, pad))
        return x.unflatten(-2 if features else -1, (nc, chunk))

    qc, kc, vc, bc = chunks(q), chunks(k), chunks(v), chunks(beta, False)
    lg = chunks(log_gate, False).cumsum(-1) if log_gate is not None else torch.zeros_like(bc)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # D_ts = exp(g_t - g_s) for s <= t, 0 above the diagonal (masked before the exp: no overflow, no NaN)
    decay = torch.exp((lg.unsqueeze(-1) - lg.unsqueeze(-2)).masked_fill(~causal, float("-inf")))
    kk = torch.matmul(kc, kc.transpose(-1, -2)) * decay
    system = (bc.unsqueeze(-1) * kk).tril(-1)  # A: strictly lower (the solve takes the unit diagonal as given)
    rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * torch.exp(lg)).unsqueeze(-1) * kc], dim=-1)
    u_tilde, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * decay  # (B, H, G, N, C, C): the diagonal included
    q_read = qc * torch.exp(lg).unsqueeze(-1)  # reads the chunk's initial state through Gamma_t
    k_write = kc * torch.exp(lg[..., -1:] - lg).unsqueeze(-1)  # writes decayed to the chunk's end
    carry = torch.exp(lg[..., -1])  # (B, H, 1, N): Gamma_C
    s = torch.zeros(b, h, 1, dk, dv, dtype=dt, device=q.device) if state is None else state.to(dt)
    outs = []
    for i in range(nc):
        u = u_tilde[:, :, :, i] - torch.matmul(w[:, :, :, i], s)
        outs.append(torch.matmul(q_read[:, :, :, i], s) + torch.matmul(scores[:, :, :, i], u))
        s = s * carry[..., i, None, None] + torch.matmul(k_write[:, :, :, i].transpose(-1, -2), u)
    out = torch.stack(outs, dim=3).flatten(3, 4)
    return out[..., :n, :], s


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         log_gate: torch.Tensor | None = None,
                         state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule_chunked``'s result one token at a time: S <- a S; u = b (v - S^T k); S <- S + k u^T; o = S^T q.
    A few matmuls per token: the decoding path (one new token against the state)."""
    _check(q, k, v, beta, log_gate, state)
    dt = work_dtype(q.dtype)
    b, h, g, n, dk = q.shape
    s = torch.zeros(b, h, 1, dk, v.shape[-1], dtype=dt, device=q.device) if state is None else state.to(dt)
    q, k, v, beta = q.to(dt), k.to(dt), v.to(dt), beta.to(dt)
    gates = None if log_gate is None else torch.exp(log_gate.to(dt))
    outs = []
    for t in range(n):
        if gates is not None:
            s = s * gates[..., t, None, None]
        kt = k[..., t : t + 1, :]
        u = beta[..., t, None, None] * (v[..., t : t + 1, :] - torch.matmul(kt, s))
        s = s + torch.matmul(kt.transpose(-1, -2), u)
        outs.append(torch.matmul(q[..., t : t + 1, :], s))
    return torch.cat(outs, dim=-2), s


# ----------------------------------------------------------------------------------------- fla-core's kernels
def fla_delta_available() -> bool:
    """True when fla-core's gated delta rule kernels import (says nothing about a GPU being present)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: F401
    except Exception:  # a broken install counts as absent: 'fla' is then refused by name
        return False
    return True


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def resolve_delta_backend(requested: str, device: torch.device, needs_grad: bool, length: int) -> str:
    """'torch' (``delta_rule_chunked`` / ``delta_rule_recurrent``), 'fla-chunk' or 'fla-recurrent' for the delta
    kind's ``delta_backend`` option on ``device``.

    'fla' runs fla-core's chunk kernel (forward and backward) on CUDA, and its fused recurrent kernel (forward only)
    for one token without gradients (decoding). Under Triton's interpreter (TRITON_INTERPRET=1, CPU tests) only the
    fused recurrent kernel runs (fla-core 0.6.0's chunk kernels autotune, which needs a GPU driver): gradients or a
    chunk of tokens there are refused by name, as are CPU tensors without the interpreter."""
    if requested == "torch":
        return "torch"
    if requested != "fla":
        raise ValueError(f"delta_backend must be 'torch' or 'fla', got {requested!r}")
    if not fla_delta_available():
        raise ValueError(f"delta_backend='fla' needs fla-core: pip install 'hf_polyattn[fla]' "
                         f"(fla-core=={FLA_DELTA_VERSION})")
    if device.type == "cuda":
        return "fla-recurrent" if length == 1 and not needs_grad else "fla-chunk"
    if _triton_interpreted() and not needs_grad:
        return "fla-recurrent"
    raise ValueError(f"delta_backend='fla' runs fla-core's Triton kernels on CUDA tensors (got {device.type}"
                     + (", under Triton's interpreter its forward-only recurrent kernel, without gradients"
                        if _triton_interpreted() else "") + "): use delta_backend='torch' here")


def delta_rule_fla(q, k, v, beta, log_gate=None, state=None, recurrent: bool = False):
    """``delta_rule_chunked``'s result by fla-core's ``chunk_gated_delta_rule`` (``recurrent``: its
    ``fused_recurrent_gated_delta_rule``, forward only), scale 1 (q, k normalised by the caller).

    fla-core takes (B, T, heads, K) with one key head per query head: every (kv head, group) becomes one fla head,
    k, v, beta and the gates copied per query group (the state is then formed G times; the Triton kernels are
    written for that layout). Inputs in float32; the state (B, heads, K, V), K first (fla's default layout)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    _check(q, k, v, beta, log_gate, state)
    b, h, g, n, dk = q.shape
    dv = v.shape[-1]

    def heads(x: torch.Tensor) -> torch.Tensor:  # (B, H, 1 or G, L[, F]) -> (B, L, H G[, F]), float32, contiguous
        x = x.float()
        if x.dim() == 4:
            return x.expand(b, h, g, n).reshape(b, h * g, n).transpose(1, 2).contiguous()
        return x.expand(b, h, g, n, x.shape[-1]).reshape(b, h * g, n, x.shape[-1]).transpose(1, 2).contiguous()

    gates = torch.zeros_like(beta, dtype=torch.float32) if log_gate is None else log_gate
    h0 = None if state is None else state.float().expand(b, h, g, dk, dv).reshape(b, h * g, dk, dv).contiguous()
    fn = fused_recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule
    out, final = fn(heads(q), heads(k), heads(v), g=heads(gates), beta=heads(beta), scale=1.0, initial_state=h0,
                    output_final_state=True)
    out = out.transpose(1, 2).reshape(b, h, g, n, dv)
    return out, final.reshape(b, h, g, dk, dv)[:, :, :1]


def delta_rule(q, k, v, beta, log_gate=None, state=None, backend: str = "torch"):
    """The gated delta rule by ``backend`` ('torch' or 'fla', ``resolve_delta_backend``): the chunked form for a
    chunk of tokens, the recurrent form for one (decoding). Returns (outputs, final state) in float32 (float64
    inputs: float64)."""
    n = q.shape[-2]
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, beta, log_gate, state))
    which = resolve_delta_backend(backend, q.device, needs_grad, n)
    if which == "torch":
        fn = delta_rule_recurrent if n == 1 else delta_rule_chunked
        return fn(q, k, v, beta, log_gate, state)
    out, final = delta_rule_fla(q, k, v, beta, log_gate, state, recurrent=which == "fla-recurrent")
    return out.to(work_dtype(q.dtype)), final.to(work_dtype(q.dtype))
