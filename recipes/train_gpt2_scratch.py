"""Train a small GPT-2 (softmax attention) from scratch on Tiny Shakespeare, then retrofit it like the others
(``--family gemma3``: a Gemma 3 text model with its sliding-window layers instead).

    accelerate launch recipes/train_gpt2_scratch.py --steps 600 --output_dir runs/gpt2-scratch
    hf-polyattn retrofit --model runs/gpt2-scratch/model --data demo --kind polysketch --set sketch=learned \\
        --set local_exact=true --set block_size=64 --set qk_norm=true --transfer_steps 100 --finetune_steps 100 \\
        --output_dir runs/gpt2-polysketch
"""

from _cli import parser as recipe_parser
from _defaults import TINY_SHAKESPEARE

from hf_polyattn.training.scratch import ScratchArgs, train_scratch

if __name__ == "__main__":
    parser = recipe_parser(ScratchArgs, data=TINY_SHAKESPEARE)
    (args,) = parser.parse_args_into_dataclasses()
    train_scratch(args)
