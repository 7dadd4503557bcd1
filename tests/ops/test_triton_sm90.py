"""The Triton kernels as an H100 would run them, checked without a GPU: compiled for sm_90 offline.

``recipes/inspect_triton_sm90.py`` specialises each launch of the benchmark shapes (H = 16, d = 64, n = 32k, bf16
inputs, tf32 dots) as Triton's JIT would on a GPU and compiles it for sm_90; these tests read its report. It runs
in a subprocess: the test session has TRITON_INTERPRET=1 (tests/conftest.py), under which kernels are interpreted,
not compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Every kernel launch of the causal product and of the exact local part at the benchmark shapes."""
    out = tmp_path_factory.mktemp("sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "inspect_triton_sm90.py"), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "sm90.json").read_text())


def test_no_register_spills(rows):
    """No kernel keeps values in local memory (spills) at the benchmark shapes. The square tiles' dA / dB with the
    diagonal chunk spilled 112 / 192 bytes at 4 warps (they run at 8); the local part's dk/dv kernel 144-160 bytes
    at two pipeline stages (it runs at one)."""
    assert {r["kernel"] for r in rows} >= {"_state_kernel", "_out_kernel", "_local_fwd_kernel", "_local_dkv_kernel"}
    spilled = [(r["case"], r["kernel"], r["stack"], r["sass"]["LDL"], r["sass"]["STL"]) for r in rows
               if r["stack"] or r["sass"]["LDL"] or r["sass"]["STL"]]
    assert not spilled, spilled


def test_square_tiles_use_hopper_mma(rows):
    """Every square-tile kernel uses the warpgroup MMA (HGMMA), none the older mma.sync (HMMA): the state kernel
    accumulates its slab transposed so that its MMA has 64 rows (as phi^T Y, R = 32 rows: HMMA only)."""
    # the product's kernels; the running sums over its state slots (``_segment_*_kernel``) are no matmul
    square = [r for r in rows if r["case"].startswith("polysketch") and "gathered" not in r["case"]
              and not r["kernel"].startswith("_segment_")]
    assert {r["kernel"] for r in square} == {"_state_kernel", "_out_kernel", "_da_kernel", "_db_kernel",
                                             "_dc_kernel"}
    for r in square:
        assert r["sass"]["HGMMA"] > 0 and r["sass"]["HMMA"] == 0, (r["case"], r["kernel"], r["sass"])


def test_square_tiles_need_fewer_registers_for_their_states(rows):
    """The state kernel of square tiles holds a (64 x R) accumulator and no gathered (64 x 64) feature tiles:
    fewer registers than the gathered layout's (251 -> 128 in the sm_90 build), more programs per SM."""
    def regs(case):
        return max(r["reg"] for r in rows if r["case"] == case and r["kernel"] == "_state_kernel")

    assert regs("polysketch-local r32") < regs("polysketch-local r32, gathered")
