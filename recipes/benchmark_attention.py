"""Causal attention benchmark against SDPA (see hf_polyattn/bench.py; also `hf-polyattn bench`).

    python recipes/benchmark_attention.py                  # CPU: fp32, H=4, n = 1k..32k -> cpu-fp32.{md,json,png}
    python recipes/benchmark_attention.py --device cuda    # GPU: bf16, H=16, n = 2k..128k -> cuda-bf16.{md,json,png}
"""

from hf_polyattn.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
