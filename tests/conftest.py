"""Shared test setup: a fixed seed for every test, two threads (the CI machine's cores), and tiny models, a tiny
tokenizer and small excerpts of real data, all built in code / shipped in tests/fixtures."""

import os
import re
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
TEXT = FIXTURES / "tiny_shakespeare.txt"  # the first 300 lines of Tiny Shakespeare (public domain)
TSV = FIXTURES / "tiny_sst2.tsv"  # header + the first 300 rows of GLUE SST-2's training split

# Without a GPU the Triton kernels run in Triton's interpreter. It must be on before anything in
# the process imports triton (transformers' from_pretrained does, through torch): a later switch
# leaves triton half in compiled mode ("Cannot call @triton.jit'd outside of the scope of a kernel").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
    from tests.triton_interpreter import mend

    mend()  # the interpreter's bf16 dots and fp32 -> bf16 rounding made to match CUDA's (tests/triton_interpreter.py)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """The tests marked slow first, the longest first (``slow(seconds=N)``: N measured on the 2-core CPU, in a whole
    suite on 2 workers), the order otherwise kept: pytest-xdist hands tests out in this order, and a test of minutes
    (the pip-install test: 272 s) drawn near the end keeps one worker busy after the other has run out of tests."""
    def rank(item):
        slow = item.get_closest_marker("slow")
        return 0.0 if slow is None else -float(slow.kwargs.get("seconds", 1.0))

    items.sort(key=rank)


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


# an absolute POSIX path of two or more parts, not inside a URL or a relative path ("hf_polyattn/ops", "https://...")
ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/[\w.+-]+/[\w.+/-]+")


def assert_no_local_path(text: str, *folders: Path) -> None:
    """No path of this machine in ``text`` (a model card): none of ``folders`` nor the home directory, no absolute
    path at all, no ~/ path, no Windows drive path."""
    for folder in (*folders, Path.home()):
        assert str(folder) not in text, f"{folder} in the card"
    assert not ABSOLUTE_PATH.findall(text), ABSOLUTE_PATH.findall(text)
    assert "~/" not in text and not re.search(r"\b[A-Za-z]:\\", text)
