"""Sharded retrofits: FSDP2 (``torch.distributed.fsdp.fully_shard``) of every decoder layer and of the model.

One path on CPUs and GPUs: the pipeline shards the model itself, whatever launched the processes
(``torchrun --nproc_per_node N``: gloo on CPUs, NCCL on GPUs; ``accelerate launch`` with an FSDP config).
accelerate's own FSDP wrapping is never used: on a machine without GPUs it is not available at all
(FSDP v1 fails in ``Accelerator()``; with ``--fsdp_version 2`` accelerate reports ``MULTI_CPU`` and wraps the
model in DDP: every process holds the whole model). :func:`check_launch` refuses the launches that would
silently train unsharded copies.

What is sharded: each module whose class a transformers model lists in ``_no_split_modules`` (its decoder /
encoder layers, e.g. ``LlamaDecoderLayer``, ``GPT2Block``, ``BertLayer``), one FSDP group each, then the whole
model (embeddings, final norm, a tied or untied head) as the root group. Parameters are sharded on dim 0 as
DTensors between forwards; buffers (rotary tables, the polyattn sketches and random features, drawn from the
seed) stay whole on every process. Every forward must go through the root module (FSDP2 initialises from the
first module called), so the attention transfer runs the whole model with ``logits_to_keep=1``.

The parameters passed as ``replicated`` (the pipeline passes the polyattn ones) stay whole on every process
(FSDP's ``ignored_params``) and their gradients are averaged by an all-reduce (:func:`sync_replicated_grads`).
FSDP2 gathers a layer's parameters for backward and reduce-scatters their gradients from hooks on the layer's
outputs and inputs; the attention-transfer loss is formed inside each layer beside its output, which carries
the teacher's output on and does not depend on it, so in that stage those hooks never run: a sharded polyattn
parameter met its backward still sharded ("aten.bmm.default got mixed torch.Tensor and DTensor"). They are
small: learned polysketch r = 32 with a head_dim projection is 1.3M parameters in SmolLM2-135M (1%), 9.2M in a
Llama-3-8B (0.12%).

Gradients are averaged over the processes by reduce-scatter, so N processes with B sequences each take the
same step as one process with the N * B sequences of the global batch (``data.lm_batch`` draws the global
batch and gives each rank its slice).

Collective operations (every rank calls them, in the same order): :func:`full_tensors`,
:func:`load_full_tensors`, :func:`optimizer_state`, :func:`load_optimizer_state`, :func:`full_state_dict`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

__all__ = [
    "LaunchError",
    "check_launch",
    "clip_grad_norm_",
    "full_state_dict",
    "full_tensors",
    "is_sharded",
    "layer_classes",
    "load_full_tensors",
    "load_optimizer_state",
    "optimizer_state",
    "set_gradient_sync",
    "shard",
    "sync_replicated_grads",
]

TORCHRUN_CPU = "torchrun --nproc_per_node N -m hf_polyattn.retrofit ... --fsdp"


class LaunchError(ValueError):
    """A multi-process launch that would not train what it says (unconnected or unsharded copies)."""


def _launched_processes() -> int:
    """How many processes the launcher started (torchrun / accelerate launch set WORLD_SIZE), 1 without one."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _accelerate_fsdp_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")


def check_before_accelerator(fsdp: bool) -> None:
    """Refusals that must come before ``Accelerator()``: there, accelerate's FSDP v1 on a machine without GPUs
    fails with "no available devices found", which names neither the cause nor the way out."""
    if _accelerate_fsdp_launch() and not torch.cuda.is_available() and os.environ.get("FSDP_VERSION", "1") != "2":
        raise LaunchError(
            "accelerate launch --use_fsdp on a machine without GPUs: accelerate's FSDP needs GPUs. Shard on CPUs "
            f"with `{TORCHRUN_CPU}` (FSDP2 over gloo)" + ("" if fsdp else ", or leave out --use_fsdp"))


def check_launch(acc, fsdp: bool) -> dict[str, Any]:
    """Refuse a launch that would train unconnected or unsharded copies; the record of the run's processes.

    * more processes launched (``WORLD_SIZE``) than accelerate connected: each would train alone;
    * ``accelerate launch`` with an FSDP config but no ``--fsdp``: on GPUs accelerate's FSDP would wrap the
      stages in a way this pipeline does not run; on CPUs it is plain data parallel (``MULTI_CPU``), every
      process with the whole model;
    * ``--fsdp`` in a single process: nothing to shard across.
    """
    launched, connected = _launched_processes(), acc.num_processes
    kind = getattr(acc.distributed_type, "value", str(acc.distributed_type))
    if launched > connected:
        raise LaunchError(
            f"{launched} processes were launched (WORLD_SIZE={launched}) but accelerate connected {connected} "
            f"(distributed type {kind}): each would train its own copy of the model, unsharded and unsynchronised. "
            f"Launch with `{TORCHRUN_CPU}` or `accelerate launch --multi_gpu` (data parallel), or one process")
    if _accelerate_fsdp_launch() and not fsdp:
        why = ("accelerate's own FSDP wrapping is not the path these recipes run" if kind == "FSDP"
               else "every process would hold and train the whole model")
        raise LaunchError(f"accelerate launch with an FSDP config, but the run does not shard (accelerate reports "
                          f"{kind}: {why}): add --fsdp (FSDP2 of each decoder layer, on CPUs and GPUs)")
    if fsdp and connected < 2:
        raise LaunchError(
            "--fsdp shards the model across processes, and this run has one: launch it with "
            f"`{TORCHRUN_CPU}` (CPUs, gloo) or `accelerate launch --num_processes N -m hf_polyattn.retrofit ... "
            "--fsdp` (GPUs; the project's repository has an accelerate FSDP config, recipes/accelerate_fsdp.yaml), "
            "or leave out --fsdp")
    record = {"processes": connected, "distributed_type": kind,
              "backend": torch.distributed.get_backend() if connected > 1 else None,
              "sharding": "fsdp2" if fsdp else ("ddp" if connected > 1 else "none")}
    if _accelerate_fsdp_launch():
        # the launcher's FSDP config started the processes; its wrapping settings are not read
        record["accelerate_fsdp_config"] = "processes only: hf_polyattn shards each layer with FSDP2 itself"
    return record


