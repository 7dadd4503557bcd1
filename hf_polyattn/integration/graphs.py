"""Decoding steps replayed from a CUDA graph: ``capture_decode(model, max_length)``.

On a GPU a small model's decoding step is bound by launching its operations, not by their arithmetic. The demo's
retrofit (SmolLM2-135M, 22 of 90 kv heads softmax) launched about 12,400 aten operations a step against the softmax
base's 4,416, at about 13.5 us of host time each, while the GPU's kernels took 12.8 against 6.0 ms: 177.8 against
59.0 ms a token at 32k tokens on an H200 (recipes/results/SECTION_gpu_h200.md, second run). A CUDA graph records a
step's kernels once and replays them with one launch; the host then spends its time on the replay alone.

A graph replays the same kernels on the same memory, so a replayed step may not depend on any Python value that
changes between tokens. ``capture_decode`` makes a cache's states static once it reaches a state where every later
step takes the same branches:

* the windowed kernel heads' ``WindowRing`` (``ops/decode.py``) reads and writes its slot through a device index
  (``WindowRing.make_static``), once the ring is full and the sinks are filled (``steady``);
* the softmax heads of a hybrid layer (``HybridState.make_static``, ``ops/hybrid.py``) get buffers of
  ``max_length`` positions; a step writes its key at a device index and attends over the whole buffer with the
  positions after it masked;
* the token ids and positions go into fixed tensors, copied in before each replay.

Each call of the model then takes one of three ways: an ordinary eager forward (a prompt, a padded batch, a step
before the states are steady, another cache, gradients), a static step run eagerly (the first one on a cache: it
makes the states static and warms up what a graph must not meet for the first time), or a replay (the graph is
recorded on the first replay of a cache). ``DecodeGraphs.counts`` says how many calls took each. The Python side of
a replayed step (each state's token count and ring slot) is advanced by ``advance`` instead of the step's code.

``capture_decode`` needs CUDA; the same static steps run eagerly anywhere (``DecodeGraphs(..., record=False)``),
which is how the CPU tests check them against ordinary decoding, token by token.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..ops import HybridAttention, HybridState, PolyAttention
from ..ops.decode import WindowRing, ring_decodes
from .cache import PolyAttnCache, PolyAttnCacheLayer, cache_layers
from .compatibility import CACHE_ARGUMENT
from .registry import STATIC_CALL

__all__ = ["DecodeGraphs", "capture_decode"]

# keyword arguments a replayed call may carry (with any value the checks in ``_static_call`` accept); any other one
# with a value other than None / False sends the call to the eager forward
_CALL_KEYS = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                        "logits_to_keep", "return_dict", "cache_position", "inputs_embeds", "output_attentions",
                        "output_hidden_states"})


def _layer_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot decode from graphs (a layer whose state never becomes static), or None."""
    attention = [m for m in model.modules() if "polyattn" in m._modules or "polyattn_sliding" in m._modules]
    if not attention:
        return (f"{type(model).__name__} has no polyattn attention layer: convert it first (hf_polyattn.convert) or "
                "load a retrofitted checkpoint")
    if len(attention) != len(cache_layers(model.config)):
        return (f"{type(model).__name__} has {len(cache_layers(model.config))} decoder layers and {len(attention)} "
                "polyattn attention layers: a layer of another type (a convolution, a state-space mixer) keeps a "
                "cache that is not made static")
    for m in attention:
        layer = getattr(m, "layer_idx", "?")
        if "polyattn_sliding" in m._modules:
            return (f"layer {layer} is kept as an exact sliding-window softmax layer (sliding_layers='exact'): its "
                    "cache is not made static")
        pa = m._modules["polyattn"]
        kernel = pa.kernel if isinstance(pa, HybridAttention) else pa
        if kernel is not None and not ring_decodes(kernel):
            cfg = kernel.config
            return (f"layer {layer} decodes with the generic recurrent step (kind={cfg.kind!r}, window={cfg.window}, "
                    f"learned_sinks={cfg.learned_sinks}, short_conv={cfg.short_conv}): only layers that decode on a "
                    "WindowRing (a sliding window, no learned sinks, no short convolution, ops.decode.ring_decodes) "
                    "or exact softmax heads are made static")
        if isinstance(kernel, PolyAttention) and kernel.config.sparse_cache:
            return (f"layer {layer} keeps a sparse cache (sparse_cache={kernel.config.sparse_cache}): its selection "
                    "moves keys by Python indices, so its steps are not made static")
    return None


def _ring(state) -> WindowRing | None:
    if isinstance(state, WindowRing):
        return state
    return state.kernel if isinstance(state, HybridState) else None


