"""A model's RoPE for the ops side: where ``sink_position='window'`` re-rotates the queries that score the sinks.

The keys reach the attention function already rotated at their own positions (RoPE is applied before it), so the
sinks of a RoPE model can only be moved to positions within the window by re-rotating the queries
(``ops/rotary.py``, ``ops/window.py``). For that the module needs the model's inverse frequencies: read here once
per attention module, at convert / construction, through transformers' own RoPE initialisation (the model's
``<Name>RotaryEmbedding.compute_default_rope_parameters`` for rope_type 'default', ``ROPE_INIT_FUNCTIONS`` for the
others), and set on the module as an ``ops.rotary.RopeRotation``.

Read for the model types whose RoPE is the rotate_half form on the leading 2F head dims (:data:`ROTATE_HALF`) and
the rope types whose frequencies are fixed (:data:`STATIC_ROPE_TYPES`). A model without RoPE (GPT-2, BERT: positions
added to the input embeddings) has nothing to re-rotate: no rotation, 'window' then scores the sinks as 'own' does.
Everything else (another rotation layout such as GPT-J's interleaved pairs, an unknown model type or rope type,
frequencies that change with the length) is refused with a ValueError naming ``sink_position='own'``: a silent
fallback would score the sinks at their own positions under a setting that says otherwise.
"""

from __future__ import annotations

import importlib

import torch

from ..config import PolyAttnConfig
from ..ops.rotary import RopeRotation

__all__ = ["ROTATE_HALF", "STATIC_ROPE_TYPES", "model_rope", "reads_rope", "uses_rope"]

# model_type -> its rotary embedding class (transformers.models.<type>.modeling_<type>): rotate_half RoPE, applied to
# q and k before the attention function (GPT-NeoX to its leading partial_rotary_factor of each head)
ROTATE_HALF = {"llama": "LlamaRotaryEmbedding", "mistral": "MistralRotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding",
               "gpt_neox": "GPTNeoXRotaryEmbedding"}
# rope types (config.rope_parameters["rope_type"]) whose inverse frequencies are computed once, from the config.
# Refused: 'dynamic' (NTK scaling recomputed from the longest position of each forward) and 'longrope' (short or long
# factors by the current length): the queries' rotations would have to follow the model's current frequencies.
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
# config attributes that only a model with rotary positions has
_ROPE_ATTRIBUTES = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_dim", "rotary_pct", "rotary_emb_base")


def reads_rope(cfg: PolyAttnConfig) -> bool:
    """Whether modules of ``cfg`` re-rotate queries for their sinks: sinks scored at positions within the window."""
    return bool(cfg.sinks) and cfg.sink_position == "window"


def uses_rope(config) -> bool:
    """Whether a transformers config describes rotary positions (on q and k) rather than positions added to the
    input (GPT-2, BERT) or none."""
    return (any(getattr(config, name, None) is not None for name in _ROPE_ATTRIBUTES)
            or getattr(config, "position_embedding_type", None) == "rotary")


def _refusal(config, why: str) -> ValueError:
    return ValueError(f"sink_position='window' re-rotates the queries that score the attention sinks with the "
                      f"model's RoPE, and {why} (model_type={getattr(config, 'model_type', None)!r}). Pass "
                      "sink_position='own' to score the sinks at their own positions (StreamingLLM without its "
                      "positions within the cache), or sinks=0")


def model_rope(config, head_dim: int) -> RopeRotation | None:
    """The RoPE of a transformers attention module's ``config`` (head size ``head_dim``) as a ``RopeRotation``, None
    for a model without rotary positions; ValueError (naming sink_position='own') for one it cannot read."""
    if not uses_rope(config):
        return None
    model_type = getattr(config, "model_type", None)
    if model_type not in ROTATE_HALF:
        raise _refusal(config, f"hf_polyattn reads the rotate_half RoPE of {sorted(ROTATE_HALF)} only (another "
                       "layout, such as GPT-J's interleaved pairs, would be rotated wrongly)")
    params = getattr(config, "rope_parameters", None)
    rope_type = params.get("rope_type") if isinstance(params, dict) else None
    if not isinstance(rope_type, str):
        raise _refusal(config, f"config.rope_parameters={params!r} names no single rope_type")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise _refusal(config, f"rope_type={rope_type!r} changes its frequencies with the sequence length "
                       "(not supported)")
    if rope_type not in STATIC_ROPE_TYPES:
        raise _refusal(config, f"rope_type={rope_type!r} is not one it can read ({list(STATIC_ROPE_TYPES)})")
    if rope_type == "default":
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        init = getattr(modeling, ROTATE_HALF[model_type]).compute_default_rope_parameters
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS[rope_type]
    with torch.device("cpu"):  # from_pretrained builds the model on the meta device: the frequencies are real
        inv_freq, _ = init(config)
    inv_freq = inv_freq.detach().cpu()
    if inv_freq.dim() != 1 or not 0 < 2 * inv_freq.numel() <= head_dim:
        raise _refusal(config, f"its {tuple(inv_freq.shape)} inverse frequencies do not fit a head of "
                       f"{head_dim} dims")
    return RopeRotation(inv_freq, 2 * inv_freq.numel())
