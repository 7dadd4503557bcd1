"""Retrofit a pretrained checkpoint with polynomial / PolySketch / linear / Performer attention.

Stages (each skipped when its step count is 0): swap the attention -> attention transfer (only the
polyattn parameters train, to match each layer's softmax output) -> fine-tuning (full or LoRA) ->
evaluation after each stage -> a Hub-ready folder in OUTPUT_DIR/model. See recipes/README.md.

    accelerate launch recipes/retrofit.py --model smollm2 --attention polysketch \\
        --transfer_steps 60 --finetune_steps 40 --output_dir runs/smollm2-polysketch

Sharded over N processes with FSDP2 (CPUs: gloo; GPUs: also `accelerate launch --config_file
recipes/accelerate_fsdp.yaml`):

    torchrun --nproc_per_node 2 recipes/retrofit.py --model smollm2 --attention polysketch \\
        --transfer_steps 60 --lora --finetune_steps 40 --fsdp --output_dir runs/smollm2-polysketch-fsdp
"""

from _cli import parser as recipe_parser
from _defaults import TINY_SHAKESPEARE

from hf_polyattn.training.pipeline import RetrofitArgs, run

if __name__ == "__main__":
    parser = recipe_parser(RetrofitArgs, data=TINY_SHAKESPEARE)
    (args,) = parser.parse_args_into_dataclasses()
    run(args)
