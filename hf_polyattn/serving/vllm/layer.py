"""The converted attention layer in vLLM: softmax kv heads on vLLM's paged ``Attention``, the others on a state.

``PolyAttnAttention`` replaces a decoder layer's attention module. It projects and rotates as the base model does
(vLLM's own ``QKVParallelLinear``, ``get_rope``, ``RowParallelLinear``), then:

* each softmax kv head of the layer (``config.softmax_heads``) is one vLLM ``Attention`` with one kv head and its
  query group, so every such module has the same KV-cache spec (vLLM pads page sizes of a hybrid model to one size:
  modules of 1, 2 and 3 kv heads would not divide evenly) and the KV memory holds exactly the softmax heads;
* the other heads run the checkpoint's own module (``hf_polyattn.ops``: the same code transformers runs, loaded
  with the same weights) on a per-request state kept in vLLM's state cache by ``KernelHeadsState`` (a ``MambaBase``
  layer, as vLLM's in-tree linear-attention hybrids keep theirs), packed in fixed-size buffers
  (``ops/packed.py``). Consecutive converted layers share one state layer (``servable.StatePlan``: its buffers
  stacked over them), in runs chosen so that vLLM's padding of page and group sizes wastes the least KV memory.

Each scheduled request's tokens (a prompt chunk, or one decoded token) run the module on the state unpacked from
its slot: a new request (nothing computed yet) starts from the module's ``init_state()`` whatever the slot held, and
the state after the chunk is packed back, so chunked prefill equals one long prefill and a reused slot starts
clean. A slot whose state does not hold the tokens vLLM says the request has computed is an error, never a silent
restart.

Prompt chunks run one request after another through the module (the PyTorch path, the reference). Decoding
requests whose rings are steady take one call a layer for all of them, on their slots in place (``ops.slot_step``):
the native kernel on the CPU (``ops/cpu/slot_step.c``, ``ops.cpu_kernels``), ``slot_step`` under ``torch.compile``
elsewhere or where no C compiler runs. Other rings step as one batch through ``gather_rings`` or one by one.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ...integration.rope import reads_rope
from ...ops import HybridAttention, build_attention
from ...ops.base import softmax_heads_of
from ...ops.cpu_kernels import kernel_error, run_slot_step_native, slot_step_kernel
from ...ops.packed import (
    PackedLayout,
    RingLayout,
    gather_rings,
    pack,
    pack_ring,
    ring_from_state,
    ring_steady,
    scatter_rings,
    unpack,
    unpack_ring,
)
from ...ops.rotary import RopeRotation
from ...ops.slot_step import compiled_slot_step, run_slot_step, slot_plan, slot_state
from .servable import polyattn_config, state_layout, state_plan

__all__ = ["KernelHeadsState", "PolyAttnAttention"]

# the (heads, entries, dtype, device, layout) whose compiled step ``KernelHeadsState.warm_up`` has run
_WARMED: set = set()
_WARNED: list = []  # the native step's absence said once a process
logger = logging.getLogger(__name__)

class KernelHeadsState(nn.Module, MambaBase):
    """The per-request state of the kernel heads of a run of converted layers (``servable.StatePlan``) in vLLM's
    state cache: the buffers of ``layout`` (``ops.packed``) with a leading dimension of ``per_module`` (one entry per
    layer of the run), one slot per request, bound by vLLM to ``self.kv_cache``. Each layer of the run joins with
    ``add`` and runs with ``run(..., sub)`` on its own entry."""

    def __init__(self, layout: PackedLayout | RingLayout, per_module: int, prefix: str):
        super().__init__()
        vllm_config = get_current_vllm_config()
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.layout, self.per_module, self.prefix = layout, per_module, prefix
        # sub -> (the attention module's kernel submodule, not registered twice; its kv heads; its scaling)
        self.members: dict[int, tuple[nn.Module, int, float]] = {}
        self.kv_cache = ()
        # (sub, slot) -> the WindowRing decoding on that slot's buffers: a ring object keeps the views its fused step
        # reads (made once per ring: 4.4 ms a step on SmolLM2's layer when each step unpacked a new ring, 0.7 ms on
        # the same ring); dropped whenever a prompt chunk repacks the slot
        self._rings: dict[tuple[int, int], object] = {}
        self._lists = None  # (the step's metadata, its query starts, sequence lengths and slots as lists)
        self._steady = None  # the step's leading steady decodes (``_steady_decodes``)
        self._state = None  # ``ops.slot_step.slot_state`` of the bound buffers
        self._slot_plans: dict[int, object] = {}  # sub -> its module's ``ops.slot_step.SlotPlan``, None: not served
        # (1,) index tensors of each entry and of the members' entries (a compiled step reads a tensor index)
        # normal tensors, never inference tensors: a compiled step guards on its inputs' dispatch keys
        with torch.inference_mode(False):
            self._sub_index = [torch.tensor([i]) for i in range(per_module)]
            self._member_index = torch.tensor([], dtype=torch.long)
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def add(self, sub: int, module: nn.Module, heads: int, scaling: float) -> None:
        if sub in self.members or not 0 <= sub < self.per_module:
            raise ValueError(f"{self.prefix}: entry {sub} is taken or outside 0..{self.per_module - 1}")
        self.members[sub] = (module, heads, scaling)
        with torch.inference_mode(False):
            self._member_index = torch.tensor(sorted(self.members), dtype=torch.long)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # the metadata this layer reads (query_start_loc, seq_lens, state_indices_tensor, decodes first) is the
        # linear-attention backend's
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self):
        return tuple((self.per_module, *shape) for shape in self.layout.shapes())

    def get_state_dtype(self):
        return self.layout.dtypes()

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, metadata,
            sub: int) -> None:
        """Every scheduled request's tokens through layer ``sub``'s module on its slot's state; ``output``
        (T, Hq, D) written (zero past the scheduled tokens)."""
        if self._lists is None or self._lists[0] is not metadata:  # one step's metadata: read once for the run
            self._lists = (metadata, metadata.query_start_loc.tolist(), metadata.seq_lens.tolist(),
                           metadata.state_indices_tensor.tolist())
            self._steady = None
        _, starts, seq_lens, slots = self._lists
        count = metadata.num_decodes + metadata.num_prefills
        module, heads, scaling = self.members[sub]
        layout = self.layout
        ring = isinstance(layout, RingLayout)
        stepped = self._slot_step(sub, q, k, v, output, metadata) if ring else ()
        if len(stepped) == count:  # a decoding step with every ring steady: done in one call
            if starts[count] < output.shape[0]:
                output[starts[count]:].zero_()
            return
        buffers = [t[:, sub] for t in self.kv_cache]  # (slots, ...) views of this layer's entry
        # a ring with a sparse cache steps alone (its selection moves keys by Python indices: ops.packed.ring_steady)
        batched = self._decode_batch(module, heads, scaling, sub, buffers, q, k, v, output, starts, seq_lens, slots,
                                     metadata.num_decodes) if ring and not stepped and not layout.cache else ()
        for i in range(len(stepped), count):
            if i in batched:
                continue
            a, b = starts[i], starts[i + 1]
            computed = seq_lens[i] - (b - a)
            index = slots[i]
            slot = [t[index] for t in buffers]
            cached = self._rings.pop((sub, index), None)
            if computed == 0:
                state = module.init_state()
            else:
                if ring and layout.observe and b - a > 1:
                    # sparse_observe chooses the cache again at the end of every call of more than one token; in
                    # transformers that is the whole prompt, here a later chunk of it (or speculative tokens)
                    raise RuntimeError(f"{self.prefix}[{sub}]: {b - a} tokens continue a request of {computed}; with "
                                       f"sparse_observe={layout.observe} a prompt must run in one call (chunked "
                                       "prefill and speculative decoding are refused: config_hook.py)")
                # a kept ring is the slot's own views, its length what pack_ring wrote: no read of the slot's meta
                held = cached.length if cached is not None else layout.length(slot)
                if held != computed:
                    raise RuntimeError(f"{self.prefix}[{sub}]: the state in slot {index} holds {held} tokens and the "
                                       f"request has computed {computed}; prefix caching and other reuse of a "
                                       "request's state are not supported by the hf_polyattn plugin")
                if ring:
                    state = cached if cached is not None else unpack_ring(slot, layout, heads)
                else:
                    state = unpack(slot, layout, heads)
            out, state = module(q[a:b].transpose(0, 1).unsqueeze(0), k[a:b].transpose(0, 1).unsqueeze(0),
                                v[a:b].transpose(0, 1).unsqueeze(0), causal=True, scaling=scaling, state=state)
            output[a:b] = out[0].transpose(0, 1).to(output.dtype)
            if ring:  # a decoding step wrote the slot in place: the counters and flags are written here
                state = ring_from_state(module, state, layout)
                pack_ring(state, slot, layout)
                if state.keys.data_ptr() == slot[1].data_ptr():  # the slot's own views: kept for the next step
                    self._rings[(sub, index)] = state
            else:
                pack(state, slot, layout)
        if starts[count] < output.shape[0]:
            output[starts[count]:].zero_()

    def _steady_decodes(self, metadata) -> tuple[int, torch.Tensor | None]:
        """(n, their slots as a tensor): the step's first n requests are decoding on steady rings (``ops.slot_step``:
        at least window + sinks tokens computed, every sink filled), checked once per step for every layer of the run
        on the slots' counters, so that a slot holding another state than the request's (prefix caching, a bug) is
        never stepped: such a request and the ones after it take the per-request path, which refuses it by name."""
        if self._steady is not None:
            return self._steady
        _, _, seq_lens, slots = self._lists
        need = self.layout.window + self.layout.sinks
        n = 0
        while n < metadata.num_decodes and seq_lens[n] - 1 >= need:
            n += 1
        index = None
        if n:
            index = metadata.state_indices_tensor[:n].to(torch.long)
            meta = self.kv_cache[5].index_select(0, index).index_select(1, self._member_index)  # (n, members, 6)
            computed = metadata.seq_lens[:n].to(meta.dtype) - 1
            good = ((meta[..., 0] == computed[:, None]) & (meta[..., 2] == self.layout.window) & (meta[..., 3] < 0)
                    & (meta[..., 5] == 0)).all(1).tolist()
            n = good.index(False) if False in good else n
            index = index[:n] if n else None
        self._steady = (n, index)
        return self._steady

    def _plan_of(self, sub: int, device: torch.device):
        """Layer ``sub``'s ``SlotPlan`` on ``device`` (None: ``ops.slot_step`` does not serve its module), made once;
        the entries' index tensors moved there with the first."""
        plan = self._slot_plans.get(sub, False)
        if plan is False:
            module, _, scaling = self.members[sub]
            plan = slot_plan(module, self.layout.work, device, scaling)
            self._slot_plans[sub] = plan
            if self._member_index.device != device:
                with torch.inference_mode(False):
                    self._sub_index = [t.to(device) for t in self._sub_index]
                    self._member_index = self._member_index.to(device)
        return plan

    @property
    def kv_cache(self):
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, buffers) -> None:
        """vLLM binds the state layer's buffers here (once its cache is allocated): the compiled step is warmed up
        on them then (``warm_up``)."""
        self._kv_cache = buffers
        self._state = self._native = None
        if len(buffers) and isinstance(self.layout, RingLayout):
            self._state = slot_state(buffers)
            if self._state is None:
                return
            state = self._state[0]
            if state.device.type == "cpu" and state.dtype == torch.float32:
                self._native = slot_step_kernel()
                if self._native is None and not _WARNED:
                    _WARNED.append(True)
                    logger.warning("hf_polyattn: the native CPU decoding step could not be built (%s); decoding "
                                   "runs the compiled PyTorch step, the same arithmetic, 4-5x slower a layer",
                                   kernel_error())
                with torch.inference_mode(False):
                    self._offsets = torch.tensor(self._state[1], dtype=torch.long)
            if self._native is None:
                self.warm_up()

    def warm_up(self) -> None:
        """Compile each layer's step (``ops.slot_step.compiled_slot_step``) for a batch of one sequence and of two
        on the bound buffers, as the model's decoding steps will call it (inference mode, the model's dtype, the
        same index tensors), so that the first request whose ring is steady does not wait for the compiler (20-30 s
        a variant on the 2-core CPU; 2 variants for the demo's layers of 2 and 3 kv heads, 4 at most). The two
        slots it runs on are given back as they were."""
        state, offsets = self._state
        device, dtype = state.device, self.model_config.dtype
        rows = min(2, state.shape[0])
        with torch.inference_mode():
            saved = state[:rows].clone()
            for sub, (module, heads, _) in sorted(self.members.items()):
                plan = self._plan_of(sub, device)
                key = (min(heads, 2), self.per_module, dtype, device, self.layout)
                if plan is None or key in _WARMED:
                    continue
                _WARMED.add(key)
                for n in range(1, rows + 1):
                    q = torch.zeros(n, heads, module.groups, self.layout.head_dim, dtype=dtype, device=device)
                    k = torch.zeros(n, heads, self.layout.head_dim, dtype=dtype, device=device)
                    run_slot_step(compiled_slot_step(), q, k, k.clone(), torch.arange(n, device=device),
                                  self._sub_index[sub], state, plan, offsets, self._dims())
            state[:rows].copy_(saved)

    def _dims(self) -> tuple:
        layout = self.layout
        return self.per_module, layout.heads, layout.features, layout.head_dim, layout.decay

    def _slot_step(self, sub: int, q, k, v, output, metadata) -> range:
        """The step's leading steady decodes of layer ``sub`` in one compiled call (``ops.slot_step``), where the
        layer's module is one it serves; the requests it ran (range(n), the others run after)."""
        plan = self._plan_of(sub, self.kv_cache[0].device)
        if plan is None:
            return range(0)
        n, index = self._steady_decodes(metadata)
        if not n:
            return range(0)
        if self._state is None:  # buffers not laid out in slot pages (``slot_state``): the per-request path
            return range(0)
        state, offsets = self._state
        heads = self.members[sub][1]
        if self._rings:  # those slots move on here: a kept ring object's counters would be stale
            for slot in self._lists[3][:n]:
                self._rings.pop((sub, slot), None)
        g = q.shape[1] // heads
        q4 = q[:n].view(n, heads, g, -1)
        if self._native is not None:  # ops/cpu/slot_step.c: float32 in, written into ``output`` where it is float32
            f32 = output.dtype == torch.float32
            q4, kn, vn = (t.to(torch.float32).contiguous() for t in (q4, k[:n], v[:n]))
            out = run_slot_step_native(self._native, q4, kn, vn, index, sub, state, plan, self._offsets,
                                       self._dims(), output[:n].view(n, heads, g, -1) if f32 else None)
            if not f32:
                output[:n] = out.view(n, heads * g, -1)
            return range(n)
        out = run_slot_step(compiled_slot_step(), q4, k[:n], v[:n], index, self._sub_index[sub], state, plan,
                            offsets, self._dims())
        output[:n] = out.view(n, heads * g, -1)
        return range(n)

    def _decode_batch(self, module, heads, scaling, sub, buffers, q, k, v, output, starts, seq_lens, slots,
                      decodes: int) -> set[int]:
        """The decoding requests whose rings are steady, stepped as one batch (``ops.packed.gather_rings``): one
        module call for all of them instead of one each; the requests it ran (the others run one by one)."""
        if decodes < 2:
            return set()
        device = buffers[5].device  # index tensors where the buffers are (CUDA under a GPU engine)
        metas = buffers[5].index_select(0, torch.tensor(slots[:decodes], device=device)).tolist()
        batch = [i for i in range(decodes)
                 if ring_steady(metas[i], self.layout) and int(metas[i][0]) == seq_lens[i] - 1]
        if len(batch) < 2:
            return set()
        index = torch.tensor([slots[i] for i in batch], device=device)
        for i in batch:  # their slots are rewritten below: a kept ring object would be stale
            self._rings.pop((sub, slots[i]), None)
        ring, pos = gather_rings(buffers, self.layout, index, heads)
        tokens = torch.tensor([starts[i] for i in batch], device=q.device)
        out, ring = module(q.index_select(0, tokens).unsqueeze(2), k.index_select(0, tokens).unsqueeze(2),
                           v.index_select(0, tokens).unsqueeze(2), causal=True, scaling=scaling, state=ring)
        scatter_rings(ring, buffers, self.layout, index, pos)
        output[tokens] = out[:, :, 0].to(output.dtype)
        return set(batch)


