"""Import behaviour, each case in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from integration_helpers import KIND_CONFIGS, build

ROOT = Path(__file__).resolve().parents[2]

CHECK_REGISTERED = """
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from hf_polyattn import kind_names
missing = [k for k in kind_names() if k not in AttentionInterface._global_mapping
           or k not in AttentionMaskInterface._global_mapping]
assert not missing, missing
"""


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run(code: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if expect_ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_ops_does_not_import_transformers_and_api_is_lazy():
    run("""
    import sys
    import hf_polyattn.ops
    import hf_polyattn
    assert "transformers" not in sys.modules, "hf_polyattn.ops imported transformers"
    assert hf_polyattn.__all__ == sorted(hf_polyattn.__all__)
    assert hf_polyattn.PolyAttnConfig().kind == "polysketch" and "transformers" not in sys.modules
    for name in hf_polyattn.__all__:  # the lazy names import the integration (and transformers) on use
        getattr(hf_polyattn, name)
    assert callable(hf_polyattn.convert) and hf_polyattn.PolyAttnCache.__name__ == "PolyAttnCache"
    """)


ORDERS = {
    # plugin (here via a subpackage: its import runs hf_polyattn/__init__.py) before transformers
    "plugin_first": ("import hf_polyattn.ops\nimport sys\nassert 'transformers' not in sys.modules\n"
                     "from transformers import AutoModelForCausalLM\n"),
    "transformers_first": "import transformers\nimport hf_polyattn\n",
}


def test_kinds_registered_in_any_import_order():
    # One fresh interpreter per order, run side by side (each pays the transformers import).
    tail = "import hf_polyattn, sys\nassert hf_polyattn._IMPORT_HOOK not in sys.meta_path\n"
    procs = {order: _start(head + CHECK_REGISTERED + tail) for order, head in ORDERS.items()}
    for order, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{order}: {err[-3000:]}"


@pytest.mark.parametrize("kind", list(KIND_CONFIGS))
def test_loading_without_plugin_fails_loudly(tmp_path, kind):
    arch = "llama" if KIND_CONFIGS[kind].spec.causal else "bert"  # an architecture the kind serves
    build(arch, kind).save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    assert "import hf_polyattn" in config  # config.json says what to import
    auto = "AutoModelForCausalLM" if arch == "llama" else "AutoModel"
    proc = run(f"""
    from transformers import {auto}
    {auto}.from_pretrained({str(tmp_path)!r})
    """, expect_ok=False)
    assert proc.returncode != 0
    assert f'attn_implementation="{kind}"' in proc.stderr and "is not supported" in proc.stderr, proc.stderr[-2000:]
