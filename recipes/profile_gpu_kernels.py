"""Where the GPU time of the Triton backend goes: kernel timings, a profile, layer timings vs SDPA.

Needs CUDA and triton. Times (triton.testing.do_bench, median ms) at H=16, d=64, bf16, B=1:

* ``sdpa_rows``: SDPA (flash) causal forward and forward+backward, n = 2k..64k;
* ``lt_rows``: the Triton causal product alone (``ops.triton.lt_multiply_triton``) for polysketch's
  squared sketches (r = 32, 16) and identity features (r = 64), with and without diagonal blocks,
  against the ``batched`` PyTorch product at 8k (and its max relative error against fp32), and
  as before three changes (``padded_e_*``: c's 65 columns padded to one 128-wide tile, the layout before
  the tail column; ``block_chunks_*``: 256-row chunks with the diagonal, before the chunk rule;
  ``gathered_*``: squared features gathered per element, before the column-scaled square tiles;
  ``block_states_*``: chunks of at most block_size rows, before chunks of at least F rows);
* ``local_rows``: the Triton exact local part alone (degree-4 and softmax blocks, a 128 window), with the
  dk/dv kernel's pipeline stages as now (1) and as before (2);
* ``profile_lt`` / ``profile_layer``: torch.profiler tables of one forward+backward at 32k (the
  product alone; a polysketch + local exact layer in a bf16 module);
* ``layer_rows``: whole PolyAttention layers (bf16 module, as in a bf16 model) per backend (``fla`` too
  for linear and performer when fla-core is installed), with peak memory; ``linear-elu`` on ``triton`` also
  as before its map moved into the kernels (backend ``triton-mapped``: ``attention.KERNEL_ACTIVATIONS = False``,
  elu + 1 applied in PyTorch to fp32 copies of q, k), and ``polysketch-local`` also with its recomputed
  features in one chunk of rows (backend ``triton-1chunk``: ``attention.FEATURE_CHUNKS = 1``, as before);
* ``profile_kinds``: linear-elu and the long-context default as the bench builds them, on 'fla' and on
  'triton': forward+backward time and a torch.profiler table each (n = 32k);
* ``switch_rows``: in one process, SDPA, the long-context default with its feature side compiled and eager,
  linear-elu at three smallest chunks of the Triton product, a profile table, fla-core's kernel (function doc);
* ``default_rows``: the switch rows of the long-context default alone, alternated twice;
* ``chunk_rows``: linear-elu at the product's smallest chunk 64 and 128, alternated three times;
* ``profile_shapes``: the long-context default's profile grouped by input shapes;
* ``scan_rows``: linear-elu and the long-context default with and without the fused normaliser and the state
  slots' Triton scan, alternated, SDPA and fla-core's kernel in the same process (function doc);
* ``tf32_rows``: the decayed product's gradients for bf16 inputs against float64, tf32 dots or fp32 ones, with
  and without the scan (function doc);
* ``fla_rows``: fla-core's ``chunk_linear_attn`` with elu+1 features, when fla-core is installed
  (its autotuning takes minutes on the first call of each shape).

    python recipes/profile_gpu_kernels.py --out recipes/results/profile_gpu_kernels
    python recipes/profile_gpu_kernels.py lt_rows profile_lt     # some sections only

Rows are printed as JSON lines (and written to <out>/rows.json at the end); the profiler tables
are printed. Tables in recipes/results/profile_gpu_kernels/ were made by running it with its
output captured (``| tee``).
"""
import argparse
import functools
import itertools
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention
from hf_polyattn.ops.causal import lt_multiply_batched

dev = "cuda"
H = 16
results = []


def rec(**kw):
    results.append(kw)
    print(json.dumps(kw), flush=True)


def fb(fn, *xs):
    def run():
        for x in xs:
            x.grad = None
        fn().float().sum().backward()
    return run


