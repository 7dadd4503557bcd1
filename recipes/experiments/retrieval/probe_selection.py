"""Probe of the sparse cache's selection rule (issue 32): `hf-polyattn eval` with ``ops.sparse.select_and_fold``
replaced by a variant, everything else as in the library.

    python -m recipes.experiments.retrieval.probe_selection VARIANT EVAL_ARGS...

The study's bounded caches retrieve at 4k only the needles of the last ~600 tokens, while the same model with a cache
holding every key retrieves 10 of 10 (SECTION_retrieval.md, row hh+all_keys_4k), which suggested that the selection
drops the needle (but see the oracles below: keeping the needle is not enough).
The library scores every candidate (the cache, then the block that left the window) by its self-recall error
|v - phi(k) S_v / (phi(k) . S_1)| against the current state, re-scored at every block. Variants:

- ``frozen``: a cached key keeps the error it had when it entered the cache (a reservoir of the most surprising keys
  of the whole context, instead of the keys the recent state represents worst);
- ``relative``: the error divided by |v| (re-scored every block), so large values do not win by their norm.

Attention-informed variants (H2O, Zhang et al. 2023, arXiv:2306.14048, on the bounded cache). Every exact weight a query
gives a key is turned into that key's probability under the query's whole row: w_j / Z with Z the row's full normaliser
(the window, the pending block, the sinks, the sparse cache *and* the kernel part, ``window_mix``, decay and
``denominator_offset`` included: the ``num[..., d] + offset`` that ``normalised_sum`` / ``ring_step`` divide by), summed
over the kv head's G query heads and over the queries. A key's *mass* is the sum of those probabilities; the sinks
collect none (they are always kept). The chunked prefill gets them from ``SparseMixin._sparse_parts``, the terms of its
rows before normalisation (``_rows_with_mass``); decoding recomputes each step's exact weights and normaliser after
``ring_step`` (``_ring_mass``) and keeps a mass per ring slot, moved with the key when it leaves the window for the
waiting block and when the block's selection keeps it in the cache; the prefill's masses go to the ring built after it
(``_ring_slots``: the cache, the waiting keys and the window in the ring's order).

- ``h2o``: the score is the key's accumulated mass; a cached key keeps accumulating the mass later queries give it
  (H2O's rule), so it competes with its whole history against candidates that have only their time in the window;
- ``h2o_window``: the score is the mass a key received while it was exact before its selection (in the window and
  the pending block: w to w + C - 1 queries, the same for every key up to C - 1); frozen once cached;
- ``h2o_max``: the score is the largest probability one query head gave the key (instead of the sum: a key one
  query copied from, e.g. the key's first mention read by its second, against keys many queries lean on a little);
  a cached key's keeps updating with later queries;
- ``err_knorm``: the library's recall error (re-scored every block) times the key's norm |k| (the model's own key,
  as the exact part scores it): surprise that can also draw a sharp softmax weight;
- ``err_mass``: the library's recall error (re-scored every block) times the ``h2o_window`` mass: surprise that the
  queries of its neighbourhood also attended;
- ``oracle_key`` / ``oracle_needle`` (diagnostics, not rules: they read where the eval put the needle): the
  library's rule, but the key's tokens (every mention) / the asked needle's whole sentence are always kept; an upper
  bound of what any rule that keeps the needle could give with this budget;
- ``VARIANT_nofar`` (any of them; diagnostics): the same with the kernel part switched off (``window_mix`` set to 0
  in every layer): sinks, window, pending block and the cache alone, exactly (StreamingLLM with a bounded cache; the
  evicted keys still fold into a state nothing reads);
- ``plumbing``: the library's recall-error rule with every part of the mass bookkeeping running (a check of the probe:
  its outputs must equal the library's, which ``probe_selection_check.py`` asserts).

Measured (runs/retrieval/<row>/long_context.json, classic passkey at 4096 tokens, 10 depths, seed 0, sparse_cache=128,
1 thread; the library itself on the same prompts, row hh+sparse128_library_4k: 1/10): frozen 1, relative 2, h2o 0,
h2o_window 0, h2o_max 0, err_knorm 0, err_mass 0, plumbing 1 (the library's answers, string for string), oracle_key
2, oracle_needle 3 (4 with sparse_cache=512). No attention-informed rule keeps what the library's rule keeps (they
miss even the needle the library finds at depth 0.95, and on the 1k prompt of ``probe_selection_check`` (depth 0.35),
which the library answers, each of them answers " the pass key. The pass key is"); and the oracles show
that keeping the needle's tokens exact in every layer and head is not what is missing: the retrieval heads of layers
20-23 put 0.65-0.81 of the question's last query on the key with every key kept and at most 0.06 with 128 cached
keys, key pinned or not (``probe_selection_diag``, runs/retrieval/diag/last_query_summary.txt). With the kernel part
off (``_nofar``): oracle_needle 9/10, the library's rule 2/10, h2o / h2o_window / h2o_max 0/10 each
(runs/retrieval/probe_attention_rules.md).

A probe, not a library option: the state is kept per layer module in this process (``STORED``, ``PREFILL``,
``RING``), which is right for one sequence evaluated at a time (the passkey evaluation) and nothing else; the mass
variants refuse padded rows and a prefill that carries a sparse cache from an earlier call.
"""

