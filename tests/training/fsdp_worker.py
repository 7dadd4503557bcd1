"""The retrofit that test_multiprocess.py launches as `torchrun --nproc_per_node 2 -m hf_polyattn.retrofit ARGV`
(FSDP2 over gloo on CPU) and runs in one process without sharding as the reference: the same retrofit on the same
global batch of 4 sequences, given as the command line of `hf-polyattn retrofit`."""

# the retrofit recipe's setting (sliding window + learnable projection, learned sketch, q/k LayerNorm, the
# long-context settings): transfer, then LoRA or full fine-tuning
ATTENTION = ["--kind", "polysketch", "--set", "sketch=learned", "--set", "sketch_size=8", "--set", "block_size=16",
             "--set", "window=8", "--set", "feature_proj=16", "--set", "qk_norm=true", "--set", "sinks=4",
             "--set", "decay=gate", "--set", "decay_horizon=256", "--set", "window_mix=true",
             "--set", "window_mix_init=0.01"]
COMMON = ["--transfer_steps", "3", "--finetune_steps", "2", "--context", "32", "--eval_context", "32",
          "--eval_stride", "32", "--max_eval_tokens", "256", "--eval_before", "false", "--progress", "false",
          "--threads", "1"]


def argv(model_dir: str, text_file: str, out: str, mode: str, processes: int, fsdp: bool) -> list[str]:
    per_process = str(4 // processes)
    extra = ["--lora", "--lora_r", "4"] if mode == "lora" else []
    return ["--model", model_dir, "--data", text_file, "--output_dir", out, "--transfer_batch_size", per_process,
            "--batch_size", per_process, *(["--fsdp"] if fsdp else []), *ATTENTION, *COMMON, *extra]


def args(*a, **kw):
    """The same run as ``RetrofitArgs``, read from its command line by the CLI's own parser."""
    from hf_polyattn import cli

    return cli.retrofit_args(cli.build_parser().parse_args(["retrofit", *argv(*a, **kw)]))