def _counters(state) -> tuple:
    """(token count, ring slot, ring token count) of a layer state: the Python values one step changes."""
    ring = _ring(state)
    return state.length, None if ring is None else ring.head, None if ring is None else ring.length


class DecodeGraphs:
    """The forward ``capture_decode`` installs on a model (module docstring). ``record``: record CUDA graphs (a CUDA
    model); False runs the static steps eagerly (any device), with the Python side of each step checked against
    ``advance``. ``counts``: calls taken by the eager forward ('eager'), by a static step run eagerly ('static'), by
    a replay ('replayed'), and graphs recorded ('recorded')."""

    def __init__(self, model: nn.Module, max_length: int, *, record: bool = True):
        self.model, self.max_length, self.record = model, max_length, record
        self.forward = model.forward  # the model's own (bound) forward
        params = inspect.signature(self.forward).parameters
        self.cache_arg = CACHE_ARGUMENT  # the installed transformers' name of the forward's cache argument
        self.extra = {}
        if "logits_to_keep" in params:
            self.extra["logits_to_keep"] = 1
        self.takes_cache_position = "cache_position" in params
        self.counts = {"eager": 0, "static": 0, "replayed": 0, "recorded": 0}
        self.cache = self.graph = self.output = self.ids = self.positions = self.mask = None
        functools.update_wrapper(self, self.forward)  # inspect.signature(model.forward) reads the model's

    # -------------------------------------------------------------------------------------------- the call
    def __call__(self, *args, **kwargs):
        call = self._static_call(args, kwargs)
        if call is None:
            self.counts["eager"] += 1
            return self.forward(*args, **kwargs)
        ids, cache, positions = call
        if cache is not self.cache or not self._still_static(cache):
            self.release()
            for layer in cache.layers:
                if isinstance(layer.state, HybridState):
                    layer.state.make_static(self.max_length)
                else:
                    layer.state.make_static()
            self.cache = cache
            self.ids, self.positions = ids.clone(), positions.clone()
            self.mask = torch.ones_like(ids)
            self.counts["static"] += 1
            if not self.record:
                return self._static_forward()
            # eagerly, the warm-up a graph must follow, on a side stream as torch.cuda.graph's own recording runs
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._static_forward()
            torch.cuda.current_stream().wait_stream(side)
            return out
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        if self.graph is None and self.record:
            self._capture()
        self.counts["replayed"] += 1
        if self.record:
            self.graph.replay()
            self._advance()
        else:
            self._emulate()
        out = self.output.__class__(**self.output)
        out["logits"] = self.output.logits.clone()  # the graph's own buffer is overwritten by the next replay
        return out

    def release(self) -> None:
        """Forget the recorded graph and its cache (their memory is freed with them)."""
        self.cache = self.graph = self.output = self.ids = self.positions = self.mask = None

    # -------------------------------------------------------------------------------------------- the checks
    def _static_call(self, args, kwargs):
        """(ids (B, 1), the cache, positions (B, 1)) when this call can take a static step, else None."""
        if len(args) > 1 or torch.is_grad_enabled() or any(
                k not in _CALL_KEYS and v is not None and v is not False for k, v in kwargs.items()):
            return None
        ids = args[0] if args else kwargs.get("input_ids")
        cache = kwargs.get(self.cache_arg)
        if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1
                or kwargs.get("inputs_embeds") is not None or kwargs.get("use_cache") is False
                or kwargs.get("output_attentions") or kwargs.get("output_hidden_states")
                or kwargs.get("logits_to_keep") not in (None, 0, 1) or kwargs.get("return_dict") is False
                or not isinstance(cache, PolyAttnCache)):
            return None
        if self.record and ids.device.type != "cuda":
            return None
        if not cache.layers:
            return None
        for layer in cache.layers:
            state = layer.state if isinstance(layer, PolyAttnCacheLayer) else None
            if not isinstance(state, (WindowRing, HybridState)) or not state.steady:
                return None
            if isinstance(state, HybridState) and state.length + 1 > self.max_length:
                return None  # no room left: the eager forward grows the buffers
        mask = kwargs.get("attention_mask")
        # the layers read the new token's column only (the past is in the states: padded keys kept by a softmax
        # head make its state unsteady); one host sync: a padded new token takes the eager forward
        if mask is not None and (mask.dim() != 2 or not bool(mask[:, -1].all())):
            return None
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.full_like(ids, cache.get_seq_length())
        elif positions.shape != ids.shape:
            return None
        return ids, cache, positions

    def _still_static(self, cache) -> bool:
        """Whether every state of ``cache`` is the static one the graph was recorded on (an eager call in between
        may have replaced one: a multi-token call, a step with a padded row)."""
        return all(layer.state.at is not None and (_ring(layer.state) is None or _ring(layer.state).at is not None)
                   for layer in cache.layers)

    # -------------------------------------------------------------------------------------------- the steps
    def _static_forward(self):
        """The model's forward on the fixed inputs. The attention mask is a fixed (B, 1) of ones: given no mask,
        some models make one of the length so far (OPT: a new shape every token) or look for padding in the ids
        (``warn_if_padding_and_no_attention_mask``: a host sync); the mask function answers None throughout
        (``registry.STATIC_CALL``), as it does for an unpadded call."""
        kwargs = {self.cache_arg: self.cache, **self.extra}
        if self.takes_cache_position:
            kwargs["cache_position"] = self.positions[0]
        token = STATIC_CALL.set(True)
        try:
            return self.forward(input_ids=self.ids, position_ids=self.positions, attention_mask=self.mask,
                                use_cache=True, **kwargs)
        finally:
            STATIC_CALL.reset(token)

    def _snapshot(self) -> list:
        """Each layer's state object and the Python values a step changes (its token count, its ring's slot and
        token count; a layer of softmax heads alone has no ring)."""
        return [(layer, layer.state, *_counters(layer.state)) for layer in self.cache.layers]

    @staticmethod
    def _restore(snapshot: list) -> None:
        for layer, state, length, head, ring_length in snapshot:
            layer.state = state
            state.length = length
            if (ring := _ring(state)) is not None:
                ring.head, ring.length = head, ring_length

    def _advance(self) -> None:
        for layer in self.cache.layers:
            layer.state.advance()

    def _capture(self) -> None:
        """Record one static step (the recording runs the step's Python but no kernel: every state's Python values
        are put back after it)."""
        snapshot = self._snapshot()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                output = self._static_forward()
        except RuntimeError as err:
            self._restore(snapshot)
            self.release()
            raise RuntimeError(f"capture_decode: recording {type(self.model).__name__}'s decoding step as a CUDA graph "
                               f"failed ({str(err).splitlines()[0]}); decode without it "
                               "(hf_polyattn.capture_decode(model, enabled=False))") from err
        self._restore(snapshot)
        self.graph, self.output = graph, output
        self.counts["recorded"] += 1

    def _emulate(self) -> None:
        """A replay without a graph (``record=False``): the static step run, its Python effects undone and replaced
        by ``_advance``, which must leave every state as the step's own code did (AssertionError otherwise)."""
        snapshot = self._snapshot()
        self.output = self._static_forward()
        after = [_counters(layer.state) for layer in self.cache.layers]
        self._restore(snapshot)
        self._advance()
        advanced = [_counters(layer.state) for layer in self.cache.layers]
        if advanced != after:
            raise AssertionError(f"DecodeGraphs.advance left the states at {advanced}, the step at {after}")


