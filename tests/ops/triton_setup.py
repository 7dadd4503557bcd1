"""Shared set-up of the Triton kernel tests: import it before anything imports triton.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are first
imported; every dot is then a full fp32 matmul, so fp32 tolerances are tight). With a GPU the tests run the
compiled kernels on CUDA. A test module importing this is skipped when triton is missing, or when the kernels were
imported before the variable could be set and there is no GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu":
    from hf_polyattn.ops.triton import causal, local

    if not (causal._is_interpreted() and local._is_interpreted()):
        pytest.skip("triton kernels were imported before TRITON_INTERPRET=1 could be set and there is no GPU",
                    allow_module_level=True)
