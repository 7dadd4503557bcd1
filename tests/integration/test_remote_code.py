"""Saved checkpoints that load without ``import hf_polyattn`` (``trust_remote_code=True``), each case in a fresh
process that never imports the plugin itself: a causal LM and an encoder."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from integration_helpers import ARCHS, VOCAB, auto_class, build, perturb_polyattn

from hf_polyattn.integration.remote_code import LOADER_FILE

ROOT = Path(__file__).resolve().parents[2]

# (arch, kind, auto class): a GQA decoder with learned sketches + exact blocks, an encoder with FAVOR+ features
CASES = {"llama": ("llama", "polysketch", "AutoModelForCausalLM"),
         "bert": ("bert", "performer", "AutoModelForMaskedLM")}

# Makes `import hf_polyattn` fail as it does where the package is not installed (the tests' checkout is importable).
HIDE_PLUGIN = """
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "hf_polyattn":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NotInstalled())
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case saved by the plugin, with its inputs (right padding in the second row) and the plugin's logits
    after reloading the folder with ``import hf_polyattn``."""
    root = tmp_path_factory.mktemp("remote")
    out = {}
    for name, (arch, kind, _) in CASES.items():
        model = build(arch, kind)
        perturb_polyattn(model)  # a reload that fell back to seed values would differ
        folder = root / name
        model.save_pretrained(folder)
        ids = torch.randint(3, VOCAB, (2, 12))
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        plugin = auto_class(ARCHS[arch]).from_pretrained(folder).eval()
        with torch.no_grad():
            logits = plugin(input_ids=ids, attention_mask=mask).logits
        torch.save({"ids": ids, "mask": mask, "logits": logits}, root / f"{name}.pt")
        out[name] = folder
    return root, out


def _run(code: str, root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(root / "modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_folder_has_auto_map_and_a_loader_with_nothing_but_the_plugin_and_stock_classes(saved):
    _, folders = saved
    for name, (_, _, auto) in CASES.items():
        folder = folders[name]
        config = json.loads((folder / "config.json").read_text())
        # config.json names the served architecture (no engine takes it for the base model); the loader the stock one
        assert config["architectures"][0].startswith("PolyAttn")
        own = config["architectures"][0].removeprefix("PolyAttn")
        assert config["auto_map"][auto] == f"hf_polyattn_loader.{own}"
        assert config["auto_map"]["AutoModel"].startswith("hf_polyattn_loader.")
        tree = ast.parse((folder / LOADER_FILE).read_text())
        docstring, plugin, stock = tree.body  # nothing else at the top level
        assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
        assert isinstance(plugin, ast.Try) and [a.name for a in plugin.body[0].names] == ["hf_polyattn"]
        assert [type(s) for s in plugin.handlers[0].body] == [ast.Raise]
        assert isinstance(stock, ast.ImportFrom) and stock.module == "transformers"
        exported = {a.name for a in stock.names}
        assert {ref.split(".")[1] for ref in config["auto_map"].values()} == exported and own in exported
        card = (folder / "README.md").read_text()
        assert "trust_remote_code=True" in card and "pip install hf_polyattn" in card and LOADER_FILE in card


def test_trust_remote_code_without_import_gives_the_plugins_model_and_logits(saved):
    root, folders = saved
    proc = _run(f"""
        import json, os, sys, torch, transformers
        assert "hf_polyattn" not in sys.modules  # the script never imports the plugin (only the loader does)
        results = {{}}
        for name, (arch, kind, auto) in {CASES!r}.items():
            folder = {str(root)!r} + "/" + name
            ref = torch.load({str(root)!r} + f"/{{name}}.pt")
            model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
            own = json.load(open(folder + "/config.json"))["architectures"][0].removeprefix("PolyAttn")
            with torch.no_grad():
                logits = model(input_ids=ref["ids"], attention_mask=ref["mask"]).logits
            # saving the loaded model again writes a folder that loads the same way (transformers marked the stock
            # class for copying its own modeling file: that save crashed on modeling_llama's relative imports)
            again = folder + "-again"
            model.save_pretrained(again)
            reloaded = getattr(transformers, auto).from_pretrained(again, trust_remote_code=True).eval()
            with torch.no_grad():
                logits_again = reloaded(input_ids=ref["ids"], attention_mask=ref["mask"]).logits
            results[name] = dict(
                stock=type(model) is getattr(transformers, own), attn=model.config._attn_implementation, kind=kind,
                polyattn=any(".polyattn." in n for n, _ in model.named_parameters()),
                equal=torch.equal(logits, ref["logits"]), equal_again=torch.equal(logits_again, ref["logits"]),
                files=sorted(f for f in os.listdir(again) if f.endswith(".py")),
                auto_class=getattr(transformers, own).__dict__.get("_auto_class"))
        print(json.dumps(results))
    """, root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in results.items():
        assert r["stock"] and r["attn"] == r["kind"] and r["polyattn"], (name, r)
        assert r["equal"] and r["equal_again"], (name, r)  # bit-identical to the plugin's logits
        assert r["files"] == [LOADER_FILE] and r["auto_class"] is None, (name, r)


def test_without_the_plugin_or_without_trust_remote_code_loading_fails_loudly(saved):
    root, folders = saved
    proc = _run(HIDE_PLUGIN + textwrap.dedent(f"""
        import json, transformers
        results = {{}}
        for name, (arch, kind, auto) in {CASES!r}.items():
            folder = {str(root)!r} + "/" + name
            for trust in (False, True):
                try:
                    getattr(transformers, auto).from_pretrained(folder, trust_remote_code=trust)
                    results[f"{{name}}-{{trust}}"] = "loaded"
                except Exception as err:
                    results[f"{{name}}-{{trust}}"] = f"{{type(err).__name__}}: {{err}}"
        print(json.dumps(results))
    """), root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, kind, _) in CASES.items():
        # without trust_remote_code: transformers' own refusal, as before (never a silent softmax model)
        assert results[f"{name}-False"].startswith("ValueError") and f'"{kind}"` is not supported' in (
            results[f"{name}-False"]), results
        # with it, but the plugin not installed: the loader says what to install
        assert results[f"{name}-True"].startswith("ImportError") and "pip install hf_polyattn" in (
            results[f"{name}-True"]), results


def test_a_config_transformers_does_not_know_gets_no_loader(tmp_path):
    """A remote-code architecture keeps its own auto_map: the loader names only stock classes."""
    from hf_polyattn.integration.remote_code import loader_classes, set_auto_map

    model = build("llama", "linear")
    assert loader_classes(model.config)["AutoModelForCausalLM"] == "LlamaForCausalLM"

    class CustomConfig(type(model.config)):
        pass

    custom = CustomConfig(**model.config.to_dict())
    custom.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    assert set_auto_map(custom, "linear") == {}
    assert custom.auto_map == {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
