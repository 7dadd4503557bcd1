"""Scripts of the thesis_reversal study (run from anywhere; see recipes/experiments/README.md)."""
