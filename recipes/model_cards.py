"""Regenerate model_cards/: the cards of the retrofits the project publishes, from the committed result files.

    python recipes/model_cards.py            # from any directory; writes <repo>/model_cards/<name>/README.md + plot

The cards are written by the code that writes every retrofit's card (``hf_polyattn.eval.card.card_from_results``),
from the records in ``recipes/results/`` and the base model's config (the packaged SmolLM2-135M-Instruct, resolved
offline by ``hf_polyattn.checkpoints``): nothing in them is typed here but the command that made each model.

* ``smollm2-linear-long-context``: the long-context study's best retrofit (``recipes/results/long_context/``: the row
  ``lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k`` beside the softmax and StreamingLLM rows);
* ``smollm2-linear-demo``: what ``make demo`` makes (``recipes/results/demo/long_context.json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoConfig

from hf_polyattn.checkpoints import resolve_checkpoint
from hf_polyattn.eval.card import card_from_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "recipes" / "results"
BEST_ROW = "lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k"
# baseline name -> its row file in long_context/ (StreamingLLM with its sinks at positions within the window: the
# sliding_window kind's default, the README's row)
BASELINE_ROWS = {"softmax": "softmax", "streaming": "streaming_cachepos"}


def long_context_record(row: dict, baselines: dict[str, dict]) -> dict:
    """One long-context result (``hf_polyattn.eval.long_context``'s shape) from the study's flat rows: the baselines,
    then the row, on the same held-out tokens."""
    rows = [{**b, "baseline": name} for name, b in baselines.items()] + [row]
    for r in rows:
        assert r["tokens"] == row["tokens"] and r["settings"]["contexts"] == row["settings"]["contexts"], r["row"]
    keep = ("label", "attention", "perplexity", "passkey", "baseline")
    # a study row records its attention as "polyattn" (the pipeline's name); the long-context record's rows call it
    # "attention" (the plot names the model by its kind from it)
    rows = [{**r, "attention": r["polyattn"]} if r.get("polyattn") and "attention" not in r else r for r in rows]
    return {"settings": {**row["settings"], "baselines": list(baselines)}, "tokens": row["tokens"],
            "rows": [{k: r[k] for k in keep if k in r} for r in rows], "machine": row["machine"]}


def best_recipe() -> tuple[dict, str]:
    folder = RESULTS / "long_context"
    row = json.loads((folder / f"{BEST_ROW}.json").read_text())
    baselines = {name: json.loads((folder / f"{file}.json").read_text()) for name, file in BASELINE_ROWS.items()}
    results = {"args": row["args"], "polyattn": row["polyattn"], "stages": row["stages"], "evaluations": {},
               "machine": row["machine"], "total_wall_s": row["total_wall_s"], "total_cpu_s": row["total_cpu_s"],
               "long_context": long_context_record(row, baselines)}
    return results, f"python recipes/experiments/long_context/run_rows.py {BEST_ROW}"


def demo() -> tuple[dict, str]:
    record = json.loads((RESULTS / "demo" / "long_context.json").read_text())
    model_row = next(r for r in record["rows"] if not r.get("baseline"))
    results = {"args": {"model": "smollm2", "data": "demo", "task": "causal_lm"}, "polyattn": model_row["attention"],
               "evaluations": {}, "machine": record["machine"], "long_context": record}
    return results, "make demo"


CARDS = {"smollm2-linear-long-context": best_recipe, "smollm2-linear-demo": demo}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "model_cards"), help="folder of the cards (default: %(default)s)")
    args = p.parse_args(argv)
    for name, make in CARDS.items():
        results, command = make()
        config = AutoConfig.from_pretrained(resolve_checkpoint(results["args"]["model"]))
        path = card_from_results(Path(args.out) / name, results, config, command=command,
                                 model_name=f"SmolLM2-135M-Instruct-{name.removeprefix('smollm2-')}")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
