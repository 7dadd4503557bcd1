"""A model's RoPE for the ops side: where ``sink_position='window'`` re-rotates the queries that score the sinks.

The keys reach the attention function already rotated at their own positions (RoPE is applied before it), so the
sinks of a RoPE model can only be moved to positions within the window by re-rotating the queries
(``ops/rotary.py``, ``ops/window.py``). For that each attention module needs its model's rotation: which head dims
pair with which, and at what frequency each pair turns. It is read here once per kind of attention module (at
convert / construction) from the model's own code, never from a list of model types:

1. **the rotary embedding**: a fresh ``<Name>RotaryEmbedding(config)`` from the module's own modeling module (the
   class the model builds; Gemma 3's per-layer-type one with the layer's type) gives cos/sin at any positions. Its
   frequencies must not change with the length of a call: 'dynamic' NTK scaling and 'longrope' recompute them when
   a call reaches beyond the original context (``dynamic_rope_update``), so a key rotated early and a query rotated
   late would not share one R(delta); that is found by calling it once with short and once with far positions and is
   refused.
2. **the layout**: the ``apply_rotary_pos_emb`` the module calls (``_rotation_function``: its own hub-kernel
   wrapper where transformers gives it one, else the modeling module's function; kernelize may replace the
   wrapper's forward after this reading, and the module's next call reads it again: ``rotation_source``) applied to
   the basis vectors e_0 .. e_(d-1) with those cos/sin gives the model's R(p) column by column, exactly: every
   rotated dim turns with exactly one partner (rotate_half: t with t + F; GPT-J, Cohere, GLM: 2t with 2t + 1),
   dims it leaves alone are the partial rotary's pass-through; a yarn/llama3 ``attention_scaling`` multiplies cos
   and sin and cancels in R(p + d) R(p)^-1. The frequency of each pair is its angle at position 1, refined at a far
   position and snapped to the rotary embedding's own ``inv_freq`` buffer (where it has one: GPT-J keeps a sin/cos
   table instead).
3. **the module itself**: a copy of the attention module (random weights; the real ones are never touched) is run
   on one hidden state at positions 0 .. 4,095 and the queries it hands the attention function are captured. The
   rotation read in 1-2 must turn its query at p into its query at p' for every pair of positions, both ways. That
   is what decides: q/k norms before RoPE (Qwen3, OLMo 2, Gemma 3), a partial rotary that the module splits itself
   (Phi, StableLM, GPT-J: the leading dims), a layer that applies no RoPE (SmolLM3's every fourth layer: None,
   nothing to re-rotate), and anything this reading does not reproduce (a rotation after a norm, rotated dims
   elsewhere in the head, DeepSeek's MLA) is refused.

A model without RoPE (GPT-2, BERT, OPT: positions added to the input embeddings) has nothing to re-rotate: no
rotation, 'window' then scores the sinks as 'own' does. Every refusal is a ValueError naming ``sink_position='own'``:
a silent fallback would score the sinks at their own positions under a setting that says otherwise.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import sys

import torch
from torch import nn

from ..config import PolyAttnConfig
from ..ops.rotary import RopeRotation

__all__ = ["kernel_repositories", "model_rope", "reads_rope", "rotation_source", "uses_rope"]

# config attributes that only a model with rotary positions has
_ROPE_ATTRIBUTES = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_dim", "rotary_pct", "rotary_emb_base")
# positions the module is probed at: small ones (angles of order 1 on the fast pairs) and far ones (the slow pairs
# turn measurably: at 4,095 a pair of frequency 1e-4 turns 0.4 rad), up to the config's max_position_embeddings - 1
_PROBE_POSITIONS = (0, 1, 2, 3, 7, 31, 100, 517, 2048, 4095)
# a position beyond every context length a config names, for the length check (at least this far)
_FAR = 1 << 15
# max |R(p' - p) q_p - q_p'| / max |q| allowed between the module's own queries: float32 angles at position 4,095 are
# off by up to 4095 * 2^-24 = 2.4e-4 rad (the model's own rounding, on both sides); a wrong pairing, frequency or
# offset is off by O(1)
_TOLERANCE = 2e-3
_PROBE_NAME = "polyattn_rope_probe"  # registered for the probe copies' config only (never a model's)
_CACHE: dict = {}  # probe signature -> RopeRotation | None | ValueError message


def reads_rope(cfg: PolyAttnConfig) -> bool:
    """Whether modules of ``cfg`` re-rotate queries for their sinks: sinks scored at positions within the window."""
    return bool(cfg.sinks) and cfg.sink_position == "window"


def uses_rope(config) -> bool:
    """Whether a transformers config describes rotary positions (on q and k) rather than positions added to the
    input (GPT-2, BERT) or none."""
    return (any(getattr(config, name, None) is not None for name in _ROPE_ATTRIBUTES)
            or getattr(config, "position_embedding_type", None) == "rotary")


class _Unreadable(Exception):
    """Why the rotation cannot be read (becomes the ValueError's reason)."""


def _refusal(config, why: str) -> ValueError:
    return ValueError(f"sink_position='window' re-rotates the queries that score the attention sinks with the "
                      f"model's RoPE, and {why} (model_type={getattr(config, 'model_type', None)!r}). Pass "
                      "sink_position='own' to score the sinks at their own positions (StreamingLLM without its "
                      "positions within the cache), or sinks=0")


def model_rope(module: nn.Module, layer_idx: int | None = None) -> RopeRotation | None:
    """The RoPE that transformers attention ``module`` (layer ``layer_idx``) applies to its queries, as a
    ``RopeRotation``; None where it applies none (a model without rotary positions, a layer without RoPE);
    ValueError (naming sink_position='own') where it cannot be read or reproduced (module docstring)."""
    config = module.config
    modeling = sys.modules.get(type(module).__module__)
    rotary_class = _rotary_class(module, modeling)
    if not (uses_rope(config) or rotary_class is not None or "position_embeddings" in _parameters(module)):
        return None  # GPT-2, BERT, OPT: no rotary positions anywhere in the model's code
    if layer_idx is None:
        layer_idx = getattr(module, "layer_idx", None)
    layer_type = _layer_type(config, layer_idx)
    key = _signature(module, layer_type)
    if key is not None and key in _CACHE:
        found = _CACHE[key]
    else:
        try:
            with torch.device("cpu"):  # from_pretrained builds the model on the meta device: the probe is real
                found = _read(module, modeling, rotary_class, layer_type)
        except _Unreadable as why:
            found = str(why)
        except Exception as err:  # noqa: BLE001 - code this reading was not written for: refused, not a traceback
            found = f"its rotation could not be read ({type(err).__name__}: {err})"
        if key is not None:
            if len(_CACHE) > 64:
                _CACHE.clear()
            _CACHE[key] = found
    if isinstance(found, str):
        raise _refusal(config, found)
    return found


# ----------------------------------------------------------------------------- finding the model's pieces
def _parameters(module: nn.Module) -> dict:
    try:
        return dict(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return {}


def _rotary_class(module: nn.Module, modeling) -> type | None:
    """The rotary embedding class of the module's modeling module: ``<Prefix>RotaryEmbedding`` for
    ``<Prefix>Attention``, else the only ``*RotaryEmbedding`` class there."""
    if modeling is None:
        return None
    found = {name: obj for name, obj in vars(modeling).items()
             if name.endswith("RotaryEmbedding") and isinstance(obj, type) and issubclass(obj, nn.Module)}
    name = type(module).__name__
    prefix = name[: name.rfind("Attention")] if "Attention" in name else None
    if prefix and f"{prefix}RotaryEmbedding" in found:
        return found[f"{prefix}RotaryEmbedding"]
    return next(iter(found.values())) if len(found) == 1 else None


def _layer_type(config, layer_idx) -> str | None:
    types = getattr(config, "layer_types", None)
    if isinstance(layer_idx, int) and isinstance(types, (list, tuple)) and 0 <= layer_idx < len(types):
        return types[layer_idx]
    return None


def _signature(module: nn.Module, layer_type: str | None):
    """What the rotation of ``module`` can depend on: its class, layer type, plain attributes (SmolLM3's
    ``use_rope``, Gemma's ``is_sliding``; not ``layer_idx``) and config. None: not hashable, read every time."""
    attrs = tuple(sorted((k, v) for k, v in vars(module).items()
                         if isinstance(v, (bool, int, float, str, type(None))) and k != "layer_idx"
                         and not k.startswith("_polyattn")))
    try:
        settings = module.config.to_dict()
        for name in ("polyattn", "_attn_implementation_internal", "attn_implementation", "auto_map"):
            settings.pop(name, None)
        return (type(module), layer_type, attrs, json.dumps(settings, sort_keys=True, default=repr),
                _module_device(module).type, rotation_source(module))
    except Exception:  # noqa: BLE001 - a config that cannot be serialised is read every time
        return None


def rotation_source(module: nn.Module) -> tuple | None:
    """Which code rotates ``module``'s queries, beyond its class: the forward each of its own hub-kernel function
    wrappers (``_rotation_function``) runs now, as functions (None for a wrapper on its Python function). kernelize
    swaps them per module (two modules of one class can rotate with different code), at any time after a rotation
    was read: ``from_pretrained``'s ``use_kernels`` at the end of loading, and every ``model.train()`` /
    ``model.eval()`` that changes the kernels' mode re-kernelizes for the model's device then. So the ``polyattn``
    module keeps this value of its reading and compares it at each call (``state._cache_pre_hook``). None for a
    module without such wrappers (transformers < 5.25, or no ``kernels`` package): its class decides."""
    funcs = module.__dict__.get("_kernel_funcs")
    if not isinstance(funcs, dict):
        return None
    return tuple(getattr(f.__dict__.get("forward"), "__func__", None) for f in funcs.values())


def kernel_repositories(module: nn.Module) -> list[str]:
    """The hub kernel (kernelize's repository) each of ``module``'s function wrappers runs, for messages."""
    funcs = module.__dict__.get("_kernel_funcs")
    if not isinstance(funcs, dict):
        return []
    return [f"{name}: {f.__dict__['_kernel_repo']!r}" for name, f in funcs.items() if "_kernel_repo" in f.__dict__]


# ----------------------------------------------------------------------------- reading
def _read(module, modeling, rotary_class, layer_type) -> RopeRotation | None:
    embed, far = (None, None) if rotary_class is None else _static_embedding(rotary_class, module.config,
                                                                                layer_type)
    table = getattr(module.config, "max_position_embeddings", None)
    last = min(far if far is not None else _FAR, table - 1 if isinstance(table, int) and table > 8 else _FAR)
    positions = [p for p in _PROBE_POSITIONS if p <= last]  # within the positions the model serves
    queries = _module_queries(module, embed, positions)  # (B, H, L, D) float64
    moved = (queries - queries[:, :, :1]).abs().amax()
    if float(moved) <= 1e-6 * float(queries.abs().amax()):
        return None  # this layer's queries do not depend on the position (NoPE): nothing to re-rotate
    if embed is None:
        raise _Unreadable("its queries depend on the position but its modeling module has no rotary embedding "
                          "class (<Name>RotaryEmbedding) to read the rotation from")
    rope = _layout(_rotation_function(module, modeling), embed, queries.shape[-1], max(positions),
                   _module_device(module))
    _check_module(rope, queries, positions)
    return rope


def _fresh_rotary(rotary_class: type, config) -> nn.Module:
    """A new instance each time: 'dynamic' and 'longrope' rewrite their buffers in the forward."""
    try:
        rotary = rotary_class(config)
    except Exception as err:  # noqa: BLE001 - the model's own code refused its config
        raise _Unreadable(f"its rotary embedding {rotary_class.__name__} cannot be built from the config "
                          f"({type(err).__name__}: {err})") from None
    return rotary.float().eval()


def _call_rotary(rotary_class: type, config, positions: list[int], layer_type: str | None):
    """The output of a fresh rotary embedding at ``positions`` (one row), as the model receives it."""
    rotary = _fresh_rotary(rotary_class, config)
    x = torch.zeros(1, 1, dtype=torch.float32)
    ids = torch.tensor([positions], dtype=torch.long)
    extra = {}
    if layer_type is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
        extra["layer_type"] = layer_type
    with torch.no_grad():
        out = rotary(x, ids, **extra)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise _Unreadable(f"its rotary embedding {rotary_class.__name__} does not return a (cos, sin) pair")
    return tuple(out)


def _static_embedding(rotary_class: type, config, layer_type):
    """(a function positions -> the rotary embedding's output there, the farthest position it serves). Refuses
    frequencies that change with the length of the call: the rows of 0 .. 7 must be the same alone and beside a far
    position (beyond every context length the config names)."""
    near = list(range(8))
    table = getattr(config, "max_position_embeddings", None)
    lengths = [table]
    params = getattr(config, "rope_parameters", None)
    for p in ([params] + list(params.values())) if isinstance(params, dict) else []:
        if isinstance(p, dict):
            lengths.append(p.get("original_max_position_embeddings"))
    lengths = [int(n) for n in lengths if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0]
    far = 2 * max([_FAR // 2, *lengths])
    alone = _call_rotary(rotary_class, config, near, layer_type)
    try:
        beside = _call_rotary(rotary_class, config, near + [far], layer_type)
    except (IndexError, RuntimeError):
        # a table of max_position_embeddings rows (GPT-J's sin/cos): fixed frequencies, positions within the table
        far = int(table) - 1 if isinstance(table, int) else 0
        if far < 8:
            raise _Unreadable(f"its rotary embedding serves no position beyond {far}") from None
        beside = _call_rotary(rotary_class, config, near + [far], layer_type)
    for a, b in zip(alone, beside):
        if not torch.allclose(a.double(), b[:, : len(near)].double(), rtol=1e-6, atol=1e-7):
            raise _Unreadable(
                f"its rotary embedding ({rotary_class.__name__}, rope_parameters={params!r}) changes its "
                f"frequencies with the length of the call (at position {far}: 'dynamic' or 'longrope' scaling), so "
                "the model itself rotates one position differently in short and long calls")

    def embed(positions: list[int]):
        return _call_rotary(rotary_class, config, positions, layer_type)

    embed.buffers = dict(_fresh_rotary(rotary_class, config).named_buffers())  # its inv_freq (``_snap``)
    return embed, far


# ----------------------------------------------------------------------------- the layout
def _split_cos_sin(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of a rotary output whose first column is position 0 (cos = the scaling, sin = 0): most models
    return (cos, sin), GPT-J (sin, cos)."""
    first, second = out
    if not first[..., 0, :].abs().any() and second[..., 0, :].abs().any():
        return second, first
    if not second[..., 0, :].abs().any() and first[..., 0, :].abs().any():
        return first, second
    raise _Unreadable("its rotary embedding's output at position 0 is not (cos, sin) = (scaling, 0)")


def _module_device(module: nn.Module) -> torch.device:
    """Where the module's weights are (a hub kernel runs on its own device only); the CPU for weights not yet
    materialised (from_pretrained builds on the meta device)."""
    return next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))


def _python_function(fn):
    """The Python function behind ``fn``: through ``functools.wraps`` wrappers (``__wrapped__``) and through the
    ``kernels`` package's function module (``use_kernel_forward_from_hub`` on a function, transformers >= 5.25: an
    ``nn.Module`` instance of signature (*args, **kwargs) whose forward calls the function it was made from, held in
    that forward's closure). None where no function is found."""
    fn = inspect.unwrap(fn)
    if inspect.isfunction(fn):
        return fn
    if isinstance(fn, nn.Module) and hasattr(fn, "kernel_layer_name"):
        inner = [cell.cell_contents for cell in (getattr(type(fn).forward, "__closure__", None) or ())
                 if inspect.isfunction(cell.cell_contents)]
        if len(inner) == 1:
            return inner[0]
    return None


def _rotation_function(module: nn.Module, modeling):
    """(what ``module`` calls as ``apply_rotary_pos_emb``, the argument names of the function it stands for, or None
    where they cannot be read).

    transformers 5.25 decorates the function with ``use_kernel_forward_from_hub("rotary_pos_emb")``, which (with the
    ``kernels`` package, a requirement from 5.25 on) makes it an ``nn.Module`` of signature (*args, **kwargs), and
    the attention class with ``use_kernelized_func``, which gives each attention module its own instance in
    ``module._kernel_funcs`` and routes the module's calls to it. ``kernelize`` (``from_pretrained(use_kernels=...)``,
    on by default in 5.25) may replace that instance's forward with a hub kernel for the module's device: the
    rotation read must be that one, so the module's own instance is what is called here, and the arguments are named
    after the Python function it was made from."""
    fn = getattr(modeling, "apply_rotary_pos_emb", None)
    if fn is None:
        raise _Unreadable("its modeling module has no apply_rotary_pos_emb to read the layout from")
    own = None
    funcs = module.__dict__.get("_kernel_funcs")
    if isinstance(funcs, dict):
        own = next((f for f in funcs.values() if type(f) is type(fn)), None)
    python = _python_function(fn)
    params = None if python is None else inspect.signature(python).parameters
    named = [p for p in (params or {}).values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not named:
        params = None  # a wrapper of signature (*args, **kwargs) without __wrapped__: called positionally
    elif "cos" not in params or "sin" not in params:
        raise _Unreadable("its apply_rotary_pos_emb takes no cos/sin arguments")
    return (own if own is not None else fn), params


def _apply_matrices(rotation, cos: torch.Tensor, sin: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """R(p) (P, width, width) of ``rotation`` (``_rotation_function``) at each of the P columns of cos/sin (1, P, W):
    column i is its image of the basis vector e_i, given as P * width rows of one head and one position, on
    ``device`` (the module's)."""
    fn, params = rotation
    n = cos.shape[1]
    basis = torch.eye(width, dtype=torch.float32).repeat(n, 1).reshape(n * width, 1, 1, width).to(device)

    def rows(t):  # (1, P, W) -> (P * width, 1, W): position j's cos/sin beside each of its basis vectors
        return t[0].repeat_interleave(width, dim=0)[:, None, :].to(device)

    with torch.no_grad():
        if params is None:
            # no Python function to name the arguments after: called as every transformers model calls it,
            # apply_rotary_pos_emb(query, key, cos, sin); _layout and _check_module verify what comes back
            out = fn(basis.clone(), basis.clone(), rows(cos), rows(sin))
        else:
            tensors = [k for k, p in params.items() if k not in ("cos", "sin") and p.default is inspect.Parameter.empty]
            out = fn(**{name: basis.clone() for name in tensors}, cos=rows(cos), sin=rows(sin))
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(out, torch.Tensor) or out.shape != basis.shape:
        raise RuntimeError("not a rotation of the whole vector")
    return out.detach().cpu().double().reshape(n, width, width).transpose(1, 2)


def _layout(rotation, embed, head_dim: int, far: int, device: torch.device) -> RopeRotation:
    """The pairs and frequencies of the model's R(p), read off the module's ``apply_rotary_pos_emb`` (``rotation``,
    module docstring, 2)."""
    near = [0, 1, 2, 3, 7]
    cos, sin = _split_cos_sin(embed(near + [far]))
    width = cos.shape[-1]
    matrices = None
    for w in dict.fromkeys((head_dim, width, 2 * width)):  # the whole head, else the rotated part the caller splits
        if w > head_dim:
            continue
        try:
            matrices = _apply_matrices(rotation, cos, sin, w, device)
            break
        except (RuntimeError, IndexError, ValueError):
            continue
    if matrices is None:
        raise _Unreadable(f"its apply_rotary_pos_emb accepts none of {head_dim}, {width} or {2 * width} head dims "
                          "with its rotary embedding's cos/sin")
    d = matrices.shape[-1]
    eye = torch.eye(d, dtype=torch.float64)
    off = (matrices[:-1] * (1 - eye)).abs().amax(0)  # off-diagonal entries over the near positions
    if not torch.equal(matrices[0] * (1 - eye), torch.zeros_like(eye)):
        raise _Unreadable("its R(0) is not diagonal")
    pairs = []
    for i in range(d):
        partners = off[i].nonzero().flatten().tolist()
        if len(partners) > 1 or (partners and off[partners[0]].nonzero().flatten().tolist() != [i]):
            raise _Unreadable(f"its rotation mixes head dim {i} with {partners} (not one partner per dim)")
        if partners and i < partners[0]:
            a, b = i, partners[0]
            if matrices[1][a, b] > 0:  # R[a, b] = -scale * sin(f) < 0 for the first dim of the pair
                a, b = b, a
            pairs.append((a, b))
    if not pairs:
        raise _Unreadable("its apply_rotary_pos_emb rotates no head dim")
    a, b = torch.tensor(pairs).T
    scale = matrices[0][a, a]
    angle = torch.atan2(matrices[:, b, a], matrices[:, a, a])  # (P, F): p f mod 2 pi
    coarse = angle[1]  # position 1: f itself (every frequency of a RoPE is below pi)
    turns = torch.round((far * coarse - angle[-1]) / (2 * math.pi))
    freq = (angle[-1] + 2 * math.pi * turns) / far
    freq = _snap(freq, embed)
    rope = RopeRotation(freq, 2 * len(pairs), torch.stack([a, b]))
    # the function itself: the matrices it gave are scale * R(p) on the pairs and 1 elsewhere, at every position read
    for j, p in enumerate(near + [far]):
        want = rope.rotate(torch.eye(d, dtype=torch.float64), torch.tensor(p)).T  # column i: R(p) e_i
        want[a] *= scale[:, None]
        want[b] *= scale[:, None]
        # float32 cos/sin of float32 angles: p * 2^-24 rad (and the model's rounding of them to float32)
        tol = (1e-5 + 2e-7 * p) * float(scale.abs().max())
        if not torch.allclose(matrices[j], want, rtol=0, atol=tol):
            raise _Unreadable(f"its apply_rotary_pos_emb at position {p} is not one rotation per pair of head dims "
                              f"(max error {float((matrices[j] - want).abs().max()):.2g})")
    return rope


def _snap(freq: torch.Tensor, embed) -> torch.Tensor:
    """The frequencies read off the rotations, replaced by the rotary embedding's own ``*inv_freq`` buffer values
    where every one of them is within 1e-5 of one (the read ones are within ~1e-7: float32 angles at 1 and far)."""
    values = [t.detach().double().flatten() for name, t in embed.buffers.items()
              if name.endswith("inv_freq") and "original" not in name and t.is_floating_point()]
    for table in values:
        nearest = (freq[:, None] - table[None, :]).abs().argmin(-1)
        if bool(((table[nearest] - freq).abs() <= 1e-5 * freq.abs() + 1e-12).all()):
            return table[nearest].float()
    return freq


# ----------------------------------------------------------------------------- the module itself
class _Captured(Exception):
    def __init__(self, query: torch.Tensor, key: torch.Tensor):
        super().__init__("captured")
        self.query, self.key = query, key


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """Registered as _PROBE_NAME: hands the probe the queries and keys the module computed, and stops its forward."""
    raise _Captured(query.detach(), key.detach())


def _probe_copy(module: nn.Module) -> nn.Module:
    """A float32 copy of ``module`` with seeded random weights (the real weights are neither read nor copied: a
    meta placeholder stands in for each in the deep copy), without its polyattn state and hooks, its own config
    copy set to the probe's attention function."""
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE_NAME, _probe_attention)
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
            for p in module.parameters()}
    for name, child in module.named_modules():
        if name.split(".")[-1] == "polyattn":
            memo[id(child)] = None
    probe = copy.deepcopy(module, memo)
    gen = torch.Generator().manual_seed(0)
    for sub in probe.modules():
        sub._forward_hooks.clear()
        sub._forward_pre_hooks.clear()
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            value = noise / math.sqrt(p.shape[-1]) if p.dim() > 1 else 1 + 0.5 * noise
            sub._parameters[name] = nn.Parameter(value, requires_grad=False)
        for name, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:  # built on the meta device: a buffer the module computes at __init__
                sub._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
    # on the module's device: a hub kernel it calls (its apply_rotary_pos_emb, _rotation_function) runs there only
    probe = probe.float().eval().to(_module_device(module))
    probe.config._attn_implementation = _PROBE_NAME
    return probe


def _module_queries(module: nn.Module, embed, positions: list[int]) -> torch.Tensor:
    """The queries (B, H, L, D) a probe copy of ``module`` hands its attention function for two hidden states, each
    at every one of ``positions``, with the model's own position embeddings there."""
    params = _parameters(module)
    probe = _probe_copy(module)
    hidden = getattr(module.config, "hidden_size", None)
    if not isinstance(hidden, int):
        raise _Unreadable("its config names no hidden_size to probe the attention module with")
    device = _module_device(module)
    states = torch.randn(2, 1, hidden, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    states = states.expand(2, len(positions), hidden).to(device)
    ids = torch.tensor([positions, positions], dtype=torch.long, device=device)
    kwargs = {"attention_mask": None}
    if embed is not None:
        emb = embed(positions)
        kwargs["position_embeddings"] = tuple(t.expand(2, *t.shape[1:]).to(device) for t in emb)
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "position_ids" in params or takes_any:
        kwargs["position_ids"] = ids
    kwargs = {k: v for k, v in kwargs.items() if k in params or takes_any}
    if "position_embeddings" in params and "position_embeddings" not in kwargs:
        raise _Unreadable("its attention module takes position_embeddings but no rotary embedding was found")
    try:
        with torch.no_grad():
            probe(states.contiguous(), **kwargs)
    except _Captured as got:
        query, key = got.query.cpu().double(), got.key.cpu().double()
    except Exception as err:  # noqa: BLE001 - the module's own forward refused the probe
        raise _Unreadable(f"its attention module could not be run on a probe ({type(err).__name__}: {err})") from None
    else:
        raise _Unreadable("its attention module did not call the attention function (AttentionInterface)")
    if query.dim() != 4 or query.shape[2] != len(positions) or not torch.isfinite(query).all():
        raise _Unreadable(f"its attention module handed the attention function queries of shape "
                          f"{tuple(query.shape)}, not (batch, heads, {len(positions)}, head_dim)")
    moved_q = float((query - query[:, :, :1]).abs().amax()) > 1e-6 * float(query.abs().amax())
    moved_k = float((key - key[:, :, :1]).abs().amax()) > 1e-6 * float(key.abs().amax())
    if moved_q != moved_k:
        raise _Unreadable("its queries and keys do not both depend on the position")
    return query


def _check_module(rope: RopeRotation, queries: torch.Tensor, positions: list[int]) -> None:
    """R(p' - p) of the module's query at p is its query at p', for every pair of probe positions, both ways."""
    if queries.shape[-1] < rope.head_dims_needed:
        raise _Unreadable(f"its queries have {queries.shape[-1]} dims, fewer than the {rope.head_dims_needed} its "
                          "apply_rotary_pos_emb rotates")
    pos = torch.tensor(positions)
    n = len(positions)
    source = queries[:, :, :, None, :].expand(*queries.shape[:3], n, queries.shape[-1])  # (B, H, from, to, D)
    turned = rope.rotate(source, (pos[None, :] - pos[:, None]))
    want = queries[:, :, None, :, :].expand_as(turned)
    error = float((turned - want).abs().amax()) / float(queries.abs().amax())
    if error > _TOLERANCE:
        raise _Unreadable(f"its attention module's queries at positions {positions} are not those rotations of each "
                          f"other as read from its rotary embedding and apply_rotary_pos_emb (max relative error "
                          f"{error:.2g}; a rotation after a norm, rotated dims elsewhere in the head, or another "
                          "rotation than apply_rotary_pos_emb's)")
