"""Retrofit a pretrained checkpoint from a checkout: the installed `hf-polyattn retrofit` command, every argument
its own (`--help` lists them; `hf-polyattn presets` lists the measured recipes).

    python recipes/retrofit.py --model smollm2 --preset long-context --data demo --output_dir runs/long-context
    python recipes/retrofit.py --model smollm2 --kind polysketch --set sketch=learned --set sketch_size=16 \\
        --set window=128 --data demo --transfer_steps 60 --output_dir runs/polysketch

Launched over several processes, the same arguments go to the package's module entry:

    accelerate launch -m hf_polyattn.retrofit --model smollm2 --preset long-context --data demo --output_dir runs/lc
    torchrun --nproc_per_node 2 -m hf_polyattn.retrofit --model smollm2 --preset long-context --data demo \\
        --fsdp --output_dir runs/lc-fsdp

The same run in Python: ``RetrofitArgs.build(preset="long-context", model="smollm2", data="demo",
output_dir="runs/long-context")`` and ``run(args)`` from ``hf_polyattn.training.pipeline`` (``recipes/demo.py``).
"""

import sys

from hf_polyattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["retrofit", *sys.argv[1:]]))
