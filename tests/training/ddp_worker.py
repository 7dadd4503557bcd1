"""Run by test_multiprocess.py under `accelerate launch --multi_gpu --num_processes 2` (gloo on CPU)."""

import hashlib
import json
import sys
from pathlib import Path

import torch

from hf_polyattn.training.pipeline import Retrofit, RetrofitArgs

# polysketch with a learned sketch and q/k LayerNorm; a window brings the long-context settings with it
KERNEL = {"kind": "polysketch", "sketch": "learned", "sketch_size": 8, "block_size": 16, "qk_norm": True}
LONG = {"sinks": 4, "decay": "gate", "decay_horizon": 256.0, "window_mix": True, "window_mix_init": 0.01}
MODES = {
    # the retrofit recipe's setting (sliding window + learnable projection, then LoRA fine-tuning)
    "two_stage": ({**KERNEL, "window": 8, "feature_proj": 16, **LONG}, dict(lora=True, lora_r=4)),
    # context <= window: every key inside the window, the kernel part's parameters get no gradient
    "window_covers": ({**KERNEL, "window": 32, "feature_proj": 16, **LONG}, dict(lora=True, lora_r=4)),
    "full": ({**KERNEL, "local_exact": True}, {}),  # the block algorithm alone, full fine-tuning
    # "full" with softmax heads: layer 0 runs the kind on kv head 0 only, layer 1 is softmax
    "hybrid": ({**KERNEL, "local_exact": True, "softmax_heads": [[0, 1], [1, 0], [1, 1]]}, {}),
}


def run_mode(model_dir: str, text_file: str, out: Path, mode: str):
    """One retrofit (transfer, then fine-tuning) in ``mode``; each rank writes its weights' digest to
    out/rank{i}.json. The Retrofit, not yet closed, is returned."""
    attention, extra = MODES[mode]
    args = RetrofitArgs.build(model=model_dir, data=text_file, attention=attention, transfer_steps=3,
                              finetune_steps=2, context=32, eval_context=32, eval_stride=32, max_eval_tokens=256,
                              eval_before=False, save_model=False, progress=False, output_dir=str(out), threads=1,
                              **extra)
    r = Retrofit(args).prepare()
    r.transfer()
    r.finetune()
    model = r.acc.unwrap_model(r.model)
    h = hashlib.sha256()
    for n, p in sorted(model.named_parameters()):
        h.update(n.encode())
        h.update(p.detach().to(torch.float64).cpu().numpy().tobytes())
    rank = r.acc.process_index
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": r.acc.num_processes, "sha": h.hexdigest(),
        "polyattn_sum": float(sum(p.detach().double().sum() for n, p in model.named_parameters()
                                  if ".polyattn." in n)),
    }))
    return r


if __name__ == "__main__":
    # MODES: comma-separated, run one after the other in the same two processes (one launch: each launch cost
    # about 20 s of starting processes and imports on 2 cores), each into out/<mode>
    model_dir, text_file, out = sys.argv[1:4]
    modes = (sys.argv[4] if len(sys.argv) > 4 else "full").split(",")
    last = None
    for mode in modes:
        last = run_mode(model_dir, text_file, Path(out, mode), mode)
    last.close()  # as pipeline.run does: without a teardown, rank 1 aborted at exit in 1 of 9 runs (gloo threads)
