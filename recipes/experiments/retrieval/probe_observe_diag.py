"""Where a needle stands after ``sparse_observe``'s re-choice (issue 32): one passkey prompt of ``hf-polyattn eval
--passkey LENGTH --passkey-depths 10`` (seed 0, the draw of that length alone) prefilled through a saved model with
settings that add no tensor, then, for every layer and kv head, the share of the needle's key tokens (both mentions)
in the sparse cache decoding starts from, and the greedy answer.

    python -m recipes.experiments.retrieval.probe_observe_diag MODEL --length 4096 --template vault --depth-index 0 \
        --set sparse_cache=512 --set decay_max_horizon=256 --set sparse_observe=16 [--kernel-part-off]

``--kernel-part-off``: the kernel part switched off in every layer (``probe_nofar``: ``window_mix`` 0), so the answer
reads the sinks, the window, the pending block and the sparse cache alone. ``--evict reverse`` ranks the streaming
selection's candidates by the negated recall error (the best-represented kept, the worst evicted), ``--evict random``
by a seeded random score: which evicted keys matter.
"""

from __future__ import annotations

import argparse
import contextlib
import random

import torch


def install_eviction(mode: str, seed: int = 0) -> None:
    """The streaming selection's ranking replaced: ``reverse`` the negated recall error, ``random`` a score drawn
    from a generator seeded with ``seed`` (``ops.sparse.select_and_fold`` reads ``recall_error`` from its module)."""
    from hf_polyattn.ops import sparse

    if mode not in ("reverse", "random"):
        raise ValueError(f"mode must be 'reverse' or 'random', got {mode!r}")
    error, gen = sparse.recall_error, torch.Generator().manual_seed(seed)

    def ranked(kv, feats, vext, relative=False):
        err = error(kv, feats, vext, relative)
        return err.neg() if mode == "reverse" else torch.rand(err.shape, generator=gen).to(err)

    sparse.recall_error = ranked


def prompt_parser(description: str, template: str, threads: int) -> argparse.ArgumentParser:
    """The arguments every probe of one passkey prompt takes: the model, the prompt (length, template, depth), the
    settings, the threads and the streaming selection's ranking (``--evict``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--template", default=template)
    ap.add_argument("--depth-index", type=int, default=0, help="which of the 10 depths (0: 0.05 ... 9: 0.95)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--evict", choices=("lola", "reverse", "random"), default="lola",
                    help="the streaming selection's ranking (lola: the library's)")
    return ap


def load_prompt(args):
    """(tokenizer, model with ``args.set`` applied, the drawn key, the prompt, its ids (1, n)): the eval's draw of
    that length alone (seed 0, ``args.depth_index + 1`` draws in its order)."""
    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn.checkpoints import load_model, load_tokenizer
    from hf_polyattn.cli import parse_settings
    from hf_polyattn.eval.passkey import draw_passkey, passkey_prompt

    if args.evict != "lola":
        install_eviction(args.evict)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, AutoModelForCausalLM).eval()
    hf_polyattn.reconfigure(model, **parse_settings(hf_polyattn.get_polyattn_config(model).kind, args.set))
    rng = random.Random(0)
    for _ in range(args.depth_index + 1):  # the eval's draws, in its order
        drawn = draw_passkey(rng, args.template)
    pp = passkey_prompt(tok, length=args.length, depth=(args.depth_index + 0.5) / 10, template=args.template, **drawn)
    return tok, model, drawn, pp, torch.tensor([pp.prompt])


def kept_positions(cached: torch.Tensor, keys: torch.Tensor) -> set[int]:
    """The positions of ``keys`` (n, d) that a row of ``cached`` (lambda, d) equals: what one kv head's cache holds."""
    same = (cached[:, None, :] == keys[None, :, :]).all(-1)
    return set(same.nonzero()[:, 1].tolist())


@contextlib.contextmanager
def recorded_inputs(modules, queries: int = 0):
    """Yields {module: (its last ``queries`` queries (H, queries, d), None when 0; its keys (Hkv, n, d))} of row 0 of
    the last call of each of ``modules`` inside the block (forward pre-hooks, removed on leaving)."""
    seen = {}

    def grab(module, a, kw):
        key = (a[1] if len(a) > 1 else kw["key"]).detach()[0]
        query = (a[0] if a else kw["query"]).detach()[0, :, -queries:] if queries else None
        seen[module] = (query, key)

    hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in modules]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def greedy_answer(model, cache, logits: torch.Tensor, steps: int) -> list[int]:
    """``steps`` tokens decoded greedily through ``cache`` from the prompt's last ``logits`` (1, vocab)."""
    import hf_polyattn

    token, out = logits.argmax(-1, keepdim=True), []
    with torch.inference_mode():
        for _ in range(steps):
            out.append(int(token))
            token = model(token, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits[:, -1].argmax(-1, True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = prompt_parser(__doc__.split("\n\n")[0], "classic", 2)
    ap.add_argument("--kernel-part-off", action="store_true", help="window_mix 0 in every layer (probe_nofar)")
    args = ap.parse_args(argv)
    if args.kernel_part_off:
        from .probe_nofar import install

        install()
    import hf_polyattn
    from hf_polyattn.integration.state import HFPolyAttention

    tok, model, drawn, pp, ids = load_prompt(args)
    needle = sorted(pp.needle_positions)
    modules = [m for m in model.modules() if isinstance(m, HFPolyAttention)]
    cache = hf_polyattn.PolyAttnCache(model)
    with recorded_inputs(modules) as inputs, torch.inference_mode():
        logits = model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits[:, -1]
    shares = []
    for layer, m in zip(cache.layers, modules):
        cached, k = layer.state.sparse_k[0], inputs[m][1]  # (Hkv, lambda, d), (Hkv, n, d)
        row = []
        for head in range(cached.shape[0]):
            kept = kept_positions(cached[head], k[head])
            row.append(sum(p in kept for p in needle) / len(needle))
        shares.append(row)
    out = greedy_answer(model, cache, logits, args.new_tokens)
    print(f"key {drawn['key']} at tokens {needle} of {ids.shape[1]}; answer {tok.decode(out)!r}")
    print("needle tokens cached, per layer (kv heads): " + " ".join(
        f"{i}:{'/'.join(f'{x:.1f}' for x in row)}" for i, row in enumerate(shares)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
