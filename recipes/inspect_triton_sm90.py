"""Compile every Triton kernel of the package for an H100 (sm_90) on a machine without a GPU and read the result.

No GPU needed: the host code of ``ops/triton`` runs on CPU tensors with the kernel launches captured (nothing is
launched), each captured launch is specialised exactly as Triton's JIT would specialise it on a GPU (the JIT's own
binder: dtypes, ints equal to 1, 16-divisible ints and pointers) and compiled by ``triton.compile`` for
``GPUTarget('cuda', 90, 32)``; the cubin is then read with the ``cuobjdump`` that ships in triton's wheel.

Per kernel and case it reports what decides speed before any timing (METHOD.md: "the compiler's resource report
and the disassembly answer most questions"):

* registers per thread, stack / local bytes (spills), shared memory (Triton's own allocation), and the
  programs per SM that the registers and shared memory allow (H100: 65,536 registers, 227 KB of shared
  memory per SM);
* the SASS instruction mix in the kernel's text: ``HGMMA`` (Hopper's warpgroup tensor-core MMA), ``HMMA``
  (the older mma.sync path), ``FFMA``, global loads by width (``LDG.E`` = 4 bytes a thread: scalar, gathers;
  ``.64`` / ``.128`` vectorised; ``LDGSTS``: asynchronous global -> shared copies, the pipelined operand loads),
  shared loads/stores, local memory (``LDL`` / ``STL``: spills).

Counts are static (instructions in the code, not executed ones): they compare layouts of the same kernel, they
are not timings. Cases are the benchmark's shapes (H = 16, d = 64, n = 32k, bf16 inputs, tf32 dots as a bf16
model passes them).

    python recipes/inspect_triton_sm90.py          # -> recipes/results/inspect_triton_sm90/sm90.{md,json}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch
from _defaults import RESULTS

# the instructions reported, in table order (counted by mnemonic prefix: HGMMA.64x64x8.F32.TF32 counts as HGMMA)
SASS_COLUMNS = ("HGMMA", "HMMA", "FFMA", "LDG", "LDG.E.64", "LDG.E.128", "LDGSTS", "LDS", "STS", "LDL", "STL", "BAR")
H100_REGS_PER_SM = 65536
H100_SMEM_PER_SM = 227 * 1024
H100_MAX_WARPS_PER_SM = 64


def _triton_bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


class _Captured:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, name, fn, sink):
        self.name, self.fn, self.sink = name, fn, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.name, self.fn, grid, args, kwargs))
        return launch


@contextlib.contextmanager
def captured(*modules):
    """Replace every @triton.jit kernel (names ending in ``_kernel``) of ``modules`` by a recorder."""
    from triton.runtime.jit import JITFunction

    launches, saved = [], []
    for mod in modules:
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Captured(name, obj, launches))
    try:
        yield launches
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)


def compile_sm90(fn, args, kwargs, capability: int = 90):
    """Compile one launch as the JIT would on an sm_``capability`` GPU; returns the CompiledKernel (not loaded)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def read_cubin(cubin: bytes) -> dict:
    """Registers, stack, shared memory and the SASS instruction counts of a one-kernel cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
        path = fh.name
    try:
        res = subprocess.run([_triton_bin("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([_triton_bin("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    ops = Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
    counts = {}
    for col in SASS_COLUMNS:
        if col.startswith("LDG."):  # the vector widths exactly
            counts[col] = sum(v for k, v in ops.items() if k.startswith("LDG.") and k.endswith(col[3:]))
        elif col == "LDG":  # every global load into registers (LDGSTS: global -> shared, asynchronous)
            counts[col] = sum(v for k, v in ops.items() if k == "LDG" or k.startswith("LDG."))
        else:
            counts[col] = sum(v for k, v in ops.items() if k == col or k.startswith(col + "."))
    return {**{k.lower(): int(v) for k, v in usage.items()}, "sass": counts}


def occupancy(regs: int, smem: int, num_warps: int) -> int:
    """Programs one H100 SM can hold at once by registers, shared memory and warps."""
    by_regs = H100_REGS_PER_SM // max(1, regs * 32 * num_warps)
    by_smem = H100_SMEM_PER_SM // smem if smem else 10**9
    return min(by_regs, by_smem, H100_MAX_WARPS_PER_SM // num_warps)


def _bench_inputs(n: int, H: int, r: int, e: int, dtype=torch.bfloat16):
    a = torch.randn(1, H, n, r, dtype=dtype)
    return a, torch.randn(1, H, n, r, dtype=dtype), torch.randn(1, H, n, e, dtype=dtype)


def lt_cases(n: int, H: int):
    """(case, launches) of the causal product: polysketch r = 32 (squared) without and with the diagonal, each
    also in the gathered layout the square tiles replaced (``causal.SQUARE_TILES`` False), linear elu+1
    (identity, r = 64) with the diagonal; forward and full backward, tf32 dots."""
    from hf_polyattn.ops.triton import _kernels, causal

    for label, r, square, diag, tiles in (("polysketch-local r32", 32, True, False, True),
                                          ("polysketch-local r32, gathered", 32, True, False, False),
                                          ("polysketch r32", 32, True, True, True),
                                          ("polysketch r32, gathered", 32, True, True, False),
                                          ("linear-elu r64", 64, False, True, True)):
        a, b, c = _bench_inputs(n, H, r, 65)
        saved, causal.SQUARE_TILES = causal.SQUARE_TILES, tiles  # False: the layout before the square tiles
        try:
            with captured(_kernels) as launches:
                # linear elu+1 as the attention layer runs it: raw q, k, the activation applied on load
                p = causal._Plan(a, b, c, 256, diag, square, True, None if square else "elu")
                causal._forward(p, a, b, c)
                causal._backward(p, a, b, c, torch.randn(1, H, n, 65), True, True, True)
        finally:
            causal.SQUARE_TILES = saved
        yield label, launches


def local_cases(n: int, H: int):
    """(case, launches) of the exact local part: degree-4 and softmax diagonal blocks (b = 256), a 128 window."""
    from hf_polyattn.ops.triton import _local_kernels, local

    for label, kernel, window in (("blocks p4", "polynomial", 0), ("blocks softmax", "softmax", 0),
                                  ("window128 softmax", "softmax", 128)):
        q = torch.randn(1, H, 1, n, 64, dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn(1, H, 1, n, 65, dtype=torch.bfloat16)
        with captured(_local_kernels) as launches:
            p = local._Plan(q, k, v, 256, True, 0.125, kernel, None, 4, 0.0, 1.0, True, window)
            _, m = local._forward(p, q, k, v)
            local._backward(p, q, k, v, m, torch.randn(1, H, 1, n, 65), True, True)
        yield label, launches


def inspect(cases) -> list[dict]:
    rows, seen = [], {}
    for label, launches in cases:
        for name, fn, grid, args, kwargs in launches:
            consts = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            key = (name, json.dumps(consts, sort_keys=True, default=str))
            if key not in seen:
                ck = compile_sm90(fn, args, kwargs)
                # shared memory from Triton's metadata: its buffers are dynamic (cuobjdump shows static only)
                seen[key] = dict(read_cubin(ck.asm["cubin"]), shared=int(ck.metadata.shared))
            info = seen[key]
            warps = kwargs.get("num_warps", 4)
            programs = 1
            for g in grid:
                programs *= int(g)
            rows.append(dict(case=label, kernel=name, grid=[int(g) for g in grid], programs=programs,
                             num_warps=warps, num_stages=kwargs.get("num_stages", 3),
                             constexprs={k: v for k, v in consts.items() if k.isupper()},
                             per_sm=occupancy(info.get("reg", 0), info.get("shared", 0), warps), **info))
    return rows


def markdown(rows: list[dict], header: str) -> str:
    cols = ["case", "kernel", "programs", "warps", "stages", "reg", "stack", "shared KB", "per SM", *SASS_COLUMNS]
    out = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["case"], r["kernel"], r["programs"], r["num_warps"], r["num_stages"], r.get("reg", "?"),
                 r.get("stack", "?"), f"{r.get('shared', 0) / 1024:.1f}", r["per_sm"],
                 *(r["sass"][c] for c in SASS_COLUMNS)]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="inspect_triton_sm90.py")
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS / "inspect_triton_sm90"),
                   help="folder for sm90.md and sm90.json (default: %(default)s)")
    p.add_argument("--only", choices=("lt", "local"), default=None)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    import triton

    cases = []
    if args.only in (None, "lt"):
        cases += list(lt_cases(args.n, args.heads))
    if args.only in (None, "local"):
        cases += list(local_cases(args.n, args.heads))
    rows = inspect(cases)
    header = (f"Triton {triton.__version__}, compiled offline for sm_90 (H100), torch {torch.__version__}; "
              f"n = {args.n}, H = {args.heads}, d = 64, bf16 inputs, tf32 dots. Static counts of instructions in "
              "each kernel's code (not executed counts, not timings); `per SM`: programs resident at once by "
              "registers, shared memory and warps.")
    text = markdown(rows, header)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sm90.md"), "w") as fh:
        only = f" --only {args.only}" if args.only else ""
        fh.write(f"Command: `python recipes/inspect_triton_sm90.py{only}` (n = {args.n}, H = {args.heads})\n\n" + text)
    with open(os.path.join(args.out, "sm90.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
