"""Model cards and the folder push_to_hub would upload (no network: the upload is captured)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import EvalResult, HfApi, ModelCard
from integration_helpers import KIND_CONFIGS, VOCAB, build
from transformers import AutoModelForCausalLM

import hf_polyattn
from hf_polyattn.integration import hub


def _named(model, name="my-org/tiny-llama"):
    model.config._name_or_path = name  # as after from_pretrained("my-org/tiny-llama")
    return model


def test_save_writes_model_card(tmp_path):
    model = hf_polyattn.convert(_named(build("llama")), KIND_CONFIGS["polysketch"])
    model.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["base_model"] == "my-org/tiny-llama"
    assert data["tags"][:2] == ["hf_polyattn", "polysketch"]
    # the settings polysketch reads, nothing else (feature_map, alpha, exact_path, ... are other kinds'); they
    # rebuild the same attention
    assert data["polyattn"] == KIND_CONFIGS["polysketch"].read_settings()
    assert hf_polyattn.PolyAttnConfig.from_dict(data["polyattn"]) == KIND_CONFIGS["polysketch"]
    assert not {"feature_map", "alpha", "exact_path", "num_features"} & set(data["polyattn"])
    assert "| `sketch` | `learned` |" in card.text and "import hf_polyattn" in card.text
    assert "AutoModelForCausalLM" in card.text
    assert "model-index" not in data  # no eval results known


def test_base_model_survives_load_save_chain(tmp_path):
    model = hf_polyattn.convert(_named(build("llama")), "linear")
    model.save_pretrained(tmp_path / "a")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "a")  # _name_or_path is now a local folder
    again.save_pretrained(tmp_path / "b")
    assert ModelCard.load(tmp_path / "b" / "README.md").data.base_model == "my-org/tiny-llama"


def test_local_path_is_not_a_base_model(tmp_path):
    model = build("llama", "performer")
    model.config._name_or_path = str(tmp_path)
    model.save_pretrained(tmp_path / "out")
    assert ModelCard.load(tmp_path / "out" / "README.md").data.base_model is None


def test_eval_results_and_update_keeps_user_text(tmp_path):
    model = hf_polyattn.convert(_named(build("llama")), "performer")
    model.save_pretrained(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text() + "\n## My notes\n\nTrained on my data.\n")
    hf_polyattn.write_model_card(tmp_path, model, eval_results=[
        EvalResult(task_type="text-generation", dataset_type="tiny_shakespeare", dataset_name="Tiny Shakespeare",
                   metric_type="perplexity", metric_value=62.6, dataset_split="test"),
    ], tags=["retrofit"])
    card = ModelCard.load(readme)
    assert "Trained on my data." in card.text
    assert card.text.count("<!-- hf_polyattn:start -->") == 1
    assert "| text-generation | Tiny Shakespeare | test | perplexity | 62.6 |" in card.text
    (res,) = card.data.eval_results
    assert res.metric_value == 62.6 and res.dataset_name == "Tiny Shakespeare"
    assert card.data.tags == ["hf_polyattn", "performer", "retrofit"]
    # Saving again keeps the recorded results and the user's section.
    model.save_pretrained(tmp_path)
    card = ModelCard.load(readme)
    assert card.data.eval_results[0].metric_value == 62.6 and "Trained on my data." in card.text


def test_write_model_card_needs_polyattn_model(tmp_path):
    with pytest.raises(ValueError, match="needs a model converted"):
        hf_polyattn.write_model_card(tmp_path, build("llama"))


@pytest.fixture
def captured_upload(monkeypatch, tmp_path):
    """Replace the network calls of the standard push path; keep a copy of the uploaded folder."""
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        dest = tmp_path / "uploaded"
        shutil.copytree(folder_path, dest)
        calls["upload_folder"] = (repo_id, kwargs)
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(hub, "_load_remote_card", lambda repo_id, token: None)
    return calls, tmp_path / "uploaded"


def _check_uploaded_folder(folder: Path, kind: str):
    assert {"config.json", "model.safetensors", "README.md", "generation_config.json"} <= {
        p.name for p in folder.iterdir()}
    config = json.loads((folder / "config.json").read_text())
    assert config["attn_implementation"] == kind and config["polyattn"]["kind"] == kind
    # loadable by clients that never import the plugin (trust_remote_code=True: test_remote_code.py)
    assert (folder / "hf_polyattn_loader.py").exists()
    # the served name (no engine without the plugin takes it for the base model); the loader exports the stock class
    own = config["architectures"][0]
    assert own.startswith("PolyAttn")
    assert config["auto_map"]["AutoModelForCausalLM"] == f"hf_polyattn_loader.{own.removeprefix('PolyAttn')}"
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers" and "hf_polyattn" in card.data.tags
    return card


def test_push_to_hub_uploads_weights_config_and_card(captured_upload):
    calls, folder = captured_upload
    model = hf_polyattn.convert(_named(build("llama")), KIND_CONFIGS["polysketch"])
    ids = torch.randint(3, VOCAB, (1, 9))
    ref = model(ids, use_cache=False).logits
    assert model.push_to_hub("me/tiny-polysketch", tags=["demo"], private=True) == "commit-info"
    assert calls["create_repo"] == ("me/tiny-polysketch", {"private": True, "exist_ok": True})
    card = _check_uploaded_folder(folder, "polysketch")
    assert card.data.tags == ["hf_polyattn", "polysketch", "demo"]
    assert card.data.base_model == "my-org/tiny-llama"
    assert 'from_pretrained("me/tiny-polysketch")' in card.text
    # titled after the repo, not the temp folder, then the base model and the attention
    assert "# tiny-polysketch: tiny-llama with polysketch attention" in card.text.splitlines()
    reloaded = AutoModelForCausalLM.from_pretrained(folder)  # what the Hub would serve
    torch.testing.assert_close(reloaded(ids, use_cache=False).logits, ref, rtol=0, atol=1e-5)


def test_save_pretrained_push_to_hub_keeps_card(captured_upload, tmp_path):
    calls, folder = captured_upload
    model = hf_polyattn.convert(build("gpt2"), "performer")
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="me/gpt2-performer",
                          commit_message="first")
    assert calls["upload_folder"][0] == "me/gpt2-performer"
    assert calls["upload_folder"][1]["commit_message"] == "first"
    _check_uploaded_folder(folder, "performer")
    assert (tmp_path / "local" / "README.md").exists()
