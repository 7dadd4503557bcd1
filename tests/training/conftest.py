"""Tiny models, a tiny tokenizer and small excerpts of the real data, all built in code / shipped here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
TEXT = FIXTURES / "tiny_shakespeare.txt"  # first 300 lines of ../shared/data/tinyshakespeare_train.txt
TSV = FIXTURES / "tiny_sst2.tsv"  # header + first 300 rows of ../shared/data/sst2_train.tsv


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def build_tokenizer(path: Path):
    """A byte-level BPE (vocab 320) trained on the fixtures, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = TEXT.read_text().splitlines() + [r.split("\t")[0] for r in TSV.read_text().splitlines()]
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Saved tiny checkpoints: {'llama': dir, 'bert': dir}, sharing one tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    tok = build_tokenizer(root / "tok")
    out = {}
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                                         bos_token_id=1))
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    max_position_embeddings=128, pad_token_id=0, num_labels=2))
    for name, model in (("llama", llama), ("bert", bert)):
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        out[name] = str(d)
    return out


@pytest.fixture
def text_file():
    return str(TEXT)


@pytest.fixture
def tsv_file():
    return str(TSV)


def cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env
