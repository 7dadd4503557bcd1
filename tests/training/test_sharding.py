"""Launch checks and layer choice of sharded retrofits (sharding.py), without starting processes."""

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from hf_polyattn.training.pipeline import Retrofit, RetrofitArgs
from hf_polyattn.training.sharding import LaunchError, check_before_accelerator, check_launch, layer_classes


def _acc(processes: int, kind: DistributedType):
    return SimpleNamespace(num_processes=processes, distributed_type=kind)


def test_a_launch_that_would_train_unconnected_copies_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="2 processes were launched .* accelerate connected 1"):
        check_launch(_acc(1, DistributedType.NO), fsdp=False)


def test_an_fsdp_config_without_fsdp_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(LaunchError, match=r"MULTI_CPU: every process would hold .* add --fsdp"):
        check_launch(_acc(1, DistributedType.MULTI_CPU), fsdp=False)
    with pytest.raises(LaunchError, match="FSDP: accelerate's own FSDP wrapping .* add --fsdp"):
        check_launch(_acc(1, DistributedType.FSDP), fsdp=False)
    monkeypatch.setenv("FSDP_VERSION", "1")  # accelerate's FSDP v1 without GPUs fails inside Accelerator()
    with pytest.raises(LaunchError, match="accelerate's FSDP needs GPUs. Shard on CPUs with `torchrun"):
        check_before_accelerator(fsdp=True)


def test_fsdp_in_one_process_is_refused_before_loading(tiny_dirs, text_file, tmp_path):
    with pytest.raises(LaunchError, match="--fsdp shards the model across processes, and this run has one"):
        Retrofit(RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file, attention="polysketch", fsdp=True,
                                    transfer_steps=1, output_dir=str(tmp_path))).prepare()
    assert not (tmp_path / "run_config.json").exists()


def test_layers_to_shard(tiny_dirs):
    """The classes a model declares unsplittable (_no_split_modules, on the model or its inner model); DistilBERT
    declares none: its stack of layers."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        DistilBertConfig,
        DistilBertForSequenceClassification,
    )

    assert layer_classes(AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])) == {"LlamaDecoderLayer"}
    bert = AutoModelForSequenceClassification.from_pretrained(tiny_dirs["bert"])
    assert layer_classes(bert) == {"BertEmbeddings", "BertLayer"}
    distil = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2,
                                                                  hidden_dim=64))
    assert layer_classes(distil) == {"TransformerBlock"}


def test_window_covering_the_context_is_named_in_a_warning(tiny_dirs, text_file, tmp_path):
    """--context <= --window: legal (the kernel's parameters get zero gradients), said in results.json."""
    r = Retrofit(RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file,
                                    attention={"kind": "polysketch", "sketch_size": 8, "window": 32}, context=32,
                                    output_dir=str(tmp_path), progress=False))
    r.prepare()
    assert r.results["distributed"] == {"processes": 1, "distributed_type": "NO", "backend": None, "sharding": "none"}
    (warning,) = r.results["warnings"]
    assert "--context 32" in warning and "window (32)" in warning
