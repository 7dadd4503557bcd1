"""What computing a cached call's own rows saves for ``kind='sliding_window'`` (StreamingLLM at matched memory): one
decode step of a softmax checkpoint converted to 4 sinks + a W-key window, after a prompt of W + 256 random tokens,
through the three paths ``SlidingWindowAttention`` has for it: the fused CPU kernel on the step's rows
(``_window_rows``), the same rows as float32 tensors (``_window_rows_dense``: what a CUDA, half-precision or
training call takes) and the padded path (every key row of the window computed, the last kept: ``cached_rows =
False``). The three alternate, best of the repeats; the largest difference of the step's logits from the padded
path's is printed beside each.

    python -m recipes.experiments.ruler_matched.window_rows_cost [--model smollm2] [--window 2176] [--repeats 2]
        [--threads 1]

Prints each timing and its ratio to the padded path measured in this run, with the machine and its load; nothing is
written.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a softmax causal LM: a folder, a Hub id or 'smollm2'")
    ap.add_argument("--window", type=int, default=2176, help="the window (2,176: 128 + the preset's 2,048 keys)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import hf_polyattn
    from hf_polyattn import machine
    from hf_polyattn.checkpoints import load_model, resolve_checkpoint
    from hf_polyattn.eval.long_context import streaming_config
    from hf_polyattn.kinds.sliding_window import SlidingWindowAttention as SWA

    torch.set_num_threads(args.threads)
    model = load_model(resolve_checkpoint(args.model), dtype=torch.float32).eval()
    hf_polyattn.convert(model, streaming_config(sinks=4, window=args.window))
    n = args.window + 256
    ids = torch.randint(100, 20000, (1, n + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prompt = model(ids[:, :n], use_cache=True)
    cache = hf_polyattn.returned_cache(prompt)
    fused_exact = SWA._fused_exact

    def step(path: str) -> tuple[float, torch.Tensor]:
        import copy

        SWA.cached_rows = path != "padded"
        SWA._fused_exact = fused_exact if path == "fused" else (lambda self, q: False)
        c = copy.deepcopy(cache)  # each step on the prompt's cache, not on the previous step's
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                out = model(ids[:, n:], use_cache=True, **hf_polyattn.cache_kwargs(c)).logits[0, -1]
                return time.perf_counter() - t0, out
        finally:
            SWA.cached_rows, SWA._fused_exact = True, fused_exact

    paths = ("fused", "dense", "padded")
    best: dict[str, float] = {}
    logits: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for path in paths:
            seconds, logits[path] = step(path)
            best[path] = min(best.get(path, float("inf")), seconds)
    print(f"{machine.describe()}; load: {machine.uptime()}")
    print(f"{args.model} as StreamingLLM (4 sinks + a {args.window:,}-key window), one decode step after "
          f"{n:,} tokens, best of {args.repeats}:")
    for path in paths:
        diff = float((logits[path] - logits["padded"]).abs().max())
        print(f"  {path:>6}: {best[path]:8.3f} s  ({best['padded'] / best[path]:7.1f}x faster than padded; "
              f"largest logit difference from padded {diff:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
