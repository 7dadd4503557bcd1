"""Probe for issue 32: is a sparse cache chosen *by the question* enough to retrieve at 4k with every head
linear-time? (SnapKV's observation window, Li et al. 2024, arXiv:2404.14469, on this library's bounded cache.)

    python -m recipes.experiments.retrieval.probe_question_select MODEL --length 4096 --depths 10 \
        --rules library all question --cache 128 [--out DIR]

For each passkey prompt of ``hf-polyattn eval --passkey LENGTH --passkey-depths DEPTHS --passkey-templates
TEMPLATE`` (seed 0: the same keys and prompts; hits: the first number answered is the key), one rule at a time:

- ``library``: the model with ``sparse_cache=CACHE`` as the library runs it (recall-error selection while the prompt
  streams, the rest folded into the kernel state);
- ``all``: every key kept exactly (``sparse_cache`` = the prompt's length: nothing is ever folded);
- ``question``: the prompt but its last token prefilled with every key kept (as ``all``), then each layer's cache cut
  to the CACHE keys per kv head that the prompt's last ``--observe`` queries (the question) attend most: their
  softmax weights over the cached keys, summed over the queries and the kv head's query heads, max-pooled over
  ``--pool`` neighbouring positions (SnapKV); the sinks, the window and the pending block stay as they are, the
  evicted keys are dropped (nothing was folded, so the kernel state stays empty), and the last prompt token and
  every answer token are computed from that bounded state alone. Decode memory is then constant (sinks + window +
  pending block + CACHE keys per kv head); the prefill holds every key, as any prefill holds its activations.

A probe, not a library option: it reads the states' fields directly and changes ``sparse_cache`` between the prefill
and the decoding by ``hf_polyattn.reconfigure``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import time
from pathlib import Path

import torch

NUMBER = re.compile(r"\d+")


def _keep(state, cache: int, queries: torch.Tensor, groups: int, scale: float, pool: int):
    """``state`` (a RecurrentState with every key in its sparse cache) with only the ``cache`` cached keys per kv
    head that ``queries`` (B, H, L, d) attend most (module docstring); the kept keys stay in their order."""
    k, mask = state.sparse_k.float(), state.sparse_mask  # (B, Hkv, S, d), (B, Hkv, S)
    b, hkv, slots, d = k.shape
    q = queries.float().reshape(b, hkv, groups * queries.shape[2], d)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hkv, G L, S)
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf")).softmax(-1).sum(2)  # (B, Hkv, S)
    if pool > 1:
        scores = torch.nn.functional.max_pool1d(scores.reshape(b * hkv, 1, slots), pool, 1, pool // 2)
        scores = scores.reshape(b, hkv, slots)
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.topk(min(cache, slots), dim=-1).indices.sort(-1).values  # (B, Hkv, cache)

    def take(t):
        if t is None:
            return None
        index = top if t.dim() == 3 else top[..., None].expand(*top.shape, t.shape[-1])
        return t.gather(2, index)

    return dataclasses.replace(state, sparse_k=take(state.sparse_k), sparse_v=take(state.sparse_v),
                               sparse_mask=take(state.sparse_mask), sparse_kin=take(state.sparse_kin),
                               sparse_logs=take(state.sparse_logs))


def _answer(model, tok, cache, last: torch.Tensor, new_tokens: int) -> str:
    """Greedy tokens from ``last`` (1, 1) through ``cache``."""
    import hf_polyattn

    out, token = [], last
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits = model(token, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            out.append(int(token))
    return tok.decode(out, skip_special_tokens=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depths", type=int, default=10)
    ap.add_argument("--rules", nargs="+", default=["library", "all", "question"],
                    choices=["library", "all", "question"])
    ap.add_argument("--cache", type=int, default=128)
    ap.add_argument("--template", default="classic", help="the passkey template (hf_polyattn.eval.passkey.TEMPLATES)")
    ap.add_argument("--observe", type=int, default=16, help="the prompt's last queries that score the keys")
    ap.add_argument("--pool", type=int, default=7, help="max-pooling width over key positions (1: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn.checkpoints import load_model, load_tokenizer
    from hf_polyattn.eval.long_context import _answer_tokens
    from hf_polyattn.eval.passkey import draw_passkey, passkey_prompt
    from hf_polyattn.integration.state import HFPolyAttention

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, AutoModelForCausalLM).eval()
    new_tokens = _answer_tokens(args.template)
    rng = random.Random(0)
    grid = [(i + 0.5) / args.depths for i in range(args.depths)]
    cells = []
    for depth in grid:
        drawn = draw_passkey(rng, args.template)
        ids = passkey_prompt(tok, length=args.length, depth=depth, template=args.template, **drawn).prompt
        cells.append((depth, drawn["key"], torch.tensor([ids])))
    every = args.length + new_tokens + 64  # a cache that holds every key of the prompt and the answer
    results = {"settings": vars(args), "depths": grid, "keys": [key for _, key, _ in cells], "rules": {}}
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for rule in args.rules:
        hits, answers, seconds = [], [], []
        for depth, key, ids in cells:
            t0 = time.time()
            hf_polyattn.reconfigure(model, sparse_cache=args.cache if rule == "library" else every)
            cache = hf_polyattn.PolyAttnCache(model)
            if rule == "question":
                seen = {}
                modules = [m for m in model.modules() if isinstance(m, HFPolyAttention)]

                def grab(module, a, kw, seen=seen):
                    query = a[0] if a else kw["query"]
                    if query.shape[2] > 1:
                        seen[module] = query[:, :, -args.observe:].detach()

                hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in modules]
                with torch.inference_mode():
                    model(ids[:, :-1], **hf_polyattn.cache_kwargs(cache), use_cache=True)
                for h in hooks:
                    h.remove()
                for layer, m in zip(cache.layers, modules):
                    layer.state = _keep(layer.state, args.cache, seen[m], m.groups, 1.0 / m.head_dim ** 0.5,
                                        args.pool)
                hf_polyattn.reconfigure(model, sparse_cache=args.cache)
                text = _answer(model, tok, cache, ids[:, -1:], new_tokens)
            else:
                with torch.inference_mode():
                    logits = model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits[:, -1]
                first = logits.argmax(-1, keepdim=True)
                text = tok.decode([int(first)]) + _answer(model, tok, cache, first, new_tokens - 1)
            found = NUMBER.search(text)
            hits.append(int(found is not None and found.group(0) == key))
            answers.append(text)
            seconds.append(round(time.time() - t0, 1))
            print(f"{rule} depth {depth:.2f}: key {key} answer {text!r} -> {hits[-1]} ({seconds[-1]} s)", flush=True)
            results["rules"][rule] = {"hits": hits, "answers": answers, "seconds": seconds, "total": sum(hits),
                                      "complete": len(hits) == len(cells)}
            if out is not None:  # after every prompt: a stopped run keeps what it measured
                (out / "probe_question_select.json").write_text(json.dumps(results, indent=1))
        print(f"{rule}: {sum(hits)} / {len(hits)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
