"""Run by test_multiprocess.py under `torchrun --nproc_per_node 2` (FSDP2 over gloo on CPU), and in one process
without sharding as the reference: the same retrofit on the same global batch of 4 sequences."""

import sys

from hf_polyattn.training.pipeline import RetrofitArgs

# the retrofit recipe's setting (sliding window + learnable projection): transfer, then LoRA or full fine-tuning
COMMON = dict(attention="polysketch", sketch_size=8, block_size=16, window=8, feature_proj=16, transfer_steps=3,
              finetune_steps=2, context=32, eval_context=32, eval_stride=32, max_eval_tokens=256, eval_before=False,
              progress=False, threads=1)


def args(model_dir: str, text_file: str, out: str, mode: str, processes: int, fsdp: bool) -> RetrofitArgs:
    per_process = 4 // processes
    extra = dict(lora=True, lora_r=4) if mode == "lora" else {}
    return RetrofitArgs(model=model_dir, data=text_file, output_dir=out, transfer_batch_size=per_process,
                        batch_size=per_process, fsdp=fsdp, **COMMON, **extra)


if __name__ == "__main__":
    from hf_polyattn.training.pipeline import run

    model_dir, text_file, out, mode, processes, fsdp = sys.argv[1:7]
    run(args(model_dir, text_file, out, mode, int(processes), fsdp == "fsdp"))