def peak_mb(run):
    """Peak memory of one call of ``run`` above what was allocated before it (MiB)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def inputs(n, r, e, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(1, H, n, r, generator=g) / r ** 0.5).to(dev, dtype).requires_grad_()
    b = (torch.randn(1, H, n, r, generator=g) / r ** 0.5).to(dev, dtype).requires_grad_()
    c = torch.randn(1, H, n, e, generator=g).to(dev, dtype).requires_grad_()
    return a, b, c


def print_profile(f, sort_by="cuda_time_total", row_limit=15, shapes=False, **table):
    """A torch.profiler table (CPU and CUDA activities) of one call of ``f`` after the queue drained; ``shapes``:
    grouped by operator and input shapes."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU],
                                record_shapes=shapes) as prof:
        f()
        torch.cuda.synchronize()
    print(prof.key_averages(group_by_input_shape=shapes).table(sort_by=sort_by, row_limit=row_limit, **table),
          flush=True)


def section(name, fn):
    try:
        fn()
    except Exception:
        print(f"!! {name} failed", flush=True)
        traceback.print_exc()
        torch.cuda.empty_cache()


def sdpa_rows():
    for n in (2048, 8192, 32768, 65536):
        q, k, v = (torch.randn(1, H, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        f = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        rec(what="sdpa", n=n, fwd_ms=do_bench(f), fb_ms=do_bench(fb(f, q, k, v)))


def lt_rows():
    for n in (8192, 32768, 65536):
        for r, square in ((32, True), (16, True), (64, False)):
            for diag in (True, False):
                a, b, c = inputs(n, r, 65)
                f = lambda a=a, b=b, c=c, d=diag, s=square: lt_multiply_triton(a, b, c, 256, d, s)  # noqa: E731
                row = dict(what="lt_triton", n=n, r=r, square=square, diag=diag, fwd_ms=do_bench(f),
                           fb_ms=do_bench(fb(f, a, b, c)), peak_mb=peak_mb(fb(f, a, b, c)))
                if n == 8192:
                    gb = lambda a=a, b=b, c=c, d=diag, s=square: lt_multiply_batched(a, b, c, 256, d, s)  # noqa: E731
                    row["batched_fb_ms"] = do_bench(fb(gb, a, b, c))
                    # accuracy against the batched fp32 path
                    ref = lt_multiply_batched(a.float(), b.float(), c.float(), 256, diag, square)
                    got = f()
                    row["max_rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
                # the same product as before four changes, in this run: e = 65 padded to one 128-wide tile
                # (before the tail column); chunks of block_size rows with the diagonal (before the chunk rule);
                # squared features gathered element by element (before the column-scaled square tiles); chunks
                # of at most block_size rows when F = 528 > 256 (before the state chunk rule; peak memory too)
                for knob, key in (("TAIL_COLUMN", "padded_e"), ("DIAG_CHUNK_RULE", "block_chunks"),
                                  ("SQUARE_TILES", "gathered"), ("STATE_CHUNK_RULE", "block_states")):
                    if (knob == "DIAG_CHUNK_RULE" and not diag) or (knob == "SQUARE_TILES" and not square) or (
                            knob == "STATE_CHUNK_RULE" and not (square and r * (r + 1) // 2 > 256)):
                        continue
                    setattr(causal, knob, False)
                    try:
                        row[f"{key}_fwd_ms"], row[f"{key}_fb_ms"] = do_bench(f), do_bench(fb(f, a, b, c))
                        row[f"{key}_peak_mb"] = peak_mb(fb(f, a, b, c))
                    finally:
                        setattr(causal, knob, True)
                rec(**row)
                del a, b, c
                torch.cuda.empty_cache()


def profile_lt():
    a, b, c = inputs(32768, 32, 65)
    f = fb(lambda: lt_multiply_triton(a, b, c, 256, False, True), a, b, c)
    f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)


def local_rows():
    """The exact local part alone (``ops.triton.local_blocks_triton``): degree-4 and softmax diagonal blocks
    (b = 256) and a 128 window, forward and forward+backward, with the dk/dv kernel at one pipeline stage (now)
    and at two (``dkv_stages2_fb_ms``: before; it spilled registers on sm_90)."""
    from hf_polyattn.ops.triton import local, local_blocks_triton

    for n in (8192, 32768):
        for kernel, window in (("polynomial", 0), ("softmax", 0), ("softmax", 128)):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, H, 1, n, 64 + (i == 2), generator=g).to(dev, torch.bfloat16).requires_grad_()
                       for i in range(3))

            def f(q=q, k=k, v=v, kernel=kernel, window=window):
                return local_blocks_triton(q, k, v, 256, True, 0.125, kernel, None, 4, 0.0, 1.0, True, window)[0]
            row = dict(what="local_triton", n=n, kernel=kernel, window=window, fwd_ms=do_bench(f),
                       fb_ms=do_bench(fb(f, q, k, v)))
            saved, local.DKV_STAGES = local.DKV_STAGES, 2
            try:
                row["dkv_stages2_fb_ms"] = do_bench(fb(f, q, k, v))
            finally:
                local.DKV_STAGES = saved
            rec(**row)
            del q, k, v
            torch.cuda.empty_cache()


LAYER = {
    "polysketch": dict(kind="polysketch"),
    "polysketch-local": dict(kind="polysketch", sketch="learned", local_exact=True),
    "polysketch-window128": dict(kind="polysketch", sketch_size=32, window=128, feature_proj=64),
    "linear-elu": dict(kind="linear"),
    "performer": dict(kind="performer", num_features=256),
    "sliding-window128": dict(kind="sliding_window", window=128),
}


def layer_rows():
    from hf_polyattn.ops import attention
    from hf_polyattn.ops.backend import fla_available

    chunks = attention.FEATURE_CHUNKS
    for label, opts in LAYER.items():
        # backend='fla' (fla-core's chunk kernel) serves identity features with the diagonal: linear, performer
        fla = ("fla",) if fla_available() and opts["kind"] in ("linear", "performer") else ()
        # the same layer as before a change, in the same run (module switches)
        before = {"linear-elu": ("triton-mapped",), "polysketch-local": ("triton-1chunk",)}.get(label, ())
        for row in ("triton", *before, "batched", *fla):
            backend = row.split("-")[0]
            pa = PolyAttention(PolyAttnConfig(backend=backend, **opts), H, 64).to(dev).to(torch.bfloat16)
            attention.KERNEL_ACTIVATIONS = row != "triton-mapped"
            attention.FEATURE_CHUNKS = 1 if row == "triton-1chunk" else chunks
            for n in (2048, 8192, 32768, 65536):
                if backend == "batched" and n > 32768:
                    continue
                q, k, v = (torch.randn(1, H, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                f = lambda pa=pa, q=q, k=k, v=v: pa(q, k, v, causal=True)  # noqa: E731
                try:
                    torch.cuda.reset_peak_memory_stats()
                    rec(what="layer", kind=label, backend=row, n=n, fwd_ms=do_bench(f),
                        fb_ms=do_bench(fb(f, q, k, v)), peak_mb=torch.cuda.max_memory_allocated() / 2**20)
                except Exception as err:
                    rec(what="layer", kind=label, backend=row, n=n, error=repr(err)[:300])
                del q, k, v
                torch.cuda.empty_cache()
            attention.KERNEL_ACTIVATIONS, attention.FEATURE_CHUNKS = True, chunks


def profile_layer():
    pa = PolyAttention(PolyAttnConfig(kind="polysketch", sketch="learned", local_exact=True, backend="triton"),
                       H, 64).to(dev).to(torch.bfloat16)
    q, k, v = (torch.randn(1, H, 32768, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    f = fb(lambda: pa(q, k, v, causal=True), q, k, v)
    f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        f()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)


def profile_kinds():
    """Two benchmark rows as ``hf-polyattn bench --device cuda`` builds them (bf16 module, n = 32k): linear-elu and
    the long-context default (linear-elu-window128-gate), each on 'fla' (where it runs: fla-core refuses the
    default's gated backward on Hopper with Triton < 3.7.1, and the row says so) and on 'triton': forward+backward
    time and a torch.profiler table of one forward+backward (top 15 by CUDA time)."""
    from hf_polyattn.bench import kind_rows

    rows = kind_rows()
    for label in ("linear-elu", "linear-elu-window128-gate"):
        for backend in ("fla", "triton"):
            pa = PolyAttention(PolyAttnConfig(**{**rows[label], "backend": backend}), H, 64).to(dev).to(torch.bfloat16)
            q, k, v = (torch.randn(1, H, 32768, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            f = fb(lambda pa=pa, q=q, k=k, v=v: pa(q, k, v, causal=True), q, k, v)
            try:
                rec(what="kind", kind=label, backend=backend, n=32768, fb_ms=do_bench(f))
            except ValueError as err:  # refused by name (the gated layer on 'fla', above)
                rec(what="kind", kind=label, backend=backend, n=32768, refused=str(err)[:300])
                continue
            print_profile(f, max_name_column_width=70)
            del q, k, v, pa
            torch.cuda.empty_cache()


def _switch_row(run, n, **what):
    """One row of switch_rows / default_rows: ``run`` once (compiling outside the timing), then its median time and
    peak; a failure is recorded and the other rows still run."""
    try:
        run()
        rec(what="switch", n=n, **what, fb_ms=do_bench(run), peak_mib=peak_mb(run))
    except Exception as err:
        rec(what="switch", n=n, **what, failed=f"{type(err).__name__}: {err}"[:300])


def _fla_row(n):
    """fla-core's ``chunk_linear_attn`` with elu+1 features as a switch row (fla-core's layout (B, n, H, d), as
    fla_rows), last in a section: its first call autotunes."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        rec(what="switch", n=n, row="fla-linear-elu", failed="fla-core is not installed")
        return
    qf, kf, vf = (torch.randn(1, n, H, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    _switch_row(fb(lambda: chunk_linear_attn(F.elu(qf) + 1, F.elu(kf) + 1, vf, normalize=True)[0], qf, kf, vf), n,
                row="fla-linear-elu")


def _kind_layer(label, q, k, v, **extra):
    """Forward + backward of the benchmark row ``label`` (a bf16 module, as ``hf-polyattn bench`` builds it)."""
    from hf_polyattn.bench import kind_rows

    pa = PolyAttention(PolyAttnConfig(**{**kind_rows()[label], **extra}), H, 64).to(dev).to(torch.bfloat16)
    return fb(lambda: pa(q, k, v, causal=True), q, k, v)


def _default_rows(q, k, v, rounds):
    """SDPA, then the long-context default with and without a projection, its feature side compiled and eager,
    ``rounds`` times alternated."""
    import hf_polyattn.ops.attention as attention_mod

    n = q.shape[-2]
    _switch_row(fb(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v), n, row="sdpa")
    for rnd in range(rounds):
        for compiled in (True, False):
            attention_mod.COMPILED_FEATURES = compiled
            for extra in ({}, {"feature_proj": 64}):
                _switch_row(_kind_layer("linear-elu-window128-gate", q, k, v, **extra), n, round=rnd,
                            compiled_features=compiled, row="linear-elu-window128-gate" + ("+proj64" if extra else ""))
    attention_mod.COMPILED_FEATURES = True


def default_rows():
    """SDPA and the long-context default (with and without a retrofit's projection) with its feature side compiled
    and eager, alternated twice in one process (n = 32k, H = 16, bf16, forward + backward, median ms, peak MiB)."""
    n = 32768
    q, k, v = (torch.randn(1, H, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    _default_rows(q, k, v, rounds=2)


def switch_rows():
    """In one process at n = 32k, H = 16, bf16, as ``hf-polyattn bench --device cuda`` builds the rows (forward +
    backward, median ms, and the peak MiB of one call above its inputs): SDPA; the long-context default
    (linear-elu-window128-gate) and the same with a retrofit's projection to head_dim, each with its feature side
    compiled (``attention.COMPILED_FEATURES``, as 'auto' runs it on CUDA) and recomputed eagerly (as before);
    linear-elu at ``causal.MIN_DIAG_CHUNK`` 64 / 128 / 256; a torch.profiler table of the default as it runs now;
    fla-core's ``chunk_linear_attn`` last (its first call autotunes for minutes)."""
    n = 32768
    q, k, v = (torch.randn(1, H, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    row = functools.partial(_switch_row, n=n)

    def layer(label, **extra):
        return _kind_layer(label, q, k, v, **extra)

    _default_rows(q, k, v, rounds=1)
    default = causal.MIN_DIAG_CHUNK
    for chunk in (64, 128, 256):
        causal.MIN_DIAG_CHUNK = chunk
        row(layer("linear-elu"), row="linear-elu", min_diag_chunk=chunk)
    causal.MIN_DIAG_CHUNK = default
    f = layer("linear-elu-window128-gate")
    f()
    print_profile(f, sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
    _fla_row(n)


def chunk_rows():
    """linear-elu (bf16 module, n = 32k, forward + backward) at ``causal.MIN_DIAG_CHUNK`` 64 and 128, alternated
    three times in one process: the spread of each against the difference (switch_rows timed each once)."""
    from hf_polyattn.bench import kind_rows

    n = 32768
    q, k, v = (torch.randn(1, H, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    pa = PolyAttention(PolyAttnConfig(**kind_rows()["linear-elu"]), H, 64).to(dev).to(torch.bfloat16)
    f = fb(lambda: pa(q, k, v, causal=True), q, k, v)
    default = causal.MIN_DIAG_CHUNK
    for rnd in range(3):
        for chunk in (64, 128):
            causal.MIN_DIAG_CHUNK = chunk
            f()
            rec(what="chunk", n=n, round=rnd, min_diag_chunk=chunk, fb_ms=do_bench(f))
    causal.MIN_DIAG_CHUNK = default


def scan_rows():
    """In one process at n = 32k, H = 16, bf16, forward + backward (median ms, peak MiB of one call), the bench's rows
    as 'auto' runs them: SDPA; linear-elu and the long-context default (linear-elu-window128-gate) as now, without
    the fused normaliser (``common.FUSED_NORMALISER``: the PyTorch composition) and also without the state slots'
    Triton scan (``causal.SCAN_KERNEL``: torch's cumsum, ``decayed_running_sums``), alternated twice; a
    torch.profiler table of each row as now; fla-core's ``chunk_linear_attn`` last (its first call autotunes)."""
    from hf_polyattn.ops import common

    n = 32768
    q, k, v = (torch.randn(1, H, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    row = functools.partial(_switch_row, n=n)
    row(fb(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v), row="sdpa")
    layers = {label: _kind_layer(label, q, k, v) for label in ("linear-elu", "linear-elu-window128-gate")}
    for rnd in range(2):
        for scan, fused in ((True, True), (True, False), (False, False)):
            causal.SCAN_KERNEL, common.FUSED_NORMALISER = scan, fused
            for label, f in layers.items():
                row(f, row=label, scan_kernel=scan, fused_normaliser=fused, round=rnd)
    causal.SCAN_KERNEL = common.FUSED_NORMALISER = True
    for label, f in layers.items():
        print(f"-- profile: {label}, scan kernel", flush=True)
        print_profile(f, sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60)
    _fla_row(n)


def tf32_rows():
    """The decayed product's gradients against float64 for bf16 inputs (tests/ops/test_decay.py's test_bf16_inputs
    case: n = 37, r = 4, e = 5, block 8, 2 x 2 query heads on 2 kv heads), with the kernels' dots in tf32 (what half
    inputs take by default) and in fp32 accuracy (tf32=False), the state slots' running sums on the Triton scan and
    on the PyTorch paths: whether each gradient is within the test's tolerance (2^-8 relative + 1e-3), its largest
    error relative to its element (at least 1e-3) and to its largest element."""
    from hf_polyattn.ops.backend import lt_product
    from hf_polyattn.ops.reference import reference_lt_product

    gen = torch.Generator().manual_seed(11)
    a, b, c = (torch.randn(*lead, 37, w, generator=gen, dtype=torch.float64)
               for lead, w in (((2, 2), 4), ((2, 1), 4), ((2, 1), 5)))
    klog = (-0.3 * torch.rand(2, 1, 37, generator=gen, dtype=torch.float64)).cumsum(-1)
    qlog = klog - 0.3 * torch.rand(2, 2, 37, generator=gen, dtype=torch.float64)
    xs = [x.to(dev, torch.bfloat16 if i < 3 else torch.float32).requires_grad_()
          for i, x in enumerate((a, b, c, qlog, klog))]
    x64 = [x.detach().cpu().double().requires_grad_() for x in xs]
    # the same bf16 values in fp32 tensors: gradients stored in fp32, not rounded to bf16 by the kernels' stores
    x32 = [x.detach().float().requires_grad_() for x in xs]
    g = torch.randn(2, 2, 37, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for square in (False, True):
        want = torch.autograd.grad(reference_lt_product(*x64[:3], 8, True, square, tuple(x64[3:])), x64, g)
        for (inputs, leaves), tf32, scan in itertools.product((("bf16", xs), ("fp32 of bf16 values", x32)),
                                                              (None, False), (True, False)):
            causal.SCAN_KERNEL = scan
            out = lt_product(*leaves[:3], 8, True, square, "triton", tf32=tf32, decay=tuple(leaves[3:]))
            got = torch.autograd.grad(out, leaves, g.to(dev, out.dtype))
            for name, x, y in zip(("a", "b", "c", "qlog", "klog"), got, want):
                err = (x.cpu().double() - y).abs()
                rec(what="tf32", square=square, inputs=inputs, tf32=tf32, scan_kernel=scan, grad=name,
                    max_abs=err.max().item(),
                    within_test_tolerance=bool((err <= 1e-3 + 2**-8 * y.abs()).all()),
                    max_rel=(err / y.abs().clamp_min(1e-3)).max().item(), max_abs_over_max=(err.max() /
                                                                                           y.abs().max()).item())
    causal.SCAN_KERNEL = True


def profile_shapes():
    """The long-context default (bf16 module, n = 32k, forward + backward, as it runs now): a torch.profiler table
    grouped by operator and input shapes, top 40 by self CUDA time (which copies and elementwise passes remain)."""
    from hf_polyattn.bench import kind_rows

    n = 32768
    q, k, v = (torch.randn(1, H, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    pa = PolyAttention(PolyAttnConfig(**kind_rows()["linear-elu-window128-gate"]), H, 64).to(dev).to(torch.bfloat16)
    f = fb(lambda: pa(q, k, v, causal=True), q, k, v)
    f()
    print_profile(f, sort_by="self_cuda_time_total", row_limit=40, shapes=True, max_name_column_width=40,
                  max_shapes_column_width=120)


def fla_rows():
    from fla.ops.linear_attn import chunk_linear_attn
    for n in (8192, 32768):
        q, k, v = (torch.randn(1, n, H, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

        def f(q=q, k=k, v=v):
            return chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v, normalize=True)[0]
        rec(what="fla_linear_elu", n=n, fwd_ms=do_bench(f), fb_ms=do_bench(fb(f, q, k, v)))


SECTIONS = ["sdpa_rows", "lt_rows", "local_rows", "profile_lt", "layer_rows", "profile_layer", "fla_rows",
            "profile_kinds", "switch_rows", "chunk_rows", "profile_shapes", "default_rows", "scan_rows",
            "tf32_rows"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="profile_gpu_kernels.py")
    p.add_argument("sections", nargs="*", choices=SECTIONS, default=SECTIONS, help="what to run (default: all)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for rows.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the Triton kernels run on CPU only under TRITON_INTERPRET=1, for tests)")
    global triton, do_bench, lt_multiply_triton, causal
    import triton
    from triton.testing import do_bench

    from hf_polyattn.ops.triton import causal, lt_multiply_triton
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    for name in args.sections:
        print(f"== {name}", flush=True)
        section(name, globals()[name])
    with open(os.path.join(args.out, "rows.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
