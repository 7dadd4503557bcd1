"""Evaluate, or compare: softmax vs each attention kind, written as JSON and Markdown.

    # compare finished runs (reads each OUTPUT_DIR/results.json)
    python recipes/evaluate.py --runs runs/smollm2-softmax runs/smollm2-polysketch --output results/smollm2

    # evaluate one saved model folder (perplexity or accuracy, no training): `hf-polyattn retrofit` with no stage
    python recipes/evaluate.py --model runs/smollm2-polysketch/model --kind polysketch --data demo \\
        --output_dir runs/eval
"""

import argparse
import sys

from hf_polyattn.cli import main
from hf_polyattn.eval.compare import compare_runs, table_markdown, write_table

if __name__ == "__main__":
    if "--runs" in sys.argv:
        p = argparse.ArgumentParser(description="compare finished runs (each OUTPUT_DIR/results.json)")
        p.add_argument("--runs", nargs="+", required=True, help="run output dirs (with results.json)")
        p.add_argument("--output", default="results/comparison", help="path stem of the .json / .md table")
        cargs = p.parse_args()
        table = compare_runs(cargs.runs)
        j, md = write_table(table, cargs.output)
        print(table_markdown(table))
        print(f"wrote {j} and {md}")
    else:
        sys.exit(main(["retrofit", *sys.argv[1:], "--transfer_steps", "0", "--finetune_steps", "0",
                       "--eval_before", "true"]))
