"""A saved model with settings that add no tensor against the softmax checkpoint it came from, on one passkey prompt
(``probe_observe_diag``'s draw): how far apart their next-token distributions are over the prompt's last positions
(KL(softmax || model), top-1 agreement) and each one's greedy answer. With a sparse cache that holds every key of the
prompt (``--set sparse_cache=N``, N >= the prompt's length: nothing is evicted, the kernel state stays empty) the
model's attention is meant to be the checkpoint's exactly; what still differs is a setting of the exact part.

    python -m recipes.experiments.retrieval.probe_against_softmax runs/retrieval/hh/model --length 8182 \
        --template vault --depth-index 2 --set sparse_cache=8192 --set decay_max_horizon=256 [--set sink_position=own]
"""

from __future__ import annotations

import torch


def divergence(model_logits: torch.Tensor, base_logits: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(KL(base || model) per position, the share of positions whose argmax agrees) of (positions, vocab) logits,
    in float32."""
    lp, lq = model_logits.float().log_softmax(-1), base_logits.float().log_softmax(-1)
    kl = (lq.exp() * (lq - lp)).sum(-1)
    return kl, (lp.argmax(-1) == lq.argmax(-1)).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, DynamicCache

    import hf_polyattn
    from hf_polyattn.checkpoints import load_model, resolve_checkpoint

    from .probe_observe_diag import greedy_answer, load_prompt, prompt_parser

    ap = prompt_parser(__doc__.split("\n\n")[0], "vault", 2)
    ap.add_argument("--base", default="smollm2", help="the softmax checkpoint (default: smollm2)")
    ap.add_argument("--positions", type=int, default=64, help="the prompt's last positions compared")
    args = ap.parse_args(argv)
    tok, model, drawn, pp, ids = load_prompt(args)
    base = load_model(resolve_checkpoint(args.base), AutoModelForCausalLM).eval()
    logits, answers = {}, {}
    for name, m, cache in (("model", model, hf_polyattn.PolyAttnCache(model)), ("softmax", base, DynamicCache())):
        with torch.inference_mode():
            out = m(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits[0]
        logits[name] = out[-args.positions:]
        answers[name] = tok.decode(greedy_answer(m, cache, out[-1:], args.new_tokens))
    kl, agree = divergence(logits["model"], logits["softmax"])
    print(f"key {drawn['key']}, prompt of {ids.shape[1]} tokens; answers: model {answers['model']!r}, "
          f"softmax {answers['softmax']!r}")
    print(f"last {args.positions} positions: KL(softmax || model) mean {kl.mean():.4f} max {kl.max():.4f}; "
          f"top-1 agreement {agree:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
