"""Peak memory of a piece of PyTorch code, counted by tensor storages (any device, no allocator needed).

``PeakLive`` is a ``TorchDispatchMode`` that adds up the bytes of every storage an operator returns inside it
while that storage is alive (a finaliser subtracts it when freed): a lower bound on what any allocator must hold,
the same on the CPU as on a GPU. Storages that existed before (the inputs, a module's weights) are not counted:
an output that its operator's schema marks as an alias of an input (a view, an in-place result) brings no new
storage, and ``ignore`` names storages never to count. With ``top`` > 0 it also keeps the ``top`` largest live
storages at the peak, each with the operator that made it and the innermost frame of this package that called it.

``attention_peak`` runs one attention layer's forward + backward (or SDPA's) under it: what
``recipes/memory_layers.py`` prints and ``tests/recipes/test_memory.py`` bounds. A measuring tool of the recipes and
the tests, not part of the installed package. Custom autograd Functions run their
backward on the calling thread for CPU tensors, so the backward pass is counted too.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_polyattn

__all__ = ["LAYERS", "Allocation", "PeakLive", "attention_peak", "layer_config"]

# Issue 11's layers (the GPU benchmark's rows, H100 bf16): name -> PolyAttnConfig options; None is SDPA.
LAYERS: dict[str, dict | None] = {
    "sdpa": None,
    "polysketch-local": dict(kind="polysketch", sketch="learned", sketch_size=32, local_exact=True),
    "polysketch": dict(kind="polysketch", sketch_size=32),
    "linear-elu": dict(kind="linear", feature_map="elu"),
    "performer": dict(kind="performer"),
    "polysketch-window128": dict(kind="polysketch", sketch_size=32, window=128, feature_proj=64),
}

_PACKAGE = str(Path(hf_polyattn.__file__).resolve().parent)  # allocation sites are named inside the package


@dataclass(frozen=True)
class Allocation:
    """One live storage: its bytes, the operator that returned it, that tensor's shape and dtype, and where."""

    nbytes: int
    op: str
    shape: tuple
    dtype: torch.dtype
    where: str


def _caller() -> str:
    """'forward' or 'backward' (inside autograd's backward pass), then file:line function of the innermost frame
    inside hf_polyattn ('-' when none: an operator autograd's engine ran itself)."""
    phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE):
            where = Path(path).relative_to(Path(_PACKAGE).parent)
            return f"{phase} {where}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return f"{phase} -"


class PeakLive(TorchDispatchMode):
    """The largest sum of live storage bytes created inside (storages of ``ignore`` and of tensors made
    outside are never counted); ``top`` > 0 keeps the ``top`` largest live storages at that peak."""

    def __init__(self, ignore: tuple[torch.Tensor, ...] = (), top: int = 0):
        super().__init__()
        self.live = self.peak = 0
        self.device_peak: int | None = None  # set by attention_peak on CUDA: the allocator's own peak
        self.top = top
        self.at_peak: list[Allocation] = []
        self.seen: dict[int, Allocation | None] = {}
        self._outside = {t.untyped_storage().data_ptr() for t in ignore}

    def _track(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.seen or key in self._outside:
            return
        self.seen[key] = Allocation(size, op, tuple(t.shape), t.dtype, _caller()) if self.top else None
        self.live += size
        if self.live > self.peak:
            self.peak = self.live
            if self.top:
                self.at_peak = sorted(self.seen.values(), key=lambda a: -a.nbytes)[: self.top]

        def free(key=key, size=size):
            self.live -= size
            self.seen.pop(key, None)

        weakref.finalize(storage, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        returns = func._schema.returns
        # an output the schema marks as aliasing an input (views, in-place and out= ops, set_) owns no new memory:
        # its storage is an input's, counted when made in here and not at all when made outside
        aliased = [r.alias_info is not None for r in returns] if len(returns) == len(outs) else \
            [any(r.alias_info is not None for r in returns)] * len(outs)
        for t, alias in zip(outs, aliased):
            if isinstance(t, torch.Tensor) and not alias:
                self._track(t, str(func))
        return out


@contextlib.contextmanager
def _interpreter_cycles_collected():
    """Under Triton's interpreter (TRITON_INTERPRET=1), a garbage collection after every kernel launch.

    The interpreter copies a launch's tensor arguments through a recursive closure (``GridExecutor._init_args_hst``
    in triton 3.9: ``_to_cpu`` refers to itself), a reference cycle that holds every argument's storage until the
    next collection: the Triton product's chunk states, (n / 256 - 1) x 528 x 64 fp32 a head, outlived its forward
    (the causal polysketch layer at d1ccb60, n = 1024, H = 4, 2-core CPU: 23.24 bf16 query units counted at the peak
    without the collection, 20.11 with it). A compiled launch holds no such reference, so the count collects the
    cycle when the launch returns."""
    try:
        if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
            raise ImportError("not interpreted")
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    executor = interpreter.GridExecutor
    launch = executor.__call__

    def launch_and_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect()

    executor.__call__ = launch_and_collect
    try:
        yield
    finally:
        executor.__call__ = launch


def layer_config(name: str, backend: str = "triton", block_size: int = 256, **overrides):
    """The ``PolyAttnConfig`` of row ``name`` of ``LAYERS`` (None for SDPA), with ``overrides``."""
    from hf_polyattn import PolyAttnConfig

    opts = LAYERS[name]
    return None if opts is None else PolyAttnConfig(backend=backend, block_size=block_size, **{**opts, **overrides})


def attention_peak(config, n: int, heads: int = 4, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16,
                   top: int = 0, seed: int = 0, device: str | torch.device = "cpu") -> tuple[PeakLive, int]:
    """(tracker, bytes of one query-sized tensor in ``dtype``) of one causal forward + backward on ``device``.

    ``config``: a ``PolyAttnConfig`` (the kind's module built as a model of ``dtype`` builds it:
    ``.to(dtype)``), or None for ``torch.nn.functional.scaled_dot_product_attention`` (is_causal=True).
    q, k, v are (1, heads, n, head_dim) in ``dtype``, made outside the tracker and requiring grad; their
    gradients, made inside, count (as on a GPU, where they are allocated during backward). On CUDA the tracker's
    ``device_peak`` is also set: the allocator's peak above what was allocated before the step.
    """
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=gen).to(device, dtype).requires_grad_()
               for _ in range(3))
    outside: tuple[torch.Tensor, ...] = (q, k, v)
    if config is None:
        def step():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    else:
        module = config.spec.module_class()(config, heads, head_dim).to(device, dtype)
        outside += tuple(module.parameters()) + tuple(module.buffers())

        def step():
            module(q, k, v, causal=True).sum().backward()
    tracker = PeakLive(ignore=outside, top=top)
    cuda = q.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with _interpreter_cycles_collected(), tracker:
        step()
    if cuda:
        torch.cuda.synchronize()
        tracker.device_peak = torch.cuda.max_memory_allocated() - base
    return tracker, q.numel() * q.element_size()