from __future__ import annotations

import sys

import torch

from hf_polyattn.ops import attention, decode, sparse
from hf_polyattn.ops.common import normalised_sum, soft_cap
from hf_polyattn.ops.local import far_scale
from recipes.experiments.retrieval.probe_nofar import kernel_part_off

VARIANTS = ("frozen", "relative", "h2o", "h2o_window", "h2o_max", "plumbing", "err_knorm", "err_mass",
            "oracle_key", "oracle_needle")  # each also as VARIANT_nofar
MASS_VARIANTS = ("h2o", "h2o_window", "h2o_max", "plumbing", "err_knorm", "err_mass", "oracle_key",
                 "oracle_needle")
PINNED: dict[str, list[int]] = {"positions": []}  # the oracles: the prompt positions kept whatever their error
STORED: dict[int, torch.Tensor] = {}
CURRENT: dict[str, object] = {"module": None, "mode": None}
PREFILL: dict[int, dict] = {}  # per module: the running prefill's pool masses and cache indices
PREFILL_RING: dict[int, torch.Tensor] = {}  # per module: the last prefill's masses in the ring's slot order
RING: dict[int, dict] = {}  # per module: the decoding ring and its per-slot masses
LAST: list | None = None  # probe_selection_diag --last: the last query's probabilities per layer when a list
DIAG: list | None = None  # probe_selection_diag: (module, cand, score, keep) of every prefill selection when a list
CHECK = {"rows": False}  # probe_selection_check: assert that no prefill query gives more than its whole row