def capture_decode(model: nn.Module, max_length: int | None = None, *, enabled: bool = True) -> DecodeGraphs | None:
    """Decode ``model`` (a CUDA polyattn model) from CUDA graphs (module docstring): ``generate()`` and direct
    single-token calls with a ``PolyAttnCache`` replay a recorded step once every state is steady. ``max_length``:
    the most tokens (prompt and generated) a sequence reaches, the positions the softmax heads' buffers hold
    (default ``config.max_position_embeddings``); a longer sequence goes on eagerly. ``enabled=False`` puts the
    model's own forward back. Returns the installed ``DecodeGraphs`` (its ``counts``), or None when disabled.
    ValueError for a model on another device, or with a layer whose state is never made static."""
    if not isinstance(enabled, bool):
        raise TypeError(f"capture_decode: enabled must be True or False, got {enabled!r}")
    installed = model.__dict__.get("forward")
    if isinstance(installed, DecodeGraphs):
        installed.release()
        del model.forward
    if not enabled:
        return None
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"capture_decode records CUDA graphs: the model is on {device.type!r}; move it to a CUDA "
                         "device first (on a CPU the eager decoding step is the one to use)")
    if max_length is None:
        max_length = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise ValueError(f"capture_decode: max_length must be an int >= 2 (the most tokens a sequence reaches), got "
                         f"{max_length!r}")
    refusal = _layer_refusal(model)
    if refusal:
        raise ValueError(f"capture_decode: {refusal}")
    graphs = DecodeGraphs(model, max_length)
    model.forward = graphs
    return graphs
