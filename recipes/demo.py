"""`make demo` in Python: SmolLM2-135M retrofitted for long context, judged at 256 ... 4,096 tokens beside softmax
and StreamingLLM. `make demo` runs the installed command instead:

    hf-polyattn retrofit --model smollm2 --preset demo --threads 2 --no_resume --output_dir runs/demo/linear

The ``demo`` preset (``hf-polyattn presets demo``; ``hf_polyattn/presets.py``):

1. resolves SmolLM2-135M-Instruct (the first time: de-quantises the packaged GGUF into a cached safetensors
   checkpoint, ~30 s; online users may pass --model HuggingFaceTB/SmolLM2-135M-Instruct),
2. scores its kv heads on passkey prompts and keeps the best quarter as exact softmax heads (DuoAttention's
   retrieval heads; ``softmax_heads='auto'``),
3. swaps every other head for linear attention (elu + 1 features; ``--kernel polysketch``: a learned polysketch
   r=16) beside an exact softmax 128-token window and 4 sink tokens, with a gated decay of the kernel state
   (horizon 256) and the kernel part starting nearly off: the long-context study's measured recipe,
4. runs a short attention transfer on 1,024-token sequences (only the polyattn parameters train),
5. evaluates perplexity at 256 ... 4,096 tokens on the same held-out tokens of the bundled Tiny Shakespeare and
   passkey retrieval at 1k and 2k, beside the softmax checkpoint and StreamingLLM (4 sinks + 128 window, no
   training), and writes the table, the plot (``long_context.png``) and a Hub-ready folder (weights, config,
   tokenizer, model card with the curve) to runs/demo/<kernel>.

Push it with --push_to_hub --hub_model_id you/smollm2-linear-demo (needs a Hub token).
The measured time and table on a 2-core CPU: recipes/results/SECTION_demo.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_polyattn.presets import attention_spec
from hf_polyattn.training.pipeline import RetrofitArgs, run

# the kernel of the linear-time heads: the preset's elu + 1, or a learned polysketch of sketch size 16 (measured
# closer to softmax up to 2k but 6 min 11 s and rising from 2k to 4k: recipes/results/SECTION_demo.md)
KERNELS = {"linear": None, "polysketch": ("polysketch", {"sketch": "learned", "sketch_size": 16})}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' (offline package), a Hub id or a local dir")
    p.add_argument("--kernel", choices=list(KERNELS), default="linear", help="the kernel of the linear-time heads")
    p.add_argument("--output_dir", default="runs/demo", help="the run goes to OUTPUT_DIR/KERNEL")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--push_to_hub", action="store_true", help="push the folder to the Hub")
    p.add_argument("--hub_model_id", help="repo id for --push_to_hub")
    a = p.parse_args(argv)
    fields, notes = {}, []
    if KERNELS[a.kernel] is not None:  # the preset's attention with another kernel (the run says what it left out)
        kind, settings = KERNELS[a.kernel]
        fields["attention"] = attention_spec("demo", kind=kind, overrides=settings, notes=notes)
    args = RetrofitArgs.build(preset="demo", notes=notes, model=a.model, output_dir=str(Path(a.output_dir) / a.kernel),
                              threads=a.threads, resume=False, push_to_hub=a.push_to_hub,
                              hub_model_id=a.hub_model_id, **fields)
    return run(args)  # prints the long-context table, what it retrofitted and where the folder went


if __name__ == "__main__":
    main()