def _rows_with_mass(self, qa, fqa, qls, ka, vexta, valid_a, ga, sinks, a, end, ks, scale, ck, cv, c_valid, kv,
                    g_ref):
    """``SparseMixin._sparse_rows`` (its terms from ``_sparse_parts``, the same output) that also adds each key's
    probabilities under the rows' full normaliser to the running prefill's masses (``PREFILL``)."""
    cfg = self.config
    parts = self._sparse_parts(qa, fqa, qls, ka, vexta, valid_a, ga, sinks, a, end, ks, scale, ck, cv, c_valid, kv,
                               g_ref)
    weights, loc, far, scale_far, n_loc = parts.weights, parts.loc, parts.far, parts.scale_far, parts.n_loc
    cache = slice(n_loc, n_loc + c_valid.shape[-1])  # the cache slots' weights (the sinks' after them)
    ctx = PREFILL.get(id(self))
    if ctx is not None:
        with torch.no_grad():
            if ctx["knorm"] is None:  # the call's raw keys' norms (RoPE keeps them), at their pool indices
                ctx["knorm"] = torch.cat([torch.zeros_like(ctx["mass"][..., : ctx["budget"]]),
                                          torch.linalg.vector_norm(ka[:, :, 0].float(), dim=-1)], dim=-1)
            d = cv.shape[-1] - 1
            num = loc[..., d] + (far[..., d] if scale_far is None else (scale_far * far)[..., d])
            z = num + cfg.denominator_offset  # (B, Hkv, G, rows): the row's whole normaliser
            inv = torch.where(z > 0, 1.0 / z, torch.zeros_like(z)).unsqueeze(-1)
            p = weights.detach() * inv
            if LAST is not None and end == ctx["lk"]:  # the prompt's last query: where its row's weight goes
                budget = ctx["budget"]
                pos = torch.full((p.shape[0], p.shape[1], p.shape[-1]), -1, dtype=torch.long, device=p.device)
                pos[..., :n_loc] = torch.arange(ks, end, device=p.device)
                pos[..., cache] = torch.where(c_valid, ctx["cache_idx"] - budget, -1)
                far_part = far[..., -1, d] if scale_far is None else (scale_far * far)[..., -1, d]
                LAST.append((id(self), p[..., -1, :].clone(), pos, (far_part * inv[..., -1, 0]).clone()))
            if ctx["pin"]:  # an oracle's "mass" is its pin, nothing accumulates
                return normalised_sum(far, loc, scale_far, cfg.denominator_offset, far.dtype)
            if CHECK["rows"]:
                row = (p[..., :n_loc] * vexta[..., ks:end, d].unsqueeze(-2)).sum(-1) + p[..., n_loc:].sum(-1)
                assert bool((row <= 1.0 + 1e-4).all()), float(row.max())
            budget = ctx["budget"]
            if ctx["max"]:  # the largest probability any one query head gave the key
                loc_mass = p[..., :n_loc].amax(dim=(2, 3)) * vexta[:, :, 0, ks:end, d]
                part = ctx["mass"][..., budget + ks : budget + end]
                part.copy_(torch.maximum(part, loc_mass))
                cache_mass = p[..., cache].amax(dim=(2, 3)) * c_valid.to(p.dtype)
                ctx["mass"].scatter_reduce_(-1, ctx["cache_idx"], cache_mass, "amax")
            else:
                loc_mass = p[..., :n_loc].sum(dim=(2, 3)) * vexta[:, :, 0, ks:end, d]  # (B, Hkv, n_loc)
                ctx["mass"][..., budget + ks : budget + end] += loc_mass
                if ctx["accumulate"]:  # the cached keys keep collecting
                    cache_mass = p[..., cache].sum(dim=(2, 3)) * c_valid.to(p.dtype)
                    ctx["mass"].scatter_add_(-1, ctx["cache_idx"], cache_mass)
    return normalised_sum(far, loc, scale_far, cfg.denominator_offset, far.dtype)


def _ring_slots(module, ctx: dict, lk: int) -> torch.Tensor:
    """The prefill's masses (B, Hkv, budget + lk) in the slot order of the ``WindowRing`` that ``from_recurrent``
    builds from the state after it: sinks (none), the cache (``cache_idx``'s order), the waiting keys, the window."""
    cfg = module.config
    s, w, lam, chunk = cfg.sinks, cfg.window, cfg.sparse_cache, cfg.sparse_chunk
    mass = ctx["mass"]
    b, hkv = mass.shape[:2]
    out = torch.zeros(b, hkv, s + lam + chunk + w, dtype=mass.dtype, device=mass.device)
    out[..., s : s + lam] = mass.gather(-1, ctx["cache_idx"])
    count = min(lk, w)
    keep_from = max(lk - w, 0) // chunk * chunk  # the first key after the complete (selected) blocks
    n_wait = lk - count - keep_from
    if n_wait:
        out[..., s + lam : s + lam + n_wait] = mass[..., lam + keep_from : lam + lk - count]
    out[..., s + lam + chunk : s + lam + chunk + count] = mass[..., lam + lk - count : lam + lk]
    return out


