"""Attention transfer only: train the polyattn parameters of each layer to match its softmax output.

    accelerate launch recipes/transfer.py --model smollm2 --attention polysketch --transfer_steps 60 \\
        --output_dir runs/smollm2-polysketch-transfer

The result folder OUTPUT_DIR/model can then be fine-tuned with recipes/finetune.py --model OUTPUT_DIR/model.
"""

from _cli import parser as recipe_parser
from _defaults import TINY_SHAKESPEARE

from hf_polyattn.training.pipeline import RetrofitArgs, run

if __name__ == "__main__":
    parser = recipe_parser(RetrofitArgs, data=TINY_SHAKESPEARE)
    (args,) = parser.parse_args_into_dataclasses()
    if args.transfer_steps <= 0:
        raise SystemExit("recipes/transfer.py: set --transfer_steps N (> 0)")
    args.finetune_steps = 0
    run(args)