def layer_classes(model: nn.Module) -> set[str]:
    """Class names of the layers to shard one by one: ``_no_split_modules`` of the transformers models inside
    (``LlamaDecoderLayer``; BERT's inner model names ``BertEmbeddings`` and ``BertLayer``), else the class of the
    longest ``nn.ModuleList`` of one class (DistilBERT declares nothing: its ``transformer.layer``)."""
    from transformers.modeling_utils import PreTrainedModel

    names: set[str] = set()
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            names.update(getattr(m, "_no_split_modules", None) or [])
    if not names:
        stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
                  and len({type(layer) for layer in m}) == 1]
        if stacks:
            names.add(type(max(stacks, key=len)[0]).__name__)
    return names


_REPLICATED = "_hf_polyattn_replicated"  # attribute of the root: the parameters kept whole


def shard(model: nn.Module, device: torch.device, replicated: list[tuple[str, nn.Parameter]] = ()) -> dict[str, Any]:
    """``fully_shard`` each layer of :func:`layer_classes`, then ``model`` itself (in place); what was sharded.

    ``model`` may still be on the CPU: ``fully_shard`` moves each group to the mesh's device as it shards it, so
    a GPU never holds more than one whole layer (plus the shards). ``replicated`` parameters are left whole
    (module docstring) and moved to ``device`` here.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    classes = layer_classes(model)
    if not classes:
        raise ValueError(f"{type(model).__name__} names no layers to shard (_no_split_modules is empty)")
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    whole = [p for _, p in replicated]
    with torch.no_grad():
        for p in whole:
            p.data = p.data.to(device)
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    counts: dict[str, int] = {}
    for layer in layers:
        counts[type(layer).__name__] = counts.get(type(layer).__name__, 0) + 1
        fully_shard(layer, mesh=mesh, ignored_params=set(whole))
    # The root reshards after forward too (FSDP2 keeps the root's parameters gathered by default): the trainable
    # parameters a stage collects after an evaluation forward must be the sharded ones. Collected while gathered,
    # the embeddings were the all-gather's buffer: the optimizer stepped a tensor FSDP later freed (a crash).
    fully_shard(model, mesh=mesh, ignored_params=set(whole), reshard_after_forward=True)
    setattr(model, _REPLICATED, whole)
    sharded = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in whole)
    return {"fsdp_units": {**counts, "root": 1}, "mesh": list(mesh.shape), "device": device.type,
            "sharded_parameters": sharded, "replicated_parameters": sum(p.numel() for p in whole)}


def sync_replicated_grads(model: nn.Module) -> None:
    """Average the gradients of the parameters kept whole over the processes (what DDP would do for them)."""
    world = torch.distributed.get_world_size()
    for p in getattr(_root(model), _REPLICATED, ()):
        if not p.requires_grad:
            continue
        if p.grad is None:  # every rank must join the all-reduce: an unused parameter contributes zeros
            p.grad = torch.zeros_like(p)
        torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
        p.grad.div_(world)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _root(model: nn.Module):
    from torch.distributed.fsdp import FSDPModule

    return next(m for m in model.modules() if isinstance(m, FSDPModule))  # modules() is pre-order: the outermost


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2's ``no_sync``: skip the reduce-scatter on the micro-batches before the last of an accumulation."""
    _root(model).set_requires_gradient_sync(sync)


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm of sharded (DTensor) and replicated gradients together.

    torch's clip_grad_norm_ refuses to mix DTensors with tensors in one norm: the two groups' norms are taken
    apart (a DTensor norm is reduced across processes by ``full_tensor``) and combined.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norms = []
    for group in ([g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)]):
        if group:
            n = torch.nn.utils.get_total_norm(group)
            norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float().cpu())
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    for group in ([p for p in params if isinstance(p.grad, DTensor)], [p for p in params
                                                                        if p.grad is not None
                                                                        and not isinstance(p.grad, DTensor)]):
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total


def full_tensors(params: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """Whole CPU copies of (sharded) parameters, gathered on every process (collective)."""
    out = {}
    for name, p in params:
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().clone()
    return out


@torch.no_grad()
def load_full_tensors(params: list[tuple[str, torch.nn.Parameter]], state: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into (sharded) parameters: each process keeps its own shard (collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in params:
        t = state[name]
        if isinstance(p, DTensor):
            shard_of = distribute_tensor(t.to(device=p.device, dtype=p.dtype), p.device_mesh, p.placements)
            p.to_local().copy_(shard_of.to_local())
        else:
            p.copy_(t)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state with whole tensors, keyed by parameter names (collective; every rank gets it)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options())


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict in CPU memory on rank 0 ({} on the others) (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))
