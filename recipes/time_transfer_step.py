"""Time the demo's attention-transfer step at this checkout: the CPU-cost check of `make demo` without running it.

Builds what ``make demo`` trains (SmolLM2-135M-Instruct, every attention layer -> the ``demo`` preset's attention,
resolved by the pipeline, only the polyattn parameters trainable) and times ``--steps``
transfer steps (forward under ``distillation`` + backward, no optimizer) on a fixed batch of random token ids, the
demo's 1 x 1,024. The demo's softmax heads are chosen by scoring the checkpoint; here every head is the kernel kind,
the dearer case.
Prints the median and the fastest step (wall and process CPU seconds) after one warm-up step.

This machine's speed drifts (a step of the earlier demo, 4 x 256 tokens, took 2.8 s in one session and 3.4 to 4.2 s in
a later one), so compare two checkouts in one session, interleaved, never against a recorded number (PYTHONPATH
picks the package this script times; the demo's configuration is this checkout's):

    git worktree add /tmp/before <commit>
    for i in 1 2; do
        PYTHONPATH=/tmp/before python recipes/time_transfer_step.py
        PYTHONPATH=$PWD python recipes/time_transfer_step.py
    done
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_polyattn
from hf_polyattn.checkpoints import SMOLLM2_ALIASES, convert_smollm2_gguf
from hf_polyattn.presets import get_preset
from hf_polyattn.training.pipeline import resolve_attention
from hf_polyattn.training.transfer import distillation, polyattn_parameters, transfer_loss


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' (offline package), a local dir or a Hub id")
    p.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    p.add_argument("--batch_size", type=int, default=1, help="sequences per step")
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    a = p.parse_args(argv)
    if a.steps < 1 or a.batch_size < 1 or a.context < 1:
        p.error("--steps, --batch_size and --context must be >= 1")
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    source = convert_smollm2_gguf() if a.model.lower() in SMOLLM2_ALIASES else a.model
    model = AutoModelForCausalLM.from_pretrained(source)
    # the demo's attention as the pipeline builds it (every head the kernel kind: no checkpoint scoring here)
    cfg = resolve_attention({**get_preset("demo").attention, "softmax_heads": None}, model.config)
    model = hf_polyattn.convert(model, cfg)
    model.requires_grad_(False)
    for _, param in polyattn_parameters(model):
        param.requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, model.config.vocab_size, (a.batch_size, a.context), generator=gen),
             "attention_mask": torch.ones(a.batch_size, a.context, dtype=torch.long)}
    walls, cpus = [], []
    with distillation(model) as coll:
        for step in range(a.steps + 1):
            t, c = time.perf_counter(), time.process_time()
            transfer_loss(model.base_model, batch, coll).backward()
            if step:  # the first step is the warm-up
                walls.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
    print(f"transfer step ({a.batch_size} x {a.context} tokens, {a.threads} threads, {a.steps} steps): "
          f"wall median {statistics.median(walls):.2f} s, fastest {min(walls):.2f} s; "
          f"CPU median {statistics.median(cpus):.2f} s")


if __name__ == "__main__":
    main()