def _ring_mass(module, q5, scale, ring, sink_q, out_check=None) -> torch.Tensor:
    """(B, Hkv, G, slots): the probabilities of one decoding step's G queries of each kv head under their full
    normaliser, recomputed from the ring after ``ring_step`` (its exact part and kernel part)."""
    cfg = module.config
    s, d = ring.sinks, module.head_dim
    b, hkv, g = q5.shape[:3]
    qd = q5.reshape(b, hkv, g, d)
    x = torch.matmul(qd, ring.keys.transpose(-1, -2))  # (B, Hkv, G, N)
    if s and sink_q is not None:
        x[..., :s] = torch.matmul(sink_q.reshape(b, hkv, g, d), ring.keys[:, :, :s].transpose(-1, -2))
    x = x * scale
    if cfg.resolved_local_kernel == "softmax":
        x = torch.where(ring.valid[:, None, None, :], soft_cap(x, module.softcap), float("-inf"))
        m = x.amax(dim=-1, keepdim=True).clamp_min(0.0)
        weights, log_far = torch.exp(x - m), -m
    else:
        weights, log_far = module.exact_weights(x, ring.valid[:, None, None, :], cfg.resolved_local_kernel)
    num = torch.matmul(weights, ring.vext)  # (B, Hkv, G, e)
    fq = module._feature_inputs(module.kernel_input(q5, True), scale)
    q_log_scale = None
    if module.feature_map.log_scaled:
        fq, q_log_scale = module.feature_map.forward_with_log_scale(fq, True)
        q_log_scale = q_log_scale.view(b, hkv, g, 1)
    else:
        fq = module.feature_map(fq, True)
    e = ring.vext.shape[-1]
    far = torch.matmul(fq.reshape(b, hkv, g, -1), ring.kv).view(b, hkv, g, e)
    factor = far_scale(log_far, q_log_scale)
    if ring.logg is not None:
        total = ring.logg.sum(-1)
        if ring.extra:
            total = total + sparse.pending_log(ring)
        dec = torch.exp(total)[..., None, None]
        factor = dec if factor is None else factor * dec
    if cfg.window_mix:
        mix = module.window_mix.abs().to(far.dtype).view(hkv, g, 1)
        factor = mix if factor is None else factor * mix
    num = num + (far if factor is None else far * factor)
    z = num[..., d] + cfg.denominator_offset
    if out_check is not None:  # the recomputation is the step's own arithmetic
        mine = torch.where(z[..., None] > 0, num[..., :d] / z[..., None], 0.0)
        torch.testing.assert_close(mine, out_check.reshape(mine.shape).to(mine.dtype), rtol=1e-4, atol=1e-5)
    inv = torch.where(z > 0, 1.0 / z, torch.zeros_like(z)).unsqueeze(-1)
    return weights * inv * ring.vext[..., d].unsqueeze(2)  # (B, Hkv, G, N)


