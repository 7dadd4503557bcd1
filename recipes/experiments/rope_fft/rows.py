"""Inputs of the rope_fft study (seed document 003, fast RoPE attention: the polynomial method + FFT): the error of
``rope_fft_attention`` (``recipes/rope_fft.py``) against exact softmax RoPE attention vs degree g and entry bound B,
and its time vs n against the quadratic algorithm, in one process on this machine (under 5 minutes on the 2-core
CPU); then the section ``SECTION_rope_fft.md`` from the JSON.

    python recipes/experiments/run.py rope_fft
"""

ROWS = {"accuracy_and_timing": ["recipes/rope_fft_accuracy.py", "--out", "{results}"]}
AFTER = [["-m", "recipes.experiments.rope_fft.fill_section"]]
