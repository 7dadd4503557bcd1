"""What the kernel kinds (polynomial, polysketch, linear, performer, sliding window) share in their specs."""

from __future__ import annotations

# Shared PolyAttnConfig fields every kernel kind reads: the q/k maps before the kernel (the short causal
# convolution, the projection, the LayerNorm), the block size of the causal product, its implementation, and the
# normaliser's offset.
KERNEL_FIELDS = ("short_conv", "qk_norm", "feature_proj", "block_size", "backend", "denominator_offset")
# The exact local part beside a linear-time kernel: diagonal blocks or a sliding window.
# sinks / learned_sinks: keys attended exactly beside the window (ops/window.py).
# sparse_cache / sparse_chunk / sparse_observe(_pool) / sparse_score / sparse_value_keys(_pool): the bounded sparse
# cache beside the window
# (ops/sparse.py).
LOCAL_FIELDS = ("local_exact", "local_kernel", "window", "window_mix", "window_mix_init", "sinks", "sink_position",
                "sink_span", "learned_sinks", "sparse_cache", "sparse_chunk", "sparse_observe", "sparse_observe_pool",
                "sparse_score", "sparse_value_keys", "sparse_value_pool", "causal_algorithm")
# Decay of a linear-time kernel's state (RetNet's scalar gamma, GLA-style gates): the kinds with a kernel state.
DECAY_FIELDS = ("decay", "decay_horizon", "decay_max_horizon")


# where the sinks are scored (PolyAttnConfig.sink_position), in a label
_SINK_POSITION_LABELS = {"window": "positions within the window", "own": "their own positions"}


def sink_position_label(config) -> str:
    """Where the sinks are scored, in words: 'positions within the window', 'their own positions', or with
    ``sink_span`` 'positions at most 1024 back'."""
    if config.sink_position == "window" and config.sink_span:
        return f"positions at most {config.sink_span} back"
    return _SINK_POSITION_LABELS[config.sink_position]


def sink_label(config) -> str:
    """' + 4 sink tokens (positions within the window) + 8 learned sink slots': what a window attends exactly besides
    its keys ('' for none)."""
    return "".join(f" + {n} {what}{'s' if n > 1 else ''}{detail}" for n, what, detail in (
        (config.sinks, "sink token", f" ({sink_position_label(config)})"),
        (config.learned_sinks, "learned sink slot", "")) if n)


def max_horizon_label(config) -> str:
    """'memory at most 256 tokens' for a bounded decay (``decay_max_horizon``), else ''."""
    return f"memory at most {config.decay_max_horizon:g} tokens" if config.decay_max_horizon else ""


def decay_label(name: str, *details: str) -> str:
    """'gated decay (horizon 256, memory at most 512 tokens)': ``name`` and its non-empty details in brackets."""
    details = [d for d in details if d]
    return f"{name} ({', '.join(details)})" if details else name


def window_memory(config) -> str:
    """What a decoding state keeps for the exact part of a window: the last w keys, the s sinks."""
    keys = f"the last {config.window} keys and values (the exact sliding window)"
    if config.sinks:
        keys = (f"the first {config.sinks} and the last {config.window} keys and values ({config.sinks} attention "
                f"sinks, scored at {sink_position_label(config)}, + the exact sliding window: "
                f"{config.sinks + config.window} keys)")
    return keys


def local_label(config) -> list[str]:
    """The label parts of the exact local part, projection and LayerNorm of a kernel kind."""
    parts = []
    if config.local_exact:
        parts.append(f"exact {config.resolved_local_kernel} {config.block_size}-token blocks")
    if config.window:
        parts.append(f"exact {config.resolved_local_kernel} {config.window}-token sliding window"
                     + (" (mixed)" if config.window_mix else "") + sink_label(config))
    if config.sparse_cache:
        observe = (f", chosen again at a prompt's end by its last {config.sparse_observe} queries (pooled over "
                   f"{config.sparse_observe_pool})" if config.sparse_observe else "")
        score = {"relative": ", relative recall error", "attention": ", ranked by the attention of the last "
                 f"{config.sparse_chunk} queries"}.get(config.sparse_score, "")
        heavy = (f", {config.sparse_value_keys} of them the largest |v| (pooled over {config.sparse_value_pool})"
                 if config.sparse_value_keys else "")
        parts.append(f"sparse cache of {config.sparse_cache} keys (LoLA, blocks of {config.sparse_chunk}{score}"
                     f"{heavy}{observe})")
    if config.decay == "scalar":
        parts.append(decay_label("scalar decay", f"horizon {config.decay_horizon:g}", max_horizon_label(config)))
    elif config.decay == "gate":
        parts.append(decay_label("gated decay", max_horizon_label(config)))
    if config.short_conv:
        parts.append(conv_label(config))
    if config.feature_proj:
        parts.append(f"learnable projection to {config.feature_proj}")
    if config.qk_norm:
        parts.append("qk LayerNorm")
    return parts


def conv_label(config) -> str:
    """'causal depthwise conv of 4 taps on q, k': the short convolution's label part."""
    return f"causal depthwise conv of {config.short_conv} taps on q, k"


def conv_memory(config) -> str:
    """' and the last 3 queries and keys of the short convolution' ('' without one)."""
    if config.short_conv <= 1:
        return ""
    n = config.short_conv - 1
    return f" and the last {n} quer{'ies' if n > 1 else 'y'} and key{'s' if n > 1 else ''} of the short convolution"


def kernel_memory(config) -> str:
    """The model card's sentence on generation memory for a linear-time kernel kind."""
    extra = f" plus the keys of the current {config.block_size}-token block" if config.local_exact else ""
    if config.window:
        extra = f" plus {window_memory(config)}"
    if config.sparse_cache:
        extra += (f", the {config.sparse_cache} keys and values per kv head of the sparse cache and up to "
                  f"{config.sparse_chunk - 1} keys of the block waiting for selection")
    extra += conv_memory(config)
    return ("Generation keeps a constant-size recurrent state per layer" + extra
            + " instead of a growing key/value cache (`hf_polyattn.PolyAttnCache`, picked by `generate()`).")
