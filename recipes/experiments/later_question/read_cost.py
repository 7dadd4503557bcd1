"""What reading a document by copy scores costs beside reading it in one forward call: the wall time of
``hf_polyattn.read_document`` against ``model(ids, use_cache=True)`` on the same document, one after the other in
one process. Written to ``recipes/results/later_question/read_cost_<length>.json``.

    python -m recipes.experiments.later_question.read_cost --model runs/retrieval/hh/model --length 8000 \\
        --set decay_max_horizon=256 --set sparse_cache=2048 --set sparse_observe=16 --set sink_position=own \\
        --set sparse_score=attention --set sparse_value_keys=1536

The document is the 'classic' passkey prompt's (seed 0, depth 0.5) up to its question. Each read runs ``--repeats``
times; the record keeps every time and the ratio of the best ones. Run it with nothing else on the machine: the
record says what other processes took meanwhile (``machine.others_between``)."""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time

from recipes.experiments.later_question.needle_ranks import OUT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a polyattn checkpoint with a sparse cache")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a setting of the checkpoint's attention that adds no tensor (repeatable)")
    p.add_argument("--length", type=int, default=8000)
    p.add_argument("--chunk", type=int, default=None, help="read_document's chunk (default: its own)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.length < 64:
        p.error("--repeats must be >= 1 and --length >= 64")

    import torch

    import hf_polyattn
    from hf_polyattn import cli, machine
    from hf_polyattn.eval.passkey import draw_passkey, passkey_prompt
    from hf_polyattn.machine import cpu_snapshot, others_between

    torch.set_num_threads(args.threads)
    path = cli.resolve_model(args.model)
    tok = cli.load_tokenizer(path)
    model = cli._load(cli.causal_lm_class(path, args.model, "a causal LM"), path, dtype=torch.float32).eval()
    cfg = hf_polyattn.get_polyattn_config(model)
    if cfg is None or not cfg.sparse_cache and not any(s.startswith("sparse_cache=") for s in args.set):
        p.error(f"--model {args.model}: read_document chooses a sparse cache; give a polyattn checkpoint with one")
    if args.set:
        cli.reconfigure_checkpoint(model, cfg, args.set, args.model)
    drawn = draw_passkey(random.Random(0), "classic")
    prompt = passkey_prompt(tok, length=args.length, depth=0.5, template="classic", **drawn)
    ids = torch.tensor([prompt.document])
    times: dict[str, list[float]] = {"forward": [], "read_document": []}
    snap, t_all = cpu_snapshot(), time.time()
    with torch.no_grad():
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hf_polyattn.returned_cache(model(ids, attention_mask=torch.ones_like(ids), use_cache=True,
                                             logits_to_keep=1))
            times["forward"].append(round(time.perf_counter() - t0, 2))
            t0 = time.perf_counter()
            hf_polyattn.read_document(model, ids, tok, chunk=args.chunk)
            times["read_document"].append(round(time.perf_counter() - t0, 2))
    record = {"command": "python -m recipes.experiments.later_question.read_cost " + shlex.join(argv),
              "model": args.model, "tokens": int(ids.shape[1]), "chunk": args.chunk, "seconds": times,
              "ratio_best": round(min(times["read_document"]) / min(times["forward"]), 2),
              "other_processes": others_between(snap, cpu_snapshot()), "machine": machine.summary(),
              "wall_s": round(time.time() - t_all, 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"read_cost_{args.length}.json"
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps({"seconds": times, "ratio_best": record["ratio_best"],
                      "other_cpu_s": record["other_processes"]["cpu_s"]}), "->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
