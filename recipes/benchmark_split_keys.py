"""One decoding query of the softmax heads over many cached keys on the CPU: SDPA against the keys split in chunks
(``hf_polyattn.ops.hybrid._split_key_softmax``, what ``softmax_attention`` takes from ``_SPLIT_MIN_KEYS`` keys on).

    python recipes/benchmark_split_keys.py [--lengths 4096 8192 12288 16384 32768] [--kv-heads 1 2 3]
                                           [--repeats 40] [--threads 2] [--out DIR]

The shapes of a SmolLM2 layer's softmax heads while decoding: batch 1, G = 3 query heads per kv head, head dim 64,
float32, the keys and values a view of a buffer with room after them (as ``HybridState`` keeps them). Each call is
timed after a 64 MiB write that evicts the caches (in a model the weights' reads between two layers' attention do),
median of ``--repeats`` after 3 untimed; both paths checked to agree first. Printed and written to
``--out``/cpu-fp32.{md,json}`` with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "benchmark_split_keys"


def _median_us(fn, flush, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        flush.add_(1.0)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 12288, 16384, 32768])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS), help="(default: %(default)s)")
    args = p.parse_args(argv)

    import torch
    from torch.nn import functional as F

    from hf_polyattn import machine
    from hf_polyattn.ops.hybrid import _SPLIT_CHUNK, _SPLIT_MIN_KEYS, _split_key_softmax, buffer_length

    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(16 * 2**20)
    g, d, scale = 3, 64, 0.125
    rows = []
    for n in args.lengths:
        for hkv in args.kv_heads:
            room = buffer_length(n)  # what a HybridState's buffer holds after n tokens
            kbuf, vbuf = (torch.randn(1, hkv, room, d, generator=gen) for _ in range(2))
            k, v = kbuf[:, :, :n], vbuf[:, :, :n]
            q = torch.randn(1, hkv * g, 1, d, generator=gen)

            def sdpa(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

            def split(q=q, k=k, v=v):
                return _split_key_softmax(q, k, v, scale)

            torch.testing.assert_close(split(), sdpa(), rtol=1e-5, atol=1e-6)
            a, b = _median_us(sdpa, flush, args.repeats), _median_us(split, flush, args.repeats)
            rows.append({"keys": n, "kv_heads": hkv, "sdpa_us": a, "split_us": b, "sdpa_over_split": a / b})
            print(f"{n:>6} keys, {hkv} kv heads: SDPA {a:8.0f} us, split {b:8.0f} us, {a / b:.2f}x", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine.summary(), "threads": args.threads, "load_average_start": load,
            "load_average_end": os.getloadavg(), "repeats": args.repeats, "chunk": _SPLIT_CHUNK,
            "split_min_keys": _SPLIT_MIN_KEYS, "command": "python recipes/benchmark_split_keys.py "
            + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / "cpu-fp32.json").write_text(json.dumps({**info, "rows": rows}, indent=2) + "\n")
    lines = [f"`{info['command'].strip()}`", "",
             f"Machine: {info['machine']}; load average at start {load[0]:.2f}, at end "
             f"{info['load_average_end'][0]:.2f}. One query of batch 1, 3 query heads per kv head, d = 64, float32; "
             f"median of {args.repeats} calls after 3 untimed, caches evicted before each; chunks of {_SPLIT_CHUNK} "
             f"keys; `softmax_attention` splits from {_SPLIT_MIN_KEYS} keys on.", "",
             "| keys | kv heads | SDPA (us) | split (us) | SDPA / split |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['keys']} | {r['kv_heads']} | {r['sdpa_us']:.0f} | {r['split_us']:.0f} | "
              f"{r['sdpa_over_split']:.2f}x |" for r in rows]
    (out / "cpu-fp32.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'cpu-fp32.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
