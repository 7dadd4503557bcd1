"""``python -m hf_polyattn.retrofit ARGS`` = ``hf-polyattn retrofit ARGS``: the module entry that launchers start.

    accelerate launch -m hf_polyattn.retrofit --model smollm2 --preset long-context --data demo --output_dir out
    torchrun --nproc_per_node 2 -m hf_polyattn.retrofit --model smollm2 --preset long-context --data demo \\
        --fsdp --output_dir out

Every argument is the command's (``hf-polyattn retrofit --help``); the Python API is
``hf_polyattn.training.pipeline.RetrofitArgs.build`` and ``run``.
"""

import sys

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main(["retrofit", *sys.argv[1:]]))
