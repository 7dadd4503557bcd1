"""kind 'delta': the gated delta rule (Gated DeltaNet, arXiv:2412.06464) beside an exact sliding window and sinks.

Why: an additive kernel state S = sum phi(k) v^T cannot hold a 5-digit passkey over 1,000 tokens (a SmolLM2-135M
retrofit with every head linear-time retrieved 1 / 1 / 0 of 10 passkeys at 1k / 2k / 4k tokens, for elu,
polysketch and hedgehog alike). The delta rule overwrites what a key holds instead of adding to it
(``ops/delta.py``): S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, read o_t = S_t^T q_t, with q and k
L2-normalised per head, so a stored key read back by the same direction returns its value. Before the norm: the
optional short convolution (``short_conv``), then the optional feature map (``delta_feature_map``: 'identity', the
default, keeps the model's own q, k, whose cosine is its RoPE-relative score as Gated DeltaNet's normalised q, k;
or a registered map such as elu, relu, taylor, hedgehog: the study's kernels). Per kv head, one F x d state (F =
head_dim, or the map's features) read by its G query heads.

* write strength b_t = sigmoid(v_t . w_b + c_b) per kv head, from the token's value as the 'gate' decay reads it
  (RoPE rotates k, so a linear map of k would weigh the same token differently at each position); w_b = 0 and
  c_b = logit(``delta_beta_init``) at the start: b = 0.5 for every token by default;
* gate a_t: the library's ``decay`` ('none': a = 1, plain DeltaNet; 'scalar'; 'gate': sigmoid(v_t . w + b), the
  Gated DeltaNet form, initial horizon ``decay_horizon``), a_t = 1 at padded keys;
* padded keys write nothing (b = 0, a = 1): left padding changes no real row.

How the delta part and the exact window combine (``window`` > 0): the window (+ ``sinks``, ``learned_sinks``) is
the model's own softmax over its recent keys, a convex combination of values with its own normaliser; the delta
read-out is not a kernel sum and has no mass to share a normaliser with (S^T q is a value-sized vector, positive or
negative). So the two are added, the delta read-out scaled by a learned factor m per query head:

    o_i = softmax-window_i(q, k, v) + m_h S_i^T q^_i,        m_h = ``delta_mix_init`` (0) at the start

With m = 0 a converted model computes exactly its window + sinks model (StreamingLLM, the training-free baseline,
which the retrofit must not start below); the gradient of m is the delta read-out's agreement with the output's
error, so training opens the delta part where it helps (at m = 0 the delta parameters get their gradients from the
second step on, as a zero-initialised LoRA factor does). The delta state holds the window's keys and the sinks too
(every real key is written once, as in Gated DeltaNet); nothing is counted twice in any normaliser. Without a
window the output is the delta read-out alone (a Gated DeltaNet layer without its output norm and gate, which need
the hidden state this function never sees).

Decoding keeps the d x d state per kv head (``RecurrentState.kv``), the window's keys and sinks, and the short
convolution's last inputs: constant size. ``delta_backend='fla'`` runs fla-core's Triton kernels (CUDA; the pinned
[fla] extra); the default 'torch' is the chunked PyTorch path (chunks of 64 tokens) on every device.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from ..ops.base import AttentionBase
from ..ops.common import to_work, work_dtype
from ..ops.delta import delta_rule, l2_normalise
from ..ops.feature_maps import FEATURE_MAPS, selectable_feature_maps
from ..ops.reference import reference_delta
from ..registry import KindSpec, Option, register_kind
from ._kernel import conv_label, conv_memory, decay_label, max_horizon_label, sink_label, window_memory
from .sliding_window import SlidingWindowAttention


class DeltaAttention(SlidingWindowAttention):
    """The gated delta rule (+ the exact window and sinks of ``SlidingWindowAttention`` when ``window`` > 0)."""

    def __init__(self, config, num_heads: int, head_dim: int, num_kv_heads: int | None = None, layer_idx: int = 0):
        super().__init__(config, num_heads, head_dim, num_kv_heads, layer_idx)
        # b_t = sigmoid(v_t . beta_weight + beta_bias) per kv head: one state per kv head, one write strength
        self.beta_weight = nn.Parameter(torch.zeros(self.num_kv_heads, head_dim))
        self.beta_bias = nn.Parameter(torch.zeros(self.num_kv_heads))
        if config.window:
            # m per query head on the delta read-out beside the window (module doc)
            self.delta_mix = nn.Parameter(torch.zeros(self.num_kv_heads, self.groups, 1, 1))
        # the map on q and k before the L2 norm (not ``feature_map``: a kernel kind's map reads beyond the window)
        self.delta_map = None
        name = config.options["delta_feature_map"]
        if name != "identity":
            cls = FEATURE_MAPS[name]
            self.delta_map = cls(self.num_kv_heads, head_dim) if cls.per_head else cls(head_dim)
        self._reset_delta()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        self._reset_delta()

    @torch.no_grad()
    def _reset_delta(self) -> None:
        opts = self.config.options
        b = opts["delta_beta_init"]
        self.beta_weight.zero_()
        self.beta_bias.fill_(math.log(b / (1.0 - b)))
        if self.config.window:
            self.delta_mix.fill_(opts["delta_mix_init"])

    @classmethod
    def softcap_refusal(cls, config, layer_idx: int, num_kv_heads: int, exact_elsewhere: bool = False) -> str | None:
        # its own paths (the delta read-out beside the window, its decoding) are not written for a cap: refused as a
        # kind that applies none
        return AttentionBase.softcap_refusal.__func__(cls, config, layer_idx, num_kv_heads, exact_elsewhere)

    def choose_path(self, q_len: int, kv_len: int, causal: bool) -> str:
        return "delta"

    def _recurrent_path(self) -> str:
        return "delta"

    def write_strengths(self, v5: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """b_t (B, Hkv, 1, L) of the keys whose values are v5 (B, Hkv, 1, L, D): sigmoid(v_t . w_b + c_b), 0 at padded
        keys (mask False): a padded key writes nothing."""
        dt = work_dtype(v5.dtype)
        z = torch.matmul(v5.to(dt), self.beta_weight.to(dt).view(-1, 1, v5.shape[-1], 1)).squeeze(-1)
        beta = torch.sigmoid(z + self.beta_bias.to(dt).view(-1, 1, 1))
        return beta if mask is None else torch.where(mask[:, None, None, :], beta, 0.0)

    def run_path(self, path, q5, k5, v5, mask, causal, scale, kv0, raw, tf32=None, sinks=None):
        """(output, the delta state after the call's keys (``_next_state`` stores it), None, None). q5, k5: the
        queries and keys after the short convolution; ``raw`` the model's own, which the window scores."""
        if not causal:
            raise ValueError("kind='delta' is causal only: the delta rule writes each key into a state that only later "
                             "queries read; pick a bidirectional kind for an encoder")
        lq, lk = q5.shape[3], k5.shape[3]
        # the keys not in the state yet: all of them on a first call; after one, the call's own (lq == their number)
        # behind the window's keys, which the state holds already
        new = lk if kv0 is None else lq
        kn, vn = k5[..., lk - new :, :], v5[..., lk - new :, :]
        mn = None if mask is None else mask[:, lk - new :]
        beta = self.write_strengths(vn, mn)
        logs = self.log_gates(vn, mn)
        q, kn = to_work(q5, kn)
        if self.delta_map is not None:
            q, kn = self.delta_map(q, True), self.delta_map(kn, False)
        q = l2_normalise(q)
        if lq < new:  # causal rows bottom-right aligned: the first keys have no query in this call
            q = F.pad(q, (0, 0, new - lq, 0))
        k = l2_normalise(kn)
        if mn is not None:
            k = k * mn[:, None, None, :, None].to(k.dtype)
        (v,) = to_work(vn)
        out, state = delta_rule(q, k, v, beta, logs, kv0, backend=self.config.options["delta_backend"])
        out = out[..., new - lq :, :]
        if self.config.window:
            window, *_ = super().run_path("window", raw[0], raw[1], v5, mask, causal, scale, kv0, raw, tf32,
                                          sinks=sinks)
            out = window + self.delta_mix.to(out.dtype) * out
        return out, state, None, None

    def _next_state(self, state, key, value, key_mask, k5, v5, mask, fk, vext, path, flags=None):
        """The window's keys and sinks as the sliding window keeps them, and the delta state ``fk`` (``run_path``'s
        second result) in ``kv``."""
        kept = super()._next_state(state, key, value, key_mask, k5, v5, mask, None, vext, path, flags)
        return replace(kept, kv=fk)


def _validate(config) -> None:
    if config.sparse_cache:
        raise ValueError(f"kind='delta' does not take sparse_cache={config.sparse_cache}: the sparse cache (LoLA) "
                         "picks the keys an additive kernel state recalls worst and scores them under the window's "
                         "normaliser, and the delta read-out is neither (it overwrites what a key holds and is added "
                         "to the window's output); use a kernel kind (linear, polysketch, performer, taylor)")
    if not config.window and config.options["delta_mix_init"] != 0.0:
        raise ValueError(f"delta_mix_init={config.options['delta_mix_init']} is the initial factor on the delta "
                         "read-out beside the exact window: it needs window > 0 (without a window the output is the "
                         "delta read-out alone)")


def _label(config) -> str:
    parts = ["gated delta rule" if config.decay != "none" else "delta rule"]
    if config.decay == "scalar":
        parts.append(decay_label("scalar decay", f"horizon {config.decay_horizon:g}", max_horizon_label(config)))
    elif config.decay == "gate":
        parts.append(decay_label("gated decay", f"horizon {config.decay_horizon:g}", max_horizon_label(config)))
    if config.window:
        parts.append(f"exact softmax {config.window}-token sliding window" + sink_label(config)
                     + f", delta read-out mixed in from {config.options['delta_mix_init']:g}")
    if config.options["delta_feature_map"] != "identity":
        parts.append(f"{config.options['delta_feature_map']} features")
    if config.short_conv:
        parts.append(conv_label(config))
    return ", ".join(parts)


def _memory(config) -> str:
    extra = f" plus {window_memory(config)}" if config.window else ""
    features = "head_dim" if config.options["delta_feature_map"] == "identity" else "features"
    return (f"Generation keeps a constant-size delta-rule state per layer ({features} x head_dim per kv head)" + extra
            + conv_memory(config) + " instead of a growing key/value cache (`hf_polyattn.PolyAttnCache`, picked by "
            "`generate()`).")


SPEC = register_kind(KindSpec(
    name="delta",
    module=DeltaAttention,
    title="gated delta rule (Gated DeltaNet: Yang, Kautz and Hatamizadeh, arXiv:2412.06464) beside an exact sliding "
          "window with attention sinks",
    reference=reference_delta,
    causal=True,
    bidirectional=False,
    cross_attention=False,
    fields=("window", "sinks", "sink_position", "sink_span", "learned_sinks", "decay", "decay_horizon",
            "decay_max_horizon", "short_conv"),
    options={
        "delta_mix_init": Option(0.0, "initial factor m on the delta read-out added to the exact window's output, per "
                                      "query head (learned; needs window > 0): 0 starts the model as its window + "
                                      "sinks (StreamingLLM) and lets training open the delta part"),
        "delta_beta_init": Option(0.5, "initial write strength b of every token (sigmoid(v . w_b + c_b) per kv "
                                       "head, w_b = 0 at the start): the share of a key's old value the delta rule "
                                       "replaces by the new one", minimum=1e-3, maximum=1 - 1e-3),
        "delta_feature_map": Option("identity", "the map on q and k before their L2 norm: 'identity' (Gated "
                                                "DeltaNet's normalised q, k; the model's own scores as cosines) or a "
                                                "registered feature map (elu, relu, taylor, hedgehog: its features "
                                                "make the state's width)",
                                    choices=("identity", *selectable_feature_maps())),
        "delta_backend": Option("torch", "the delta rule's implementation: 'torch' (chunks of 64 tokens in PyTorch, "
                                         "every device) or 'fla' (fla-core's Triton kernels, CUDA: pip install "
                                         "'hf_polyattn[fla]')", choices=("torch", "fla")),
    },
    # named alone (attn_implementation="delta"): StreamingLLM's 4 sinks and a 128-token window, Gated DeltaNet's gate
    defaults={"window": 128, "sinks": 4, "decay": "gate"},
    validate=_validate,
    label=_label,
    memory=_memory,
    bench={"delta-window128": dict(kind="delta", window=128, sinks=4, decay="gate")},
))
