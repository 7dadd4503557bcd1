"""Import behaviour, each case in a fresh interpreter."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def loads_without_plugin(tmp_path_factory):
    """{kind: what from_pretrained raised, as 'Type: message', or None when it loaded} for a folder of every kind,
    loaded in one fresh interpreter that never imports hf_polyattn (one interpreter for the 11 kinds: each paid
    about 10 s of importing transformers, 110 s of the suite and as many again on the minimum transformers)."""
    folders = {}
    for kind in KIND_CONFIGS:
        arch = "llama" if KIND_CONFIGS[kind].spec.causal else "bert"  # an architecture the kind serves
        folder = tmp_path_factory.mktemp(f"saved_{kind}")
        build(arch, kind).save_pretrained(folder)
        folders[kind] = (str(folder), "AutoModelForCausalLM" if arch == "llama" else "AutoModel")
    proc = run(f"""
    import json, sys
    import transformers
    raised = {{}}
    for kind, (folder, auto) in {folders!r}.items():
        try:
            getattr(transformers, auto).from_pretrained(folder)
            raised[kind] = None
        except Exception as e:  # noqa: BLE001 - what a user's traceback would end with
            raised[kind] = f"{{type(e).__name__}}: {{e}}"
    assert "hf_polyattn" not in sys.modules
    print(json.dumps(raised))
    """)
    return json.loads(proc.stdout.strip().splitlines()[-1]), {k: f for k, (f, _) in folders.items()}


@pytest.mark.parametrize("kind", list(KIND_CONFIGS))
def test_loading_without_plugin_fails_loudly(loads_without_plugin, kind):
    raised, folders = loads_without_plugin
    assert "import hf_polyattn" in (Path(folders[kind]) / "config.json").read_text()  # config.json says what to import
    error = raised[kind]
    assert error is not None, f"{kind}: loaded without the plugin"
    assert f'attn_implementation="{kind}"' in error and "is not supported" in error, error[-2000:]
