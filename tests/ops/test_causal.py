"""The block lower-triangular product: against a dense masked product, gradcheck, cumsum twin."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn.ops import lt_multiply, lt_multiply_cumsum, symmetric_square

CASES = [
    # id, n, block, include_diag, square, lead_a, lead_bc
    ("n37-b8-diag", 37, 8, True, False, (2, 3, 2), (2, 3, 1)),
    ("n37-b8-nodiag-square", 37, 8, False, True, (2, 3, 2), (2, 3, 1)),
    ("n16-b8-square", 16, 8, True, True, (1, 2, 1), (1, 2, 1)),
    ("n5-lt-block", 5, 8, True, True, (1, 1, 3), (2, 1, 1)),
    ("n1", 1, 4, True, False, (1, 1, 1), (1, 1, 1)),
    ("b1-per-token", 9, 1, True, False, (1, 2, 1), (1, 2, 1)),
]


def _dense(a, b, c, block, include_diag, square):
    fa, fb = (symmetric_square(a), symmetric_square(b)) if square else (a, b)
    n = a.shape[-2]
    i = torch.arange(n)
    keep = i[None, :] <= i[:, None]
    if not include_diag:
        keep &= (i[None, :] // block) != (i[:, None] // block)
    return ((fa @ fb.transpose(-1, -2)) * keep) @ c


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lt_multiply_matches_dense(case):
    _, n, block, diag, square, lead_a, lead_bc = case
    a = torch.randn(*lead_a, n, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(*lead_bc, n, 5, dtype=torch.float64, requires_grad=True)
    c = torch.randn(*lead_bc, n, 3, dtype=torch.float64, requires_grad=True)
    out = lt_multiply(a, b, c, block, diag, square)
    ref = _dense(a, b, c, block, diag, square)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for name, x, y in zip("abc", torch.autograd.grad((out * g).sum(), (a, b, c)),
                          torch.autograd.grad((ref * g).sum(), (a, b, c))):
        torch.testing.assert_close(x, y, msg=lambda m, nm=name: f"d{nm}: {m}")


@pytest.mark.parametrize("square", [False, True], ids=["identity", "square"])
@pytest.mark.parametrize("diag", [False, True], ids=["nodiag", "diag"])
def test_lt_multiply_gradcheck(square, diag):
    a = torch.randn(1, 2, 2, 11, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 2, 1, 11, 3, dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 2, 1, 11, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y, z: lt_multiply(x, y, z, 4, diag, square), (a, b, c))


def test_cumsum_variant_equals_block_variant():
    a, b = torch.rand(2, 3, 50, 6, dtype=torch.float64), torch.rand(2, 3, 50, 6, dtype=torch.float64)
    c = torch.randn(2, 3, 50, 4, dtype=torch.float64)
    torch.testing.assert_close(lt_multiply_cumsum(a, b, c, chunk=7), lt_multiply(a, b, c, 16))


def test_block_size_does_not_change_the_result():
    a, b, c = (torch.randn(1, 2, 70, 4, dtype=torch.float64) for _ in range(3))
    ref = lt_multiply(a, b, c, 70)
    for block in (1, 3, 16, 64, 256):
        torch.testing.assert_close(lt_multiply(a, b, c, block), ref)


def test_bad_arguments():
    a = torch.randn(1, 10, 4)
    with pytest.raises(ValueError, match="block_size"):
        lt_multiply(a, a, a, 0)
    with pytest.raises(ValueError, match="same length"):
        lt_multiply(a, a[:, :5], a)
    with pytest.raises(ValueError, match="feature size"):
        lt_multiply(a, a[..., :3], a)
