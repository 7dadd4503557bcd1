"""PolyAttnConfig: the settings of one attention, validated when built.

The shared fields (degree, window, block_size, ...) are dataclass fields; a kind's own
options live in ``options``, declared by the kind (``hf_polyattn.registry``). Which shared
fields a kind reads, its defaults and its cross-field checks come from its ``KindSpec``:
nothing here names a kind. Pure Python (no torch, no transformers) at import, so that
``hf_polyattn.ops`` and the integration layer can both import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import registry
from .validation import check_bool, check_choice, check_coefficients, check_float, check_head_pairs, check_int

SKETCHES = ("gaussian", "srht", "learned")
LOCAL_KERNELS = ("polynomial", "softmax")
EXACT_PATHS = ("auto", "quadratic", "tensor")
CAUSAL_ALGORITHMS = ("block", "cumsum")
BACKENDS = ("auto", "loop", "batched", "triton", "fla")
DECAYS = ("none", "scalar", "gate")
SINK_POSITIONS = ("window", "own")
SLIDING_LAYERS = ("exact", "kind")
SOFTCAP_MODES = ("refuse", "exact_parts")
DECAY_HORIZON = 1024.0  # decay_horizon's default, in tokens
SPARSE_SCORES = ("recall", "relative", "attention")
SPARSE_CHUNK = 64  # sparse_chunk's default, in keys: the selection's granularity (ops/sparse.py)
# Shared fields every kind reads (the others are read by the kinds whose KindSpec.fields name them).
EVERY_KIND_FIELDS = ("seed", "softmax_heads")
# Settings that are read only while another one is on: field -> whether this config has it on. __post_init__ refuses
# each one at a value other than its default while its gate is off, so a config with the gate off computes the same
# attention whatever the field says; read_settings (a model card's list) leaves it out. Every ``sparse_*`` field,
# sparse_cache itself included, is gated on sparse_cache > 0 (``_read_when``), new ones too.
READ_WHEN = {
    "local_kernel": lambda c: bool(c.local_exact or c.window),
    "window_mix": lambda c: bool(c.window),
    "window_mix_init": lambda c: bool(c.window and c.window_mix),
    "sinks": lambda c: bool(c.window),
    "learned_sinks": lambda c: bool(c.window),
    "sink_position": lambda c: bool(c.window and c.sinks),
    "sink_span": lambda c: bool(c.window and c.sinks and c.sink_position == "window"),
    "decay_horizon": lambda c: c.decay != "none",
    "decay_max_horizon": lambda c: c.decay != "none",
    "sparse_observe_pool": lambda c: bool(c.sparse_cache and c.sparse_observe),
    "sparse_value_pool": lambda c: bool(c.sparse_cache and c.sparse_value_keys),
}


def _read_when(name: str, config: PolyAttnConfig) -> bool:
    """Whether ``config``'s attention reads the field ``name`` (``READ_WHEN``; the sparse cache's fields only with a
    sparse cache)."""
    if name in READ_WHEN:
        return READ_WHEN[name](config)
    if name.startswith("sparse_"):
        return bool(config.sparse_cache)
    return True

# Allowed values of every str field and the minimum of every int field: __post_init__
# validates each field by its annotation, so a new field without an entry here fails loudly.
_CHOICES: dict[str, tuple[str, ...]] = {
    "sketch": SKETCHES,
    "local_kernel": LOCAL_KERNELS,
    "exact_path": EXACT_PATHS,
    "causal_algorithm": CAUSAL_ALGORITHMS,
    "backend": BACKENDS,
    "decay": DECAYS,
    "sink_position": SINK_POSITIONS,
    "sliding_layers": SLIDING_LAYERS,
    "softcap_mode": SOFTCAP_MODES,
    "sparse_score": SPARSE_SCORES,
}
# Shared fields that change what a kind computes when set: a kind that does not read one refuses it (KindSpec.fields).
_SWITCHES = ("local_exact", "local_kernel", "window", "window_mix", "window_mix_init", "sinks", "sink_position",
             "sink_span", "learned_sinks", "qk_norm", "feature_proj", "alpha", "beta", "denominator_offset",
             "poly_coefficients", "learn_coefficients", "feature_map", "decay", "decay_horizon", "decay_max_horizon",
             "short_conv", "sparse_cache", "sparse_chunk", "sparse_observe", "sparse_observe_pool", "sparse_score",
             "sparse_value_keys", "sparse_value_pool")
_INT_MINIMUM = {"degree": 1, "sketch_size": 1, "num_features": 1, "block_size": 1, "max_tensor_features": 1, "seed": 0,
                "window": 0, "sinks": 0, "sink_span": 0, "learned_sinks": 0, "feature_proj": 0, "short_conv": 0,
                "sparse_cache": 0, "sparse_chunk": 1, "sparse_observe": 0, "sparse_observe_pool": 1,
                "sparse_value_keys": 0, "sparse_value_pool": 1}
# ops.attention.layer_seed reduces seed * 1_000_003 modulo 2**62: a larger seed would silently draw the
# sketches / features of a smaller one (2**62 those of 0).
_INT_MAXIMUM = {"seed": 2**62 - 1}


def _choices(name: str) -> tuple[str, ...]:
    if name == "feature_map":  # any registered map, a user's too: read when validating (imports the ops)
        from .ops.feature_maps import selectable_feature_maps

        return tuple(selectable_feature_maps())
    return _CHOICES[name]


_CHECKS = {
    "bool": lambda name, value: check_bool(name, value),
    "int": lambda name, value: check_int(name, value, _INT_MINIMUM[name], _INT_MAXIMUM.get(name)),
    "float": check_float,
    "str": lambda name, value: check_choice(name, value, _choices(name)),
    "tuple[float, ...]": check_coefficients,
}
# softmax_heads: (layer, kv_head) pairs, checked against the model at convert / from_pretrained time
_CHECKS["tuple[tuple[int, int], ...]"] = check_head_pairs


@dataclass
class PolyAttnConfig:
    """Settings of a polynomial / PolySketch / linear / Performer attention.

    Polynomial attention replaces exp(q.k) by (q.k)^p (PolySketchFormer, arXiv:2310.01655;
    Kacham, Mirrokni, Zhong); polysketch approximates it with phi(x) = (x^{(p/2)} S)^{(2)}
    in linear time; linear is Katharopoulos et al. (arXiv:2006.16236); performer is FAVOR+
    (Choromanski et al., arXiv:2009.14794).
    """

    kind: str = field(
        default="polysketch",
        metadata={"help": "attention kind: a registered name (`hf-polyattn kinds` lists them, "
                          "hf_polyattn.register_kind adds one)"},
    )
    degree: int = field(
        default=4,
        metadata={"help": "polynomial degree p: even for 'polynomial', a power of two for 'polysketch'"},
    )
    sketch: str = field(default="gaussian", metadata={"help": f"polysketch sketch, one of {list(SKETCHES)}"})
    sketch_size: int = field(default=32, metadata={"help": "polysketch sketch size r (r(r+1)/2 features)"})
    feature_map: str = field(
        default="elu",
        metadata={"help": "linear feature map: elu, relu, taylor, hedgehog or one added with "
                          "hf_polyattn.ops.register_feature_map"},
    )
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
    window_mix_init: float = field(
        default=1.0,
        metadata={"help": "initial value of the window_mix factors (>= 0; the factor is used as |m|, so the kernel "
                          "part never turns negative). 1 = the plain sum; a small value starts the model as its window "
                          "(+ sinks) alone and lets training add the kernel part where it helps: SmolLM2-135M with 22 "
                          "softmax kv heads, 4 sinks, a 128 window and a gated polysketch kernel, 30 transfer steps at "
                          "1k tokens ended at per-layer MSE 0.046 (1k perplexity 56.2) from mix 1, while the window "
                          "alone has MSE 0.0068 (33.2)"})
    sinks: int = field(
        default=0,
        metadata={
            "help": "attention sinks (StreamingLLM, Xiao et al., arXiv:2309.17453): the first this many real keys of "
            "each row are attended exactly (local_kernel) by every later query, under the window's normaliser, and "
            "left out of the kernel part; decoding keeps them beside the window (s + w keys). Causal only; needs "
            "window > 0; 0 = off"
        },
    )
    sink_position: str = field(
        default="window",
        metadata={
            "help": "where RoPE models score the attention sinks: 'window' = StreamingLLM's positions within the cache "
            "(its Section 3.2): a query with p real tokens before it in its row scores the sinks as if it sat at "
            "min(p, window + sinks - 1), so sink j sits window + sinks - 1 - j positions before it, just beyond the "
            "window (window keys, learned slots and the kernel part keep the real query); 'own' = the sinks' own "
            "positions 0..sinks-1, thousands of tokens away from a late query. Measured on SmolLM2-135M, 2026-11-24, "
            "first 8,192 held-out Tiny Shakespeare tokens, 4 sinks + 128 window, perplexity per 1k tokens: 'own' "
            "[50.1, 29.0, 33.5, 32.4, 31.2, 50.9, 62.4, 67.1], 'window' [50.1, 28.9, 33.4, 32.2, 29.1, 37.7, 45.9, "
            "36.9], softmax [43.9, 23.5, 24.7, 25.4, 21.4, 26.0, 35.3, 26.6]. Models without RoPE (GPT-2, BERT: "
            "positions added at the input) have nothing to re-rotate: both give the same outputs there. 'own' needs "
            "sinks > 0. sink_span moves the 'window' position further out"
        },
    )
    sink_span: int = field(
        default=0,
        metadata={
            "help": "with sink_position='window' on a RoPE model, the farthest position a query scores the sinks "
            "from: a query with p real tokens before it scores them as if it sat at min(p, sink_span), so sink j "
            "sits up to sink_span - j positions before it (a query is never moved forward). 0 = window + sinks - 1, "
            "StreamingLLM's rule (the sinks just beyond the window); a larger span puts them between that and "
            "their own positions ('own'). Needs sinks > 0, sink_position='window' and sink_span >= window + sinks "
            "- 1 (no sink scored closer than the window's oldest key). Models without RoPE: no effect"
        },
    )
    learned_sinks: int = field(
        default=0,
        metadata={
            "help": "learnable key/value slots per kv head (Lizard's meta-memory, arXiv:2507.09025) that every query "
            "attends exactly under the window's normaliser, never masked; keys and values start at zero. Needs "
            "window > 0; 0 = off"
        },
    )
    decay: str = field(
        default="none",
        metadata={
            "help": "decay of the kernel part, causal only (the exact local part is never decayed): 'none'; "
            "'scalar' (RetNet, simple GLA: key j weighs gamma^(i-j) for query i, one learnable gamma per kv head); "
            "'gate' (GLA-style: prod_{t=j+1..i} g_t with g_t = sigmoid(v_t . w + b) per kv head, read from the "
            "token's value, which RoPE leaves unrotated); kind 'delta': the gate a_t of its state"
        },
    )
    decay_horizon: float = field(
        default=DECAY_HORIZON,
        metadata={
            "help": "initial horizon of the decay in tokens (> 1): 'scalar' starts at log gamma = -1/horizon, "
            "'gate' at the constant gate 1 - 1/horizon (w = 0, b = log(horizon - 1))"
        },
    )
    decay_max_horizon: float = field(
        default=0.0,
        metadata={
            "help": "the longest memory the decayed kernel state may keep, in tokens (> 1; 0 = no bound): every "
            "log-gate (log gamma for 'scalar') capped at -1/decay_max_horizon, a gate at most 1 - ~1/that. Learned "
            "gates of a model trained on 1k-token windows drift to horizons of 4k-70k tokens, which only longer "
            "contexts exercise (recipes/results/SECTION_retrieval.md); the cap keeps the state's statistics at every "
            "length those of a window it was trained on. Applied at every call, trained or not"
        },
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
    short_conv: int = field(
        default=0,
        metadata={
            "help": "kernel size of a causal depthwise convolution over the sequence on q and k before the kernel's "
            "feature map (LAWCAT, arXiv:2509.18467; Gated DeltaNet): each channel of each head mixes its own last "
            "short_conv inputs, padded positions zeroed first; weights per layer, head and channel start as the "
            "identity (last tap 1), so a converted model computes what it computed without it until trained. The "
            "exact window and sinks keep the model's own q, k. Decoding keeps the last short_conv - 1 inputs per "
            "layer (constant memory). 0 = off"
        },
    )
    sparse_cache: int = field(
        default=0,
        metadata={
            "help": "bounded sparse cache (LoLA, McDermott et al., arXiv:2505.23666): beside the sliding window and "
            "the kernel state, each kv head keeps this many past keys and values exactly (scored like window keys, "
            "under the window's normaliser), the ones the kernel state recalls worst (the error |v - phi(k) S / "
            "phi(k) z| of what the state returns for the key); the others are folded into the state. Selected at "
            "absolute blocks of sparse_chunk real keys once a whole block has left the window (until then its keys "
            "stay exact), so the forward over a whole sequence, chunked prefill and decoding compute the same "
            "outputs. Constant memory: sparse_cache + sparse_chunk - 1 keys per kv head beside the window. Causal "
            "only; needs window > 0 and a kernel kind; adds no parameters (a trained model takes it without "
            "training: hf_polyattn.reconfigure, or --set without --kind). 0 = off"
        },
    )
    sparse_score: str = field(
        default="recall",
        metadata={
            "help": "how the sparse cache's streaming selection ranks a candidate: 'recall' LoLA's error |v - phi(k) "
            "S / phi(k) z|; 'relative' that error over |v|; 'attention' the softmax weight it draws (the model's "
            "own q, k, over the candidates) from the sparse_chunk queries before the selection, summed over them "
            "and the kv head's query heads, plus 0.9 times its score when last kept (an H2O / TOVA-like rule; the "
            "decoding state keeps those queries and scores). Under 'recall' the keys with the smallest values lose "
            "first (with an empty state the error is |v|), and keys that draw much attention but carry little value "
            "(sink-like tokens) are among them: on SmolLM2-135M's linear-only retrofit, evicting 64 of 3,904 "
            "keys per head that way broke a 4k 'vault' passkey that a random eviction of 64 kept "
            "(recipes/results/retrieval/diag). Needs sparse_cache > 0"
        },
    )
    sparse_chunk: int = field(
        default=SPARSE_CHUNK,
        metadata={
            "help": "the sparse cache's selection granularity in real keys: a block of this many keys becomes "
            "candidate for the cache once all of it has left the window (needs sparse_cache > 0)"
        },
    )
    sparse_observe: int = field(
        default=0,
        metadata={
            "help": "the sparse cache chosen again by a prompt's question (SnapKV's observation window, Li et al., "
            "arXiv:2404.14469): in every call of more than one query (a prefill), each of its last sparse_observe "
            "real queries reads a cache chosen anew from every key that was a candidate up to it (the cache the call "
            "started with and every non-sink key of the blocks that left the window), the sparse_cache keys that the "
            "observed queries from the first of them up to it attend most (their softmax weights over the "
            "candidates, summed over the queries and the kv head's query heads, max-pooled over sparse_observe_pool "
            "neighbours); the other candidates are folded into the kernel state, decayed as the streaming selection "
            "folds them. Causal: a query's choice reads no later query. The last query's choice is the state the "
            "call leaves (decoding goes on from it); the streaming selection runs inside the call and between calls. "
            "The outputs depend on where calls end (one call over prompt and answer re-chooses only at its end). "
            "Needs sparse_cache > 0. 0 = off"
        },
    )
    sparse_observe_pool: int = field(
        default=15,
        metadata={
            "help": "sparse_observe's max-pooling width over neighbouring candidates (odd): a chosen key keeps the "
            "keys around it (a 7-digit key is 7 tokens; a width of 7 kept the first 4 of them)"
        },
    )
    sparse_value_keys: int = field(
        default=0,
        metadata={
            "help": "of the sparse cache's sparse_cache keys, this many are the candidates of largest value norm "
            "|v| (per kv head, pooled over sparse_value_pool neighbours), whatever sparse_score or sparse_observe "
            "rank them: a memory that neither recency nor the last queries decide, so a key that nothing has asked "
            "for yet stays for a question that comes in a later turn. Why |v|: in SmolLM2-135M's softmax heads that "
            "read a passkey needle most when asked, the needle's key tokens rank above 81-92% of a 4k-8k document's "
            "keys by |v|, and below 74-93% of them by the attention that later text gives them (what "
            "sparse_score='attention' ranks by; recipes/results/later_question/needle_ranks_*.json). The rest of the "
            "budget is chosen as before. Needs sparse_cache > 0; at most sparse_cache. 0 = off"
        },
    )
    sparse_value_pool: int = field(
        default=5,
        metadata={
            "help": "sparse_value_keys' max-pooling width over neighbouring candidates (odd): a heavy key brings the "
            "keys around it (a number's digits and the space token before them, which the answer's first query "
            "reads)"
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
            "help": "causal product implementation: 'auto' (on CUDA triton when installed; batched on other "
            "accelerators, loop on CPU), 'loop', "
            "'batched', 'triton' or 'fla' (CUDA: fla-core's chunk kernels for the kernel part, decayed or not, of "
            "identity features (linear / performer), FlexAttention for a softmax window) forces one; env "
            "HF_POLYATTN_BACKEND overrides 'auto'"
        },
    )

    # Selective hybrid (DuoAttention's retrieval heads, Xiao et al. 2024, arXiv:2410.10819): these kv heads keep
    # exact softmax attention and a full KV cache, the other heads run the kind.
    softmax_heads: tuple[tuple[int, int], ...] | None = field(
        default=None,
        metadata={
            "help": "(layer, kv_head) pairs that stay exact softmax attention, with a full KV cache when decoding (all "
            "G query heads of each such kv head); the other heads run the kind, whose module is built for them only. "
            "JSON: [[layer, kv_head], ...]; command line: --set softmax_heads=6:0,7:2 or =@scores.json (`hf-polyattn "
            "score-heads` ranks the heads). None = every head runs the kind"
        },
    )

    sliding_layers: str = field(
        default="exact",
        metadata={
            "help": "what the model's own sliding-window layers become (config.layer_types 'sliding_attention': Gemma "
            "2 / 3, OLMo 3, EXAONE 4, Qwen2 with use_sliding_window, ModernBERT's local layers; or sliding_window on "
            "every layer: Mistral): 'exact' keeps them as the model computes them, softmax over each query's last "
            "sliding_window keys (already linear time; decoding keeps those keys), and only the full-attention "
            "layers get the kind; 'kind' converts them too (the kind then attends beyond the window). A model whose "
            "every layer is sliding needs 'kind' to be converted at all. No effect on models without sliding layers "
            "(hf_polyattn.integration.layer_layout(model) lists which layers are which)"
        },
    )

    softcap_mode: str = field(
        default="refuse",
        metadata={
            "help": "what a converted layer does with a model's attention logit soft-capping (Gemma 2: every score s "
            "q.k becomes c tanh(s q.k / c), attn_logit_softcapping c = 50): 'refuse' (convert refuses a layer whose "
            "kind has a part that forms no score to cap: the kernel part phi(q).phi(k)); 'exact_parts' applies the "
            "cap wherever the layer forms a score (the sliding window, the sinks and learned slots, local_exact "
            "blocks, softmax heads, the sparse cache's exact keys) and leaves the kernel part beyond them to "
            "approximate the capped softmax (attention transfer trains it against the capped model). A layer with no "
            "exact part (no window, no local_exact, no softmax heads there) is refused either way: nothing would "
            "apply the cap. Layers without soft-capping, and sliding layers kept exact (which apply it), are the "
            "same under both"
        },
    )

    options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "the kind's own options (declared by its KindSpec), e.g. {'num_landmarks': 32} for "
                          "nystrom; missing ones take their defaults"},
    )

    def __post_init__(self) -> None:
        spec = registry.get_kind(self.kind)  # ValueError listing the registered kinds
        self._check_types()
        self.options = registry.check_options(spec, self.options)
        spec.validate(self)  # the kind's own cross-field checks, with its own messages
        self._check_unread_fields(spec)
        if self.local_exact and self.causal_algorithm == "cumsum":
            raise ValueError("local_exact needs causal_algorithm='block' (the exact part lives in the diagonal blocks)")
        if self.window:
            if self.local_exact:
                raise ValueError("window and local_exact are two forms of the exact local part (sliding vs "
                                 "block-diagonal): set one of them")
            if self.causal_algorithm == "cumsum":
                raise ValueError("window needs causal_algorithm='block'")
        if self.decay == "none" and self.decay_horizon != DECAY_HORIZON:
            raise ValueError(f"decay_horizon={self.decay_horizon} needs decay='scalar' or 'gate' (it is the "
                             "initial horizon of the decay)")
        if not self.decay_horizon > 1.0:
            raise ValueError(f"decay_horizon must be a real number > 1 (tokens: the initial 1/(1 - gamma)), got "
                             f"{self.decay_horizon}")
        if self.decay_max_horizon and not self.decay_max_horizon > 1.0:
            raise ValueError(f"decay_max_horizon must be 0 (no bound) or a real number > 1 (tokens: the longest "
                             f"memory, log-gates capped at -1/decay_max_horizon), got {self.decay_max_horizon}")
        if self.decay == "none" and self.decay_max_horizon:
            raise ValueError(f"decay_max_horizon={self.decay_max_horizon} needs decay='scalar' or 'gate' (it bounds "
                             "the decay's memory)")
        if self.sparse_chunk != SPARSE_CHUNK and not self.sparse_cache:
            raise ValueError(f"sparse_chunk={self.sparse_chunk} needs sparse_cache > 0 (it is the sparse cache's "
                             "selection granularity)")
        if self.sparse_score != "recall" and not self.sparse_cache:
            raise ValueError(f"sparse_score={self.sparse_score!r} needs sparse_cache > 0 (it ranks the sparse cache's "
                             "candidates)")
        if self.sparse_observe and not self.sparse_cache:
            raise ValueError(f"sparse_observe={self.sparse_observe} needs sparse_cache > 0 (it chooses the sparse "
                             "cache's keys by a prompt's last queries)")
        if self.sparse_observe_pool != 15 and not self.sparse_observe:
            raise ValueError(f"sparse_observe_pool={self.sparse_observe_pool} needs sparse_observe > 0 (it is its "
                             "max-pooling width)")
        if self.sparse_value_keys and not self.sparse_cache:
            raise ValueError(f"sparse_value_keys={self.sparse_value_keys} needs sparse_cache > 0 (it reserves part of "
                             "the sparse cache for the keys of largest |v|)")
        if self.sparse_value_keys > self.sparse_cache:
            raise ValueError(f"sparse_value_keys must be at most sparse_cache={self.sparse_cache} (the share of the "
                             f"cache it reserves), got {self.sparse_value_keys}")
        if self.sparse_value_pool != 5 and not self.sparse_value_keys:
            raise ValueError(f"sparse_value_pool={self.sparse_value_pool} needs sparse_value_keys > 0 (it is its "
                             "max-pooling width)")
        if self.sparse_value_pool % 2 == 0:
            raise ValueError(f"sparse_value_pool must be an odd number >= 1 (a window centred on each key), got "
                             f"{self.sparse_value_pool}")
        if self.sparse_observe_pool % 2 == 0:
            raise ValueError(f"sparse_observe_pool must be an odd number >= 1 (a window centred on each key), got "
                             f"{self.sparse_observe_pool}")
        if self.sparse_cache:
            if not self.window:
                raise ValueError(f"sparse_cache={self.sparse_cache} needs window > 0: the cache holds keys that "
                                 "left the exact sliding window, scored under its normaliser (LoLA), got window=0")
            if self.backend != "auto":
                raise ValueError(f"sparse_cache={self.sparse_cache} computes its kernel part in its own block loop "
                                 f"(PyTorch, every device): backend must stay 'auto', got {self.backend!r}")
        if self.window_mix and not self.window:
            raise ValueError("window_mix needs window > 0 (it weights the kernel part beyond the window)")
        if self.window_mix_init < 0:
            raise ValueError(f"window_mix_init must be a real number >= 0, got {self.window_mix_init}")
        if self.window_mix_init != 1.0 and not self.window_mix:
            raise ValueError("window_mix_init sets the window_mix factors: it needs window_mix=True")
        if self.sink_position != "window" and not self.sinks:
            raise ValueError(f"sink_position={self.sink_position!r} needs sinks > 0 (it places the attention sinks), "
                             "got sinks=0")
        if self.sink_span:
            if not self.sinks or self.sink_position != "window":
                raise ValueError(f"sink_span={self.sink_span} needs sinks > 0 and sink_position='window' (it moves "
                                 "where the re-rotated sinks are scored; 0 = off), got sinks="
                                 f"{self.sinks}, sink_position={self.sink_position!r}")
            if self.sink_span < self.window + self.sinks - 1:
                raise ValueError(f"sink_span must be 0 or >= window + sinks - 1 = {self.window + self.sinks - 1} "
                                 "(a sink is never scored closer than the window's oldest key), got "
                                 f"{self.sink_span}")
        for name in ("sinks", "learned_sinks"):
            if getattr(self, name) and not self.window:
                raise ValueError(f"{name}={getattr(self, name)} needs window > 0 (sink keys are attended exactly "
                                 "beside the sliding window, under its normaliser), got window=0")
        if self.local_kernel is not None and not (self.local_exact or self.window):
            raise ValueError(f"local_kernel={self.local_kernel!r} needs local_exact=True or window > 0 "
                             "(it is the kernel of the exact local part)")
        if self.beta == 0.0:
            raise ValueError("beta must be a non-zero finite real number, got 0.0")
        if self.denominator_offset < 0:
            raise ValueError(f"denominator_offset must be a finite real number >= 0, got {self.denominator_offset}")
        if self.denominator_offset and self.resolved_local_kernel == "softmax":
            raise ValueError("denominator_offset is not allowed with exp-based weights (performer, softmax local "
                             "blocks): their per-query stabiliser would change its meaning")
        if self.poly_coefficients is not None:
            if not self.poly_coefficients or all(c == 0 for c in self.poly_coefficients):
                raise ValueError("poly_coefficients must hold at least one non-zero coefficient a_0..a_D")
        elif self.learn_coefficients:
            raise ValueError("learn_coefficients needs poly_coefficients (the initial a_0..a_D)")

    def _check_unread_fields(self, spec) -> None:
        """A switch the kind does not read must stay off: a set value would be silently ignored. (Sizes of other
        kinds, such as sketch_size or block_size, are tolerated: configs and checkpoints carry every field.)"""
        for f in dataclasses.fields(self):
            if f.name not in _SWITCHES or f.name in spec.fields:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if getattr(self, f.name) != default:
                hint = ""
                if self.kind == "sliding_window" and f.name.startswith("sparse_"):
                    # the sparse cache lives in the kernel kinds' layer; the training-free softmax form is built there
                    hint = (" (the sparse cache on exact softmax over sinks + window + selected keys, training-free: "
                            "hf_polyattn.eval.long_context.matched_memory_config, `hf-polyattn eval --baselines "
                            "sparse`)")
                raise ValueError(f"kind={self.kind!r} does not read {f.name} (it reads {list(spec.fields)} and its "
                                 f"options {sorted(spec.options)}): leave {f.name}={default!r}{hint}")

    @classmethod
    def for_kind(cls, kind: str, **overrides: Any) -> PolyAttnConfig:
        """The settings of ``kind`` named alone: the shared defaults, the kind's own (``KindSpec.defaults``),
        then ``overrides``; an override named like one of the kind's options goes to ``options``."""
        spec = registry.get_kind(kind)
        options = dict(overrides.pop("options", None) or {})
        for name in list(overrides):
            if name in spec.options:
                options[name] = overrides.pop(name)
        return cls(kind=kind, **{**spec.defaults, **overrides}, options=options)

    @property
    def spec(self) -> registry.KindSpec:
        """The kind's registry entry."""
        return registry.get_kind(self.kind)

    def _check_types(self) -> None:
        """Validate (and normalise: ints to int, reals to float, coefficients to a tuple) every field by its
        annotation, so that no option can be silently misread (``"no"`` as True, NaN as a number)."""
        for f in dataclasses.fields(self):
            if f.name in ("kind", "options"):  # checked against the registry
                continue
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
    def max_log_gate(self) -> float | None:
        """The largest log-gate ``decay_max_horizon`` allows (-1 / it), or None without a bound."""
        return -1.0 / self.decay_max_horizon if self.decay_max_horizon else None

    @property
    def resolved_sink_span(self) -> int:
        """The farthest position a query scores the sinks from with ``sink_position='window'`` (RoPE models): query i
        is re-rotated to min(p_i, this), p_i the real keys before it; ``sink_span``, or window + sinks - 1 when 0."""
        return self.sink_span if self.sink_span else self.window + self.sinks - 1

    @property
    def resolved_local_kernel(self) -> str | None:
        """The kernel of the exact local part actually used (blocks or window), or None without one."""
        if not (self.local_exact or self.window):
            return None
        if self.local_kernel is not None:
            return self.local_kernel
        # blocks: the paper's mixed mode for polysketch; windows: softmax (LoLCATs; the PEERS.md
        # probe: 62.6 perplexity with a 64-token softmax window vs 95.3 without on SmolLM2)
        return self.spec.block_kernel if self.local_exact else "softmax"

    @property
    def is_linear_time(self) -> bool:
        return self.spec.linear_time

    def read_settings(self) -> dict[str, Any]:
        """The settings this kind reads, JSON-ready: ``kind``, the shared fields its ``KindSpec.fields`` names, those
        every kind reads (``EVERY_KIND_FIELDS``) and its own ``options``; the fields it ignores are left out (a model
        card shows these), and ``softcap_mode`` where it is not the default. ``from_dict`` of it gives a config that
        computes the same attention. A field read only while another is on (``READ_WHEN``: the sparse cache's
        fields without a sparse cache, the decay's horizons without a decay, ...) is left out while that one is off.
        """
        d = self.to_dict()
        out = {name: d[name] for name in dict.fromkeys(("kind", *self.spec.fields, *EVERY_KIND_FIELDS))
               if _read_when(name, self)}
        if self.softcap_mode != "refuse":  # only where set: the cards of models without soft-capping stay as they were
            out["softcap_mode"] = self.softcap_mode
        if "options" in d:
            out["options"] = d["options"]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["poly_coefficients"] is not None:
            d["poly_coefficients"] = list(d["poly_coefficients"])
        if d["softmax_heads"] is not None:
            d["softmax_heads"] = [list(pair) for pair in d["softmax_heads"]]
        if not d["options"]:
            del d["options"]  # the kinds without options write the config.json they always wrote
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
