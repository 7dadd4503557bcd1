"""Probe for issue 32: how much the kernel part moves a linear-only retrofit's outputs on real text. For each model
(the trained row hh and hh_loop, its further training with the cache in the loop), with the preset's inference
settings (sparse_cache=512, sparse_observe=16, decay_max_horizon=256), on the last N tokens' worth of the bundled
text's tail (held out: the demo split holds out the last 10% of its lines), one call: the mean next-token NLL as is
and with ``window_mix`` 0 in every layer (the kernel part off), the largest logit change that makes, and the largest
logit change between the two models. Attention transfer trains only the kernel part's parameters.

    python -m recipes.experiments.retrieval.probe_farshare [N=1024]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
MODELS = ("runs/retrieval/hh/model", "runs/retrieval/hh_loop/model")


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_polyattn

    argv = sys.argv[1:] if argv is None else argv
    n = int(argv[0]) if argv else 1024
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(ROOT / MODELS[0])
    text = (ROOT / "hf_polyattn" / "bundled" / "tinyshakespeare.txt").read_text()
    ids = tok(text[-60000:], return_tensors="pt").input_ids[:, :n]
    logits = {}
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(ROOT / name).eval()
        hf_polyattn.reconfigure(model, sparse_cache=512, sparse_observe=16, decay_max_horizon=256.0)
        with torch.no_grad():
            a = model(ids).logits
            nll = torch.nn.functional.cross_entropy(a[0, :-1], ids[0, 1:])
            for pname, p in model.named_parameters():
                if pname.endswith("window_mix"):
                    p.zero_()
            b = model(ids).logits
            nll_off = torch.nn.functional.cross_entropy(b[0, :-1], ids[0, 1:])
        logits[name] = a
        print(f"{name}: {n} tokens, NLL {float(nll):.4f}, kernel part off {float(nll_off):.4f}, "
              f"max |logit change| {float((a - b).abs().max()):.3f}")
    x, y = logits.values()
    print(f"{MODELS[0]} against {MODELS[1]}: max |logit change| {float((x - y).abs().max()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
