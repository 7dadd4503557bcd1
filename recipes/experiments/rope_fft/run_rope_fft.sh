#!/usr/bin/env bash
# Seed document 003 (fast RoPE attention: the polynomial method + FFT): the error of rope_fft_attention against exact
# softmax RoPE attention vs degree g and entry bound B, and its time vs n against the quadratic algorithm, in one
# process on this machine (under 5 minutes on the 2-core CPU); then the section SECTION_rope_fft.md from the JSON.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
.venv/bin/python recipes/rope_fft_accuracy.py --out recipes/results/rope_fft
.venv/bin/python -m recipes.experiments.rope_fft.fill_section
