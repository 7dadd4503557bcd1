"""Where along an 8k window a linear-only retrofit loses to softmax (issue 32: perplexity must not rise from 1k to
8k). The study's first 8,192 held-out tokens (``--data demo``, what ``hf-polyattn eval --contexts 8192`` scores in
its first window) go through each model in one call; the mean next-token NLL per position bucket is printed for each
(model, settings) and its ratio exp(NLL - NLL_softmax) to the first model's (softmax SmolLM2 by default). A gap that
grows along the window is what the far context costs (the state, the bounded cache, the sinks' distance); a flat one
is the near part (the window, the features).

    python -m recipes.experiments.retrieval.probe_position_loss smollm2 \
        'runs/retrieval/hh/model|decay_max_horizon=256,sparse_cache=512,sparse_observe=16' [--tokens 8192] \
        [--data demo|licenses] [--out FILE.json]

Each argument is MODEL or MODEL|FIELD=VALUE,... (``hf_polyattn.reconfigure``'s settings, as eval's --set).
``attention_carry=X`` among them is not a field: it sets ``hf_polyattn.ops.sparse.ATTENTION_CARRY`` (what
``sparse_score='attention'`` keeps of a cached key's earlier score, 0.9) for that model only.
``--data licenses`` reads the held-out license texts of ``long_context/heldout_licenses.py`` instead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

BUCKETS = (0, 256, 1024, 2048, 4096, 6144, 8192, 16384, 32768)


def bucket_means(nll: torch.Tensor) -> dict[str, float]:
    """Mean of ``nll`` (n,) (position t: the loss of token t + 1) over [a, b) of ``BUCKETS`` that it reaches."""
    out = {}
    for a, b in zip(BUCKETS, BUCKETS[1:]):
        if a >= nll.numel():
            break
        out[f"{a}-{min(b, nll.numel())}"] = float(nll[a:b].mean())
    return out


def main(argv: list[str] | None = None, command: str = "python -m recipes.experiments.retrieval.probe_position_loss"
         ) -> int:
    """``command``: how the JSON of --out names the run (a probe that wraps this one names itself)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="MODEL or MODEL|FIELD=VALUE,... (the first is the reference)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--data", choices=("demo", "licenses"), default="demo")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn.checkpoints import load_model, load_tokenizer
    from hf_polyattn.cli import parse_settings, resolve_model
    from hf_polyattn.data import load_text_data
    from hf_polyattn.ops import sparse

    torch.set_num_threads(args.threads)
    first = resolve_model(args.models[0].split("|")[0])
    tok = load_tokenizer(first)
    if args.data == "demo":
        ids = load_text_data("demo", tok, max_eval_tokens=args.tokens).eval_ids[: args.tokens]
    else:
        from recipes.experiments.long_context.heldout_licenses import licenses_text

        ids = torch.tensor(tok(licenses_text(), add_special_tokens=False)["input_ids"])[: args.tokens]
    if ids.numel() < args.tokens:
        raise SystemExit(f"--tokens: only {ids.numel()} held-out tokens")
    rows, reference = [], None
    for spec in args.models:
        name, _, sets = spec.partition("|")
        t0 = time.time()
        model = load_model(resolve_model(name), AutoModelForCausalLM).eval()
        items = [x for x in sets.split(",") if x] if sets else []
        carry = [float(x.partition("=")[2]) for x in items if x.startswith("attention_carry=")]
        items = [x for x in items if not x.startswith("attention_carry=")]
        if items:
            kind = hf_polyattn.get_polyattn_config(model).kind
            hf_polyattn.reconfigure(model, **parse_settings(kind, items))
        default_carry = sparse.ATTENTION_CARRY
        sparse.ATTENTION_CARRY = carry[-1] if carry else default_carry
        try:
            with torch.inference_mode():
                logits = model(ids[None]).logits[0, :-1].float()
        finally:
            sparse.ATTENTION_CARRY = default_carry
        nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
        means = bucket_means(nll)
        if reference is None:
            reference = means
        ratio = {k: math.exp(v - reference[k]) for k, v in means.items()}
        rows.append({"model": spec, "nll": means, "ratio": ratio, "ppl": math.exp(float(nll.mean())),
                     "seconds": round(time.time() - t0, 1)})
        print(f"{spec}: ppl {rows[-1]['ppl']:.2f} ({rows[-1]['seconds']} s)")
        print("   " + "  ".join(f"{k}: {means[k]:.3f} ({ratio[k]:.3f}x)" for k in means), flush=True)
        del model
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = command + " " + " ".join(
            f"'{a}'" if "|" in a else a for a in (argv if argv is not None else sys.argv[1:]))
        from hf_polyattn import machine

        args.out.write_text(json.dumps({"command": command, "machine": machine.describe(), "data": args.data,
                                        "tokens": args.tokens, "threads": args.threads, "rows": rows}, indent=1)
                            + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
