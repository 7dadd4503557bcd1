"""Causal attention benchmark against SDPA (see hf_polyattn/bench.py; also `hf-polyattn bench`)."""

from hf_polyattn.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
