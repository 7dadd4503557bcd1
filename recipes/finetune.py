"""Fine-tuning only (causal LM or sequence classification; full or --lora; fp32 or --mixed_precision bf16).

    # softmax baseline
    accelerate launch recipes/finetune.py --model smollm2 --attention softmax --finetune_steps 40 \\
        --output_dir runs/smollm2-softmax
    # a transferred model (recipes/transfer.py output)
    accelerate launch recipes/finetune.py --model runs/smollm2-polysketch-transfer/model --attention polysketch \\
        --finetune_steps 40 --output_dir runs/smollm2-polysketch-ft
    # SST-2 classification with LoRA
    accelerate launch recipes/finetune.py --model minilm --task classification \\
        --data ../shared/data/sst2_train.tsv --attention softmax --lora --finetune_steps 200 --output_dir runs/sst2
"""

from _cli import parser as recipe_parser
from _defaults import TINY_SHAKESPEARE

from hf_polyattn.training.pipeline import RetrofitArgs, run

if __name__ == "__main__":
    parser = recipe_parser(RetrofitArgs, data=TINY_SHAKESPEARE)
    (args,) = parser.parse_args_into_dataclasses()
    if args.finetune_steps <= 0:
        raise SystemExit("recipes/finetune.py: set --finetune_steps N (> 0)")
    args.transfer_steps = 0
    run(args)
