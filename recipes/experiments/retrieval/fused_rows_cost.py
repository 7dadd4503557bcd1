"""What the fused rows (``window_flash.rows_flash``) save in a prefill with the sparse cache: one prompt of N random
tokens through a saved model, its sparse-cache rows through PyTorch's fused CPU kernel and as tensors
(``SparseMixin.fused_rows``), the two alternating, best of the repeats, and the largest difference of the last
position's logits between them.

    python -m recipes.experiments.retrieval.fused_rows_cost MODEL [--length 4096] [--repeats 2] [--threads 2]

Prints each timing and the ratio (tensors / fused) measured in this run; nothing is written.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a saved model whose layers have a sparse_cache (the linear-only preset's)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn import machine
    from hf_polyattn.checkpoints import load_model
    from hf_polyattn.ops.sparse import SparseMixin

    torch.set_num_threads(args.threads)
    model = load_model(args.model, AutoModelForCausalLM).eval()
    if not hf_polyattn.get_polyattn_config(model).sparse_cache:
        raise SystemExit(f"{args.model}: its layers have no sparse_cache, so nothing takes the fused rows")
    layers = [m for m in model.modules() if isinstance(m, SparseMixin)]
    ids = torch.randint(100, 40000, (1, args.length), generator=torch.Generator().manual_seed(0))
    best, last = {}, {}
    with torch.inference_mode():
        model(ids[:, :256])  # warm-up
        for rep in range(args.repeats):
            for fused in (True, False):
                for m in layers:
                    m.fused_rows = fused
                cache = hf_polyattn.PolyAttnCache(model)
                t0 = time.perf_counter()
                last[fused] = model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits[0, -1]
                seconds = time.perf_counter() - t0
                best[fused] = min(best.get(fused, seconds), seconds)
                print(f"repeat {rep}: fused_rows={fused}: {seconds:.2f} s", flush=True)
    diff = (last[True] - last[False]).abs().max().item()
    print(f"{args.length} tokens, best of {args.repeats}: fused {best[True]:.2f} s, as tensors {best[False]:.2f} s "
          f"({best[False] / best[True]:.2f}x); last logits differ by at most {diff:.2e}; {machine.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
