"""Shared test setup: a fixed seed for every test and two threads (the CI machine's cores)."""

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. It must be on before anything in
# the process imports triton (transformers' from_pretrained does, through torch): a later switch
# leaves triton half in compiled mode ("Cannot call @triton.jit'd outside of the scope of a kernel").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
    from tests.triton_interpreter import mend

    mend()  # the interpreter's bf16 dots and fp32 -> bf16 rounding made to match CUDA's (tests/triton_interpreter.py)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    torch.set_num_threads(min(2, torch.get_num_threads()))
