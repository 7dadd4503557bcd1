"""What ``sparse_observe`` adds to a prefill: one prompt of N random tokens through a saved model with its sparse
cache, with and without the re-choice, the two alternating, best of the repeats.

    python -m recipes.experiments.retrieval.observe_cost MODEL --length 4096 --sparse-cache 512 --observe 16 \
        [--set FIELD=VALUE ...] [--repeats 2] [--threads 2]

Prints each timing and the ratio (with / without) measured in this run; nothing is written.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--sparse-cache", type=int, default=512)
    ap.add_argument("--observe", type=int, default=16)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="more settings that add no tensor, for both runs (e.g. decay_max_horizon=256)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn import machine
    from hf_polyattn.checkpoints import load_model
    from hf_polyattn.cli import parse_settings

    torch.set_num_threads(args.threads)
    model = load_model(args.model, AutoModelForCausalLM).eval()
    extra = parse_settings(hf_polyattn.get_polyattn_config(model).kind, args.set)
    ids = torch.randint(100, 40000, (1, args.length), generator=torch.Generator().manual_seed(0))
    best = {}
    for rep in range(args.repeats):
        for observe in (0, args.observe):
            hf_polyattn.reconfigure(model, sparse_cache=args.sparse_cache, sparse_observe=observe, **extra)
            cache = hf_polyattn.PolyAttnCache(model)
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True)
            seconds = time.perf_counter() - t0
            best[observe] = min(best.get(observe, seconds), seconds)
            print(f"repeat {rep}: sparse_observe={observe}: {seconds:.2f} s", flush=True)
    print(f"{args.length} tokens, sparse_cache={args.sparse_cache}, best of {args.repeats}: without "
          f"{best[0]:.2f} s, with sparse_observe={args.observe} {best[args.observe]:.2f} s "
          f"({best[args.observe] / best[0]:.2f}x); {machine.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
