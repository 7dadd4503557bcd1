"""A checkpoint folder with a model's architecture and random weights, for timing only.

    python recipes/model_from_config.py SRC DST [--dtype bf16]

SRC holds a ``config.json`` (a retrofitted model's: its polyattn settings and per-layer layout come with it, so the
copy runs the same attention in every layer and head). DST gets ``save_pretrained``'s folder with weights drawn by
the architecture's own initialiser (seed 0). Speed and memory do not depend on the weights' values (no path of the
retrofit branches on them), so ``hf-polyattn bench --model DST`` times the same computation as the trained model
where its weights cannot be copied; perplexity and retrieval of DST mean nothing.
"""

import argparse
import sys
from pathlib import Path

DTYPES = ("fp32", "bf16", "fp16")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="a folder holding config.json")
    p.add_argument("dst", type=Path, help="the folder to write (created)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="the weights' dtype on disk (default fp32)")
    args = p.parse_args(argv)
    if not (args.src / "config.json").is_file():
        p.error(f"src {str(args.src)!r}: no config.json in it")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_polyattn  # registers the polyattn attention a retrofit's config names

    config = AutoConfig.from_pretrained(args.src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])
    model.save_pretrained(args.dst)
    layout = hf_polyattn.layer_layout(model)
    softmax = sum(len(row.get("softmax_kv_heads") or []) for row in layout)
    print(f"{args.dst}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters "
          f"({args.dtype}, random), {len(layout)} attention layers, {softmax} softmax kv heads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
