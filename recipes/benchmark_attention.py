"""Causal attention benchmark against SDPA (see hf_polyattn/bench.py; also `hf-polyattn bench`).

    python recipes/benchmark_attention.py                  # CPU: fp32, H=4, n = 1k..32k -> cpu-fp32.{md,json,png}
    python recipes/benchmark_attention.py --device cuda    # GPU: bf16, H=16, n = 2k..128k -> cuda-bf16.{md,json,png}

The tables go to <repository>/recipes/results/benchmark_attention/ from any working directory (--out changes it).
"""

from pathlib import Path

from hf_polyattn import bench

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    # the package's default is relative to the working directory (`hf-polyattn bench` of an installed package
    # has no repository); the recipe writes where recipes/build_results.py reads, like every other recipe
    bench.DEFAULT_OUT = RESULTS / "benchmark_attention"
    raise SystemExit(bench.main())
