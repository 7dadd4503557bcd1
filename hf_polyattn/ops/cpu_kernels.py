"""Native CPU kernels, built on first use with the machine's C compiler and loaded with ctypes.

``slot_step_kernel()`` is ``ops/cpu/slot_step.c``: ``ops.slot_step.slot_step`` for float32 on the CPU as one native
call a layer: 7.5x the eager step at batch 1, 2.4x at 16 on the demo's layer
(recipes/results/benchmark_slot_step/cpu-2threads.json, the 2-core CPU).
It is plain C (no Python or torch headers): it builds in about a second into a cache folder
(``HF_POLYATTN_KERNEL_CACHE``, default ~/.cache/hf_polyattn/kernels), one file per source, compiler and flags, and
is loaded from there afterwards. Where no compiler runs (or ``HF_POLYATTN_NATIVE_KERNELS=0``), ``slot_step_kernel()``
is None and ``kernel_error()`` says why: the callers then run the PyTorch step (the same arithmetic, slower), and say
so once.

Pure Python and ctypes: never imports transformers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

__all__ = ["kernel_error", "run_slot_step_native", "slot_step_kernel"]

_SOURCE = Path(__file__).with_name("cpu") / "slot_step.c"
# -O3 vectorises the inner loops that carry no reduction (vectorising the dot products' reductions too, with
# -fopenmp-simd, made the demo layer's call slower on the 2-core CPU); -march=native: the file is built on the
# machine that runs it (the cache key holds the machine); -ffp-contract=off keeps a * b + c two roundings as
# PyTorch's CPU kernels round them
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]
_ERROR: list[str] = []

_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [_I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR,
             _I64, _I64, _I64, _I64, _INT,
             _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _F32, _INT, _PTR, _I64, _PTR, _PTR, _PTR, _INT, _F32, _PTR,
             _PTR, _I64, _I64, _F32, _F32, _F32, _PTR]


def _cache_dir() -> Path:
    return Path(os.environ.get("HF_POLYATTN_KERNEL_CACHE") or Path.home() / ".cache" / "hf_polyattn" / "kernels")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(source: Path, name: str) -> Path:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join([cc, *_FLAGS, platform.machine(), platform.node()]).encode()).hexdigest()
    target = _cache_dir() / f"{name}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then moved: processes may race
        built = Path(tmp) / target.name
        proc = subprocess.run([cc, *_FLAGS, "-o", str(built), str(source), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


@functools.cache
def slot_step_kernel():
    """The native ``slot_step`` (a ctypes function), or None where it cannot be built or loaded
    (``kernel_error``)."""
    if os.environ.get("HF_POLYATTN_NATIVE_KERNELS", "1") == "0":
        _ERROR.append("switched off by HF_POLYATTN_NATIVE_KERNELS=0")
        return None
    if sys.platform == "win32":
        _ERROR.append("native kernels are built on Linux and macOS only")
        return None
    try:
        lib = ctypes.CDLL(str(_build(_SOURCE, "slot_step")))
    except (OSError, RuntimeError) as err:
        _ERROR.append(str(err))
        return None
    fn = lib.hf_polyattn_slot_step
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn


def kernel_error() -> str | None:
    """Why ``slot_step_kernel()`` is None (after it was called), or None."""
    return _ERROR[-1] if _ERROR else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def native_plan(plan) -> tuple:
    """The layer's arguments of the native step (``SlotPlan`` as float32 contiguous tensors and numbers), made
    once per plan and kept on it (the tensors must live as long as the pointers are used)."""
    hit = plan.__dict__.get("_native")
    if hit is not None:
        return hit[1]

    def f32(t):
        return None if t is None else t.detach().to(torch.float32).contiguous()

    proj, qw, qb, kw, kb = (f32(t) for t in (plan.proj, plan.q_norm_weight, plan.q_norm_bias, plan.k_norm_weight,
                                                plan.k_norm_bias))
    mw, gw, gb, sl, mix = (f32(t) for t in (plan.map_weight, plan.gate_weight, plan.gate_bias,
                                             plan.scalar_log_gate, plan.window_mix))
    inv = None if plan.inv_freq is None else plan.inv_freq.detach().to(torch.float64).contiguous()
    keep = (proj, qw, qb, kw, kb, mw, gw, gb, sl, mix, inv)
    feature = {"elu": 0, "relu": 1, "hedgehog": 2}[plan.feature]
    args = (_ptr(proj), 0 if proj is None else proj.shape[-1], _ptr(qw), _ptr(qb), _ptr(kw), _ptr(kb), plan.eps,
            feature, _ptr(mw), 0 if mw is None else mw.shape[-1], _ptr(gw), _ptr(gb), _ptr(sl),
            int(plan.gate_cap is not None), 0.0 if plan.gate_cap is None else plan.gate_cap, _ptr(mix), _ptr(inv),
            plan.rotary_dim, plan.span, plan.scale, plan.offset, plan.smallest)
    plan.__dict__["_native"] = (keep, args)
    return args


def run_slot_step_native(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, sub: int,
                         state: torch.Tensor, plan, offsets: torch.Tensor, dims: tuple,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.slot_step.run_slot_step`` through the native kernel: q (B, Hkv, G, d), k / v (B, Hkv, d) float32
    contiguous, ``slots`` (B,) int64 contiguous, ``sub`` the entry (an int), ``state`` the float32 (slots, span)
    view of ``slot_state``, ``offsets`` its offsets as an int64 tensor; the (B, Hkv, G, d) output (into ``out``
    where given)."""
    b, hkv, g, d = q.shape
    _, hmax, nfeat, _, decay = dims
    if out is None:
        out = torch.empty_like(q)
    status = kernel(b, hkv, g, d, q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), sub,
                    state.data_ptr(), state.stride(0), offsets.data_ptr(), hmax, nfeat, plan.sinks,
                    plan.window, int(decay), *native_plan(plan), out.data_ptr())
    if status:
        raise MemoryError("the native slot step could not allocate its scratch memory")
    return out
