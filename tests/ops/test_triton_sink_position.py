"""Triton sliding window with sinks scored by re-rotated queries (``local_blocks_triton(..., sink_q=, learned=)``,
``sink_position='window'``) against the PyTorch ``_window_exact``, the re-rotated queries a leaf of their own (the dq
kernel's gradient of them). Argument checks, half-precision inputs, and through the attention module (the host's
rotation and its gradient back into q, prefill in chunks, decoding): tests/ops/test_triton_sinks.py, its 'rotated'
and 'rope' cases.

Without a GPU the kernels run in Triton's interpreter (tests/ops/triton_setup.py); with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hf_polyattn.ops.common import _with_normaliser
from hf_polyattn.ops.triton import local_blocks_triton
from hf_polyattn.ops.window import sink_shifts
from tests.ops.test_triton_local import FP32_REL, _close, _inputs, _mask
from tests.ops.test_triton_sinks import ROPE
from tests.ops.test_triton_window import _grads, _module

N = 37
D = 8


def _window_inputs(mod, mask_kind, n=N, dtype=torch.float32):
    """q, k, v, the window's mask without the sinks, the slots as leaves (k, [v, 1], pos) and the re-rotated queries
    as a leaf of their own (rows turned by ``sink_shifts``, as the module does)."""
    q, k, v, _ = _inputs(n, dtype=dtype)
    mask = _mask(mask_kind, n)
    cfg = mod.config
    shifts = sink_shifts(mask, n, n, 0, cfg.window + cfg.sinks - 1, q.device)
    sink_q = ROPE.rotate(q.detach(), shifts[:, None, None, :]).requires_grad_()
    found = mod._window_sinks(k, v, mask)
    slots = tuple(x.detach().requires_grad_() for x in (found.k, found.v))
    return q, k, v, found.rest(mask), slots, found.pos, sink_q


def _triton(mod, inputs, kernel, window, learned):
    """(loc, far scale) of the Triton window with its sinks scored by the re-rotated queries; ``inputs`` as
    ``_window_inputs`` gives them ([v, 1] made anew per run: its graph is freed by the first run's gradients)."""
    q, k, v, rest, slots, pos, sink_q = inputs
    loc, log_far = local_blocks_triton(q, k, _with_normaliser(v, rest), 16, True, D ** -0.5, kernel, rest,
                                       mod._exact_power, window=window, sinks=(*slots, pos), sink_q=sink_q,
                                       learned=learned)
    return loc, None if log_far is None else log_far.exp()


def _torch(mod, inputs, learned):
    """The same from the PyTorch ``_window_exact``."""
    q, k, v, rest, slots, pos, sink_q = inputs
    return mod._window_exact(q, k, _with_normaliser(v, rest), rest, True, D ** -0.5, None, *slots, pos, sink_q,
                             learned)


def _check(mod, inputs, kernel, window, learned):
    """Values, far scale and the gradients of q, k, v, the slots' k and [v, 1], and the re-rotated queries."""
    (loc, far), (ref, ref_far) = _triton(mod, inputs, kernel, window, learned), _torch(mod, inputs, learned)
    _close(loc, ref, FP32_REL, "loc")
    if kernel == "softmax":
        _close(far, ref_far, FP32_REL, "exp(log_far)")
    q, k, v, _, slots, _, sink_q = inputs
    leaves = (q, k, v, *slots, sink_q)
    names = ["q", "k", "v", "slot k", "slot [v, 1]", "sink_q"]
    for name, a, b in zip(names, _grads(loc, None, leaves), _grads(ref, None, leaves), strict=True):
        _close(a, b, FP32_REL, f"d{name}")


@pytest.mark.parametrize("mask_kind", [None, "right", "left"], ids=["nomask", "right", "left"])
@pytest.mark.parametrize("kernel,degree,learned", [("softmax", 2, 2), ("polynomial", 2, 0), ("polynomial", 4, 3)],
                         ids=["softmax-l2", "poly2", "poly4-l3"])
def test_matches_pytorch_window(kernel, degree, learned, mask_kind):
    """w = 5 at n = 37, GQA, 3 sinks (row 1 left-padded by 20: its sinks are keys 20..22) after ``learned`` slots."""
    mod = _module(kernel, degree, 5, sinks=3, learned_sinks=learned)
    _check(mod, _window_inputs(mod, mask_kind), kernel, 5, learned)


def test_two_slot_tiles_several_row_tiles():
    """19 slots (6 sinks after 13 learned slots: the split falls inside the first tile of 16) at n = 150 (3 row
    tiles), w = 66."""
    mod = _module("softmax", 2, 66, sinks=6, learned_sinks=13)
    _check(mod, _window_inputs(mod, "left", n=150), "softmax", 66, 13)