def install(variant: str, check_ring: bool = False) -> None:
    nofar = variant.endswith("_nofar")
    variant = variant.removesuffix("_nofar")
    if variant not in VARIANTS:
        raise SystemExit(f"VARIANT must be one of {list(VARIANTS)} (each also as VARIANT_nofar), got {variant!r}")
    original_call, original_leave = sparse.SparseMixin._sparse_call, sparse.ring_leave
    original_step = decode.ring_step
    # the decoding steps the probe watches are the general ring step's (``ring_step``, ``ring_leave``): one sequence's
    # fused step (``decode.fused_step``) selects through ``ring_select`` without them, which a rule reading the
    # queries' mass cannot serve, so it is switched off (the same arithmetic, PolyAttention.fused_decode's reference)
    from hf_polyattn.ops.attention import PolyAttention

    PolyAttention.fused_decode = False
    mass_rule = variant in MASS_VARIANTS
    accumulate = variant in ("h2o", "h2o_max")  # err_mass: the mass of h2o_window (frozen once cached)
    pin = variant.startswith("oracle")

    def sparse_call(self, q5, k5, v5, pad_mask, scale, state, *args, **kwargs):
        mid = id(self)
        CURRENT["module"] = mid
        if nofar:  # the kernel part off: window_mix 0 multiplies it in the rows (prefill and ring step) and their sums
            kernel_part_off(self)
        if not mass_rule:
            return original_call(self, q5, k5, v5, pad_mask, scale, state, *args, **kwargs)
        if pad_mask is not None and not bool(pad_mask.all()):
            raise NotImplementedError("the mass probe takes unpadded rows")
        if state is not None and (state.sparse_k is not None or state.k is not None):
            raise NotImplementedError("the mass probe takes one prefill from an empty state")
        cfg = self.config
        b, hkv, lk = q5.shape[0], q5.shape[1], k5.shape[3]
        if q5.shape[3] != lk:
            raise NotImplementedError("the mass probe takes a query for every key")
        budget = cfg.sparse_cache
        ctx = {"budget": budget, "chunk": cfg.sparse_chunk, "epoch": 0, "accumulate": accumulate,
               "mass": torch.zeros(b, hkv, budget + lk, dtype=torch.float32, device=q5.device),
               "cache_idx": torch.arange(budget, device=q5.device).expand(b, hkv, budget).contiguous(),
               "knorm": None, "pin": pin, "lk": lk, "max": variant == "h2o_max"}
        if pin:
            at = torch.tensor([p for p in PINNED["positions"] if p < lk], dtype=torch.long, device=q5.device)
            ctx["mass"][..., budget + at] = 1.0
        PREFILL[mid] = ctx
        CURRENT["mode"] = "prefill"
        try:
            result = original_call(self, q5, k5, v5, pad_mask, scale, state, *args, **kwargs)
        finally:
            CURRENT["mode"] = None
            PREFILL.pop(mid, None)
        if state is not None:
            PREFILL_RING[mid] = _ring_slots(self, ctx, lk)
        return result

    def ring_step(module, q5, key, value, mask, scale, ring, sink_q, plan=None):
        mid = id(module)
        CURRENT["module"] = mid
        if not mass_rule:
            return original_step(module, q5, key, value, mask, scale, ring, sink_q, plan)
        if mask is not None and not bool(mask.all()):
            raise NotImplementedError("the mass probe takes unpadded rows")
        st = RING.get(mid)
        if mid in PREFILL_RING or st is None or st["ring"] is not ring:
            init = PREFILL_RING.pop(mid, None)
            shape = (ring.keys.shape[0], ring.keys.shape[1], ring.keys.shape[2])
            mass = init.clone() if init is not None and tuple(init.shape) == shape else \
                torch.zeros(shape, dtype=torch.float32, device=ring.keys.device)
            st = RING[mid] = {"ring": ring, "mass": mass}
        out = original_step(module, q5, key, value, mask, scale, ring, sink_q, plan)
        if pin:  # the pins move with their keys (ring_leave), nothing accumulates
            return out
        with torch.no_grad():
            p = _ring_mass(module, q5, scale, ring, sink_q, out if check_ring else None)
            p = p.amax(2) if variant == "h2o_max" else p.sum(2)
        s, lam = ring.sinks, ring.cache
        if not accumulate:
            p[..., s : s + lam] = 0.0  # cached keys keep the mass they were selected with
        p[..., :s] = 0.0
        if variant == "h2o_max":
            st["mass"].copy_(torch.maximum(st["mass"], p))
        else:
            st["mass"] += p
        return out

    def ring_leave(module, ring, slot, is_sink, scale):
        mid = id(module)
        CURRENT["module"] = mid
        if not mass_rule:
            return original_leave(module, ring, slot, is_sink, scale)
        st = RING[mid]
        mass, s, lam = st["mass"], ring.sinks, ring.cache
        real = ring.valid[:, slot]
        for row in range(mass.shape[0]):  # the leaving key's mass goes with it to its waiting slot
            if bool(real[row]):
                mass[row, :, s + lam + int(ring.pending[row])] = mass[row, :, slot]
        mass[:, :, slot] = 0.0
        CURRENT["mode"], CURRENT["ring"], CURRENT["keep"] = "decode", st, None
        try:
            original_leave(module, ring, slot, is_sink, scale)
        finally:
            CURRENT["mode"] = None
        if CURRENT["keep"] is not None:
            kept_mass = CURRENT["keep"]
            done = (ring.pending == 0)[:, None, None]
            mass[..., s : s + lam] = torch.where(done, kept_mass, mass[..., s : s + lam])
            mass[..., s + lam : s + ring.extra] = torch.where(done, 0.0, mass[..., s + lam : s + ring.extra])
            CURRENT["keep"] = None

    def select_and_fold(kv, feats, vext, valid, budget, to_ref=None, decay=None, relative=False):
        n = valid.shape[-1]
        mode = CURRENT["mode"]
        with torch.no_grad():
            cand = None
            if variant in MASS_VARIANTS and (variant != "plumbing" or mode is not None):
                if mode == "prefill":
                    ctx = PREFILL[CURRENT["module"]]
                    ctx["epoch"] += 1
                    lo = budget + (ctx["epoch"] - 1) * ctx["chunk"]
                    b, hkv = valid.shape[:2]
                    block = torch.arange(lo, lo + ctx["chunk"], device=valid.device).expand(b, hkv, -1)
                    cand = torch.cat([ctx["cache_idx"], block], dim=-1)
                    mass = ctx["mass"].gather(-1, cand)
                    knorm = ctx["knorm"].gather(-1, cand)
                elif mode == "decode":
                    st = CURRENT["ring"]
                    ring = st["ring"]
                    mass = st["mass"][..., ring.sinks : ring.sinks + ring.extra].clone()
                    knorm = torch.linalg.vector_norm(ring.keys[:, :, ring.sinks : ring.sinks + ring.extra].float(),
                                                     dim=-1)
                else:
                    raise RuntimeError("select_and_fold outside a probed call")
            err = sparse.recall_error(kv.detach(), feats.detach(), vext.detach(), relative)
            err = torch.nan_to_num(err, nan=0.0)
            if variant == "relative":
                err = err / (torch.linalg.vector_norm(vext[..., :-1].detach(), dim=-1) + 1e-6)
            elif variant in ("h2o", "h2o_window", "h2o_max"):
                err = mass
            elif variant == "err_knorm":
                err = err * knorm
            elif variant == "err_mass":
                err = err * mass
            elif pin:
                err = err + 1e6 * mass
            cache_valid = valid[..., :budget]
            stored = STORED.get(CURRENT["module"])
            if variant == "frozen" and stored is not None and stored.shape == cache_valid.shape \
                    and bool(cache_valid.any()):  # an empty cache starts a sequence: nothing stored applies
                err = torch.cat([torch.where(cache_valid, stored, err[..., :budget]), err[..., budget:]], dim=-1)
            age = torch.arange(n, device=err.device, dtype=err.dtype) / n
            score = torch.where(valid, err, -1.0 - age)
            keep = score.topk(budget, dim=-1).indices
            keep = keep.gather(-1, (keep + n * (~valid.gather(-1, keep))).argsort(dim=-1))
            STORED[CURRENT["module"]] = score.gather(-1, keep)
            if cand is not None:
                ctx["cache_idx"] = cand.gather(-1, keep)
                if DIAG is not None:
                    DIAG.append((CURRENT["module"], cand.clone(), score.clone(), keep.clone()))
            if mode == "decode" and mass_rule:
                CURRENT["keep"] = mass.gather(-1, keep)
        kept = torch.zeros_like(valid).scatter_(-1, keep, True)
        weight = (valid & ~kept).to(vext.dtype)
        if to_ref is not None:
            weight = weight * torch.exp(torch.where(weight > 0, to_ref, 0.0))
        add = torch.matmul((feats * weight.unsqueeze(-1)).transpose(-1, -2), vext)
        if decay is not None:
            kv = kv * torch.exp(decay)[..., None, None]
        return kv + add, keep, valid.gather(-1, keep)

    if pin:  # the eval's prompts tell the oracle where the needle is
        from hf_polyattn.eval import long_context, passkey

        original_prompt = long_context.passkey_prompt

        def passkey_prompt(tokenizer, **kwargs):
            pp = original_prompt(tokenizer, **kwargs)
            if variant == "oracle_key":
                PINNED["positions"] = list(pp.needle_positions)
            else:  # the asked needle's whole sentence (the text around the key's mentions too)
                t = passkey._template(pp.template)
                key_ids = passkey._encode(tokenizer, " " + pp.key)
                ids, at = passkey._needle(tokenizer, t, key_ids, pp.label)
                start = min(pp.needle_positions) - at[0]
                PINNED["positions"] = list(range(start, start + len(ids)))
                assert pp.ids[start : start + len(ids)] == ids
            return pp

        long_context.passkey_prompt = passkey_prompt
    sparse.SparseMixin._sparse_call = sparse_call
    sparse.ring_leave = decode.ring_leave = ring_leave
    sparse.select_and_fold = select_and_fold
    if mass_rule:
        sparse.SparseMixin._sparse_rows = _rows_with_mass
        decode.ring_step = attention.ring_step = ring_step


def passkey_setup(model_dir: str, sparse_cache: int, length: int, depth: float, draw: int = 0):
    """(tokenizer, model with ``sparse_cache`` keys, the classic passkey prompt, its drawn key) for the check and
    diagnostic scripts: the eval's ``draw``-th key of seed 0, one thread."""
    import random

    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn.checkpoints import load_model, load_tokenizer
    from hf_polyattn.eval.passkey import draw_passkey, passkey_prompt

    torch.set_num_threads(1)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, AutoModelForCausalLM)
    hf_polyattn.reconfigure(model, sparse_cache=sparse_cache)
    model.eval()
    rng = random.Random(0)
    for _ in range(draw + 1):
        drawn = draw_passkey(rng, "classic")
    return tok, model, passkey_prompt(tok, length=length, depth=depth, template="classic", **drawn), drawn


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(f"usage: python -m recipes.experiments.retrieval.probe_selection {'|'.join(VARIANTS)} "
                         "EVAL_ARGS...")
    install(argv[0])
    from hf_polyattn.cli import main as cli_main

    return cli_main(["eval", *argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
