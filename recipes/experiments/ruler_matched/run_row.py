"""One row of the RULER / matched-memory / multi-turn study on SmolLM2-135M-Instruct, training-free, written to
``recipes/results/ruler_matched/<row>.json`` (the command that made it inside, under "command").

    python recipes/experiments/ruler_matched/run_row.py softmax --threads 2
    python recipes/experiments/ruler_matched/run_row.py sparse --matched-cache 256 --threads 2

Rows (eval/long_context.BASELINES): ``softmax`` (the checkpoint), ``streaming`` (StreamingLLM, 4 sinks + 128),
``sparse`` (the sparse cache on the checkpoint's own softmax: 4 sinks + 128 window + --matched-cache keys chosen by
sparse_score='attention', eval/long_context.matched_memory_config), ``streaming_matched`` (StreamingLLM whose window
holds 128 + --matched-cache keys), ``saved`` (--model a saved polyattn checkpoint, e.g. the linear-only preset's
trained model, with --set settings that add no tensor, hf_polyattn.reconfigure). Each row: perplexity at
--contexts, passkey (classic) single-prompt and multi-turn, the RULER suite single-prompt and multi-turn. Why a
script and not ``hf-polyattn eval --baselines``: the CLI always adds the evaluated model's row; here each row runs
as its own process (under ~15 minutes on 2 CPU threads) and ``collect.py`` joins them into one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "recipes" / "results" / "ruler_matched"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("row", choices=["softmax", "streaming", "sparse", "streaming_matched", "saved"])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--matched-cache", type=int, default=2048)
    p.add_argument("--contexts", default="1024,2048")
    p.add_argument("--max-eval-tokens", type=int, default=4096)
    p.add_argument("--passkey", default="1024,2048")
    p.add_argument("--passkey-depths", type=int, default=5)
    p.add_argument("--passkey-draw", default="",
                   help="the lengths whose cells draw passkeys, in order (--passkey among them; default: --passkey): "
                        "--passkey 8000 --passkey-draw 1024,2048,4096,8000 asks the 8k keys of the 1k..8k rows")
    p.add_argument("--ruler", default="1024,2048")
    p.add_argument("--ruler-tasks", default="")
    p.add_argument("--ruler-samples", type=int, default=2)
    p.add_argument("--multi-turn", choices=["none", "passkey", "all"], default="all",
                   help="which retrieval also runs multi-turn: a row whose cache does not depend on where calls end "
                        "(softmax, StreamingLLM, a sparse cache without sparse_observe) answers the same either way "
                        "(tests/eval/test_multi_turn.py), so its RULER multi-turn run can be left out")
    p.add_argument("--sparse-observe", type=int, default=0, help="sparse row: sparse_observe (0: off)")
    p.add_argument("--sink-position", default="window", help="sparse row: sink_position of the sinks")
    p.add_argument("--value-keys", type=int, default=0,
                   help="sparse row: sparse_value_keys (of the budget, the keys of largest |v|; 0: off)")
    p.add_argument("--value-pool", type=int, default=5, help="sparse row: sparse_value_pool (with --value-keys)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="saved row: a setting of the checkpoint's attention that adds no tensor (repeatable)")
    p.add_argument("--passkey-templates", default="classic", help="passkey templates, comma-separated")
    p.add_argument("--later-only", action="store_true",
                   help="retrieval with the question in a later turn only: the passkey, and the RULER suite at "
                        "--ruler with --multi-turn all (no single-prompt run of either)")
    p.add_argument("--read", choices=["stream", "copy"], default="stream",
                   help="how multi-turn reads the document (LongContextSettings.read)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default=None, help="result file name (default: the row, with the budget if matched)")
    args = p.parse_args(argv)
    if args.row == "saved" and not args.name:
        p.error("the 'saved' row needs --name (its result file's name)")
    if args.set and args.row != "saved":
        p.error("--set applies to the 'saved' row only")

    import torch

    import hf_polyattn
    from hf_polyattn import cli, machine
    from hf_polyattn.data import load_text_data
    from hf_polyattn.eval.long_context import (
        BASELINES,
        LongContextSettings,
        _matched_label,
        _streaming_matched,
        evaluate_model,
        matched_memory_config,
        passkey_retrieval,
        streaming_config,
    )
    from hf_polyattn.eval.ruler import run_ruler

    torch.set_num_threads(args.threads)
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    settings = LongContextSettings(
        contexts=ints(args.contexts), max_tokens=args.max_eval_tokens, passkey_lengths=ints(args.passkey),
        passkey_depths=args.passkey_depths, baselines=(), matched_cache=args.matched_cache,
        multi_turn=args.multi_turn != "none", ruler_lengths=ints(args.ruler),
        ruler_tasks=tuple(t for t in args.ruler_tasks.split(",") if t), ruler_samples=args.ruler_samples,
        passkey_templates=tuple(t for t in args.passkey_templates.split(",") if t), read=args.read)
    path = cli.resolve_model(args.model)
    tokenizer = cli.load_tokenizer(path)
    model = cli._load(cli.causal_lm_class(path, args.model, "a causal LM"), path, dtype=torch.float32)
    settings.check_positions(model.config)
    if (args.row == "saved") != (hf_polyattn.get_polyattn_config(model) is not None):
        p.error(f"row {args.row!r} with --model {args.model!r}: the 'saved' row takes a polyattn checkpoint, the "
                "others the softmax one")
    data = load_text_data("demo", tokenizer, max_eval_tokens=args.max_eval_tokens)
    if args.row == "streaming":
        hf_polyattn.convert(model, streaming_config(settings.streaming_sinks, settings.streaming_window))
    elif args.row == "streaming_matched":
        hf_polyattn.convert(model, streaming_config(*_streaming_matched(settings, None)))
    elif args.row == "sparse":
        selection = {"sink_position": args.sink_position}
        if args.sparse_observe:
            selection["sparse_observe"] = args.sparse_observe
        if args.value_keys:
            selection.update(sparse_value_keys=args.value_keys, sparse_value_pool=args.value_pool)
        cfg = matched_memory_config(args.matched_cache, sinks=settings.streaming_sinks,
                                    window=settings.streaming_window, **selection)
        hf_polyattn.convert(model, cfg)
    elif args.row == "saved" and args.set:
        cli.reconfigure_checkpoint(model, hf_polyattn.get_polyattn_config(model), args.set, args.model)
    t0 = time.time()
    if args.row == "saved":
        label = f"{args.model} " + " ".join(args.set)
    else:
        label = BASELINES[args.row](settings)
    if args.row == "sparse":
        label = _matched_label(settings, cfg)
    # multi_turn='passkey': the RULER suite runs once, single-prompt, after the passkey's two modes
    ruler_multi = args.multi_turn == "all"
    first = dataclasses.replace(settings, ruler_lengths=()) if not ruler_multi else settings
    if args.later_only:  # the perplexity curve, then each template's passkey with the question in a later turn
        row = evaluate_model(label, model, tokenizer, data.eval_ids,
                             dataclasses.replace(settings, passkey_lengths=(), ruler_lengths=()))
        for template in settings.passkey_templates if settings.passkey_lengths else ():
            name = "passkey" if template == settings.passkey_templates[0] else f"passkey_{template}"
            row[name + "_multi_turn"] = passkey_retrieval(
                model, tokenizer, settings.passkey_lengths, settings.passkey_depths, seed=settings.passkey_seed,
                template=template, multi_turn=True, read=settings.read, draw_lengths=ints(args.passkey_draw) or None)
        if ruler_multi and settings.ruler_lengths:
            row["ruler_multi_turn"] = run_ruler(model, tokenizer, settings.ruler_lengths, settings.ruler_tasks,
                                                samples=settings.ruler_samples, seed=settings.ruler_seed,
                                                multi_turn=True, read=settings.read)
    else:
        row = evaluate_model(label, model, tokenizer, data.eval_ids, first)
    if not ruler_multi and settings.ruler_lengths and not args.later_only:
        row["ruler"] = run_ruler(model, tokenizer, settings.ruler_lengths, settings.ruler_tasks,
                                 samples=settings.ruler_samples, seed=settings.ruler_seed)
    row["baseline"] = args.row
    name = args.name or (args.row if args.row in ("softmax", "streaming") else f"{args.row}{args.matched_cache}")
    record = {"command": "python recipes/experiments/ruler_matched/run_row.py " + shlex.join(argv),
              "model": args.model, "row": row, "settings": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in vars(settings).items()},
              "tokens": int(data.eval_ids.numel()), "machine": machine.summary(), "wall_s": round(time.time() - t0, 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {OUT / f'{name}.json'} in {record['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
