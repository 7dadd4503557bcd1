"""Evaluate, or compare: softmax vs each attention kind, written as JSON and Markdown.

    # compare finished runs (reads each OUTPUT_DIR/results.json)
    python recipes/evaluate.py --runs runs/smollm2-softmax runs/smollm2-polysketch --output results/smollm2

    # evaluate one saved model folder (perplexity or accuracy, no training)
    python recipes/evaluate.py --model runs/smollm2-polysketch/model --attention polysketch --output_dir runs/eval
"""

import sys
from dataclasses import dataclass, field

from _cli import parser as recipe_parser
from _defaults import TINY_SHAKESPEARE

from hf_polyattn.eval.compare import compare_runs, table_markdown, write_table
from hf_polyattn.training.pipeline import RetrofitArgs, run


@dataclass
class CompareArgs:
    runs: list[str] = field(default_factory=list, metadata={"help": "run output dirs (with results.json)"})
    output: str = field(default="results/comparison", metadata={"help": "path stem of the .json / .md table"})


if __name__ == "__main__":
    if "--runs" in sys.argv:
        (cargs,) = recipe_parser(CompareArgs).parse_args_into_dataclasses()
        table = compare_runs(cargs.runs)
        j, md = write_table(table, cargs.output)
        print(table_markdown(table))
        print(f"wrote {j} and {md}")
    else:
        parser = recipe_parser(RetrofitArgs, data=TINY_SHAKESPEARE)
        (args,) = parser.parse_args_into_dataclasses()
        args.transfer_steps = args.finetune_steps = 0
        args.eval_before = True
        run(args)