def _kernel_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str,
                  sub: int) -> None:
    context = get_forward_context()
    layer = context.no_compile_layers[layer_name]
    metadata = context.attn_metadata
    if isinstance(metadata, list):  # micro-batches: not planned for these layers
        raise NotImplementedError("hf_polyattn: micro-batching (ubatching) is not supported")
    metadata = metadata.get(layer_name) if isinstance(metadata, dict) else None
    if metadata is None:  # a profiling or warm-up run: no request, no state
        output.zero_()
        return
    layer.run(q, k, v, output, metadata, sub)


def _kernel_heads_fake(q, k, v, output, layer_name, sub) -> None:
    return None


direct_register_custom_op(op_name="hf_polyattn_kernel_heads", op_func=_kernel_heads, mutates_args=["output"],
                          fake_impl=_kernel_heads_fake)


class PolyAttnAttention(nn.Module):
    """A decoder layer's attention for a converted folder: vLLM's projections and RoPE, the softmax kv heads on
    vLLM's ``Attention``, the others on ``KernelHeadsState`` (module docstring). Built with the keyword arguments
    of vLLM's ``LlamaAttention``; the other families' decoder layers (``models.py``) add what their attention does
    before the kernel sees q and k, as transformers' attention does before it calls the converted module:
    ``head_dim`` (Qwen3, Gemma 3: the config's, not hidden_size / heads), ``scaling`` (Gemma 3:
    query_pre_attn_scalar ** -0.5), ``qk_norm`` (Qwen3, Gemma 3: a norm class applied to each head of q and k
    before RoPE, ``rms_norm_eps``) and ``rope_parameters`` (Gemma 3: the global layers' own)."""

    def __init__(self, config, hidden_size: int, num_heads: int, num_kv_heads: int,
                 max_position_embeddings: int = 8192, quant_config=None, bias: bool = False,
                 bias_o_proj: bool = False, cache_config=None, prefix: str = "",
                 attn_type: str = AttentionType.DECODER, head_dim: int | None = None, scaling: float | None = None,
                 qk_norm: type[nn.Module] | None = None, rms_norm_eps: float = 1e-6,
                 rope_parameters: dict | None = None) -> None:
        super().__init__()
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"hf_polyattn serves causal decoders; this layer was built as {attn_type!r}")
        if get_tensor_model_parallel_world_size() != 1 or get_pp_group().world_size != 1:
            raise NotImplementedError("hf_polyattn's vLLM plugin runs on one device per model (tensor and pipeline "
                                      "parallel size 1); its heads and state layers are not split across devices "
                                      "yet")
        layer_idx = extract_layer_index(prefix)
        cfg = polyattn_config(config)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or getattr(config, "head_dim", None) or hidden_size // num_heads
        self.groups = num_heads // num_kv_heads
        self.q_size, self.kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5 if scaling is None else scaling
        self.qkv_proj = QKVParallelLinear(hidden_size=hidden_size, head_size=self.head_dim,
                                          total_num_heads=num_heads, total_num_kv_heads=num_kv_heads, bias=bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(input_size=num_heads * self.head_dim, output_size=hidden_size,
                                        bias=bias_o_proj, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        if rope_parameters is None:
            rope_parameters = getattr(config, "rope_parameters", None)
        self.rotary_emb = get_rope(self.head_dim, max_position=max_position_embeddings,
                                   rope_parameters=rope_parameters, is_neox_style=True)
        # per head, before RoPE (as the family's own attention: transformers' converted module gets q and k normed)
        self.q_norm = qk_norm(self.head_dim, eps=rms_norm_eps) if qk_norm is not None else None
        self.k_norm = qk_norm(self.head_dim, eps=rms_norm_eps) if qk_norm is not None else None
        # the checkpoint's module, under the name its weights have (model.layers.N.self_attn.polyattn.*)
        self.polyattn = build_attention(cfg, num_heads, self.head_dim, num_kv_heads, layer_idx)
        soft = softmax_heads_of(cfg, layer_idx)
        self.softmax_kv_heads = soft
        self.kernel_kv_heads = tuple(h for h in range(num_kv_heads) if h not in soft)
        g = self.groups
        self.register_buffer("kernel_q_index", torch.tensor(
            [h * g + i for h in self.kernel_kv_heads for i in range(g)], dtype=torch.long), persistent=False)
        self.register_buffer("kernel_kv_index", torch.tensor(self.kernel_kv_heads, dtype=torch.long),
                             persistent=False)
        # one vLLM Attention per softmax kv head; each its own layer index past the model's layers (as vLLM's
        # Falcon-H1 numbers its second mixer), so that no two cache layers share one
        model_prefix = prefix.rsplit(".layers.", 1)[0]
        layers = config.num_hidden_layers
        self.softmax_attn = nn.ModuleList(
            Attention(g, self.head_dim, self.scaling, num_kv_heads=1, cache_config=cache_config,
                      quant_config=quant_config, prefix=f"{model_prefix}.layers.{(j + 1) * layers + layer_idx}"
                                                        f".self_attn.softmax_head")
            for j in range(len(soft)))
        self.state = None
        if self.kernel_kv_heads:
            kernel = self.polyattn.kernel if isinstance(self.polyattn, HybridAttention) else self.polyattn
            if reads_rope(cfg):
                # the sinks' queries are turned with the model's RoPE (sink_position='window'): the rotation vLLM
                # applies, read from its rotary embedding (servable.py refuses RoPE types whose rotation is not
                # inv_freq alone)
                rotary = self.rotary_emb
                kernel.rope = RopeRotation(inv_freq=rotary._compute_inv_freq(rotary.base).float(),
                                           rotary_dim=rotary.rotary_dim)
            model_config = get_current_vllm_config().model_config
            plan = state_plan(config, model_config.max_model_len, model_config.dtype)
            first, self.state_sub = plan.place(layer_idx)
            name = f"{model_prefix}.layers.{first}.self_attn.polyattn_state"
            context = get_current_vllm_config().compilation_config.static_forward_context
            if first == layer_idx:  # the run's first layer makes its state layer and holds it as a submodule
                self.state = KernelHeadsState(state_layout(config, self.head_dim, model_config.dtype),
                                              plan.per_module, name)
            else:  # a later layer of the run (built after the first) joins it, without registering it again
                self.__dict__["state"] = context[name]
            self.state.add(self.state_sub, kernel, len(self.kernel_kv_heads), self.scaling)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))).flatten(-2, -1)
            k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim))).flatten(-2, -1)
        q, k = self.rotary_emb(positions, q, k)
        t, d, g = q.shape[0], self.head_dim, self.groups
        q3, k3, v3 = q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        out = torch.empty_like(q3)
        for j, h in enumerate(self.softmax_kv_heads):
            o = self.softmax_attn[j](q3[:, h * g:(h + 1) * g].reshape(t, g * d), k3[:, h].contiguous(),
                                     v3[:, h].contiguous())
            out[:, h * g:(h + 1) * g] = o.view(t, g, d)
        if self.state is not None:
            kq = q3.index_select(1, self.kernel_q_index)
            kk = k3.index_select(1, self.kernel_kv_index)
            kv = v3.index_select(1, self.kernel_kv_index)
            ko = torch.empty_like(kq)
            torch.ops.vllm.hf_polyattn_kernel_heads(kq, kk, kv, ko, self.state.prefix, self.state_sub)
            out[:, self.kernel_q_index] = ko
        output, _ = self.o_proj(out.view(t, self.num_heads * d))
        return output
