"""Train a small softmax model from scratch (no pretrained weights of these shapes are installable offline): a GPT-2,
or a Gemma 3 text model with its sliding-window layers (``family='gemma3'``: five local layers per global one, as
Gemma 3); the saved folder is then retrofitted / converted like any checkpoint (`hf-polyattn retrofit --model DIR`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..data import lm_batch, load_text_data
from ..eval.metrics import perplexity
from .loop import LoopConfig, fingerprint_of, finish_run, train_loop

__all__ = ["FAMILIES", "ScratchArgs", "scratch_config", "train_bpe_tokenizer", "train_scratch"]

FAMILIES = ("gpt2", "gemma3")


@dataclass
class ScratchArgs:
    data: str | None = field(default=None, metadata={"help": "local text file (required; the recipe defaults to "
                                                             "the repository's Tiny Shakespeare copy)"})
    family: str = field(default="gpt2", metadata={"help": f"model family, one of {list(FAMILIES)}: 'gemma3' is a "
                                                            "Gemma 3 text model (sliding-window and global layers)"})
    vocab_size: int = field(default=2048, metadata={"help": "byte-level BPE vocabulary trained on the train part"})
    n_layer: int = field(default=4, metadata={"help": "layers"})
    n_embd: int = field(default=256, metadata={"help": "width (hidden size)"})
    n_head: int = field(default=4, metadata={"help": "attention heads (gemma3: half as many kv heads)"})
    context: int = field(default=256, metadata={"help": "training window (and GPT-2's n_positions)"})
    sliding_window: int = field(default=64, metadata={"help": "gemma3: the window of its sliding-window layers"})
    global_every: int = field(default=6, metadata={"help": "gemma3: every this many layers one is global (full "
                                                           "attention), the last of each group, as Gemma 3's 5:1"})
    steps: int = field(default=600, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=16, metadata={"help": "per-process batch size"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (cosine, 5 percent warm-up)"})
    eval_tokens: int = field(default=8192, metadata={"help": "held-out tokens for the final perplexity"})
    output_dir: str = field(default="runs/gpt2-scratch", metadata={"help": "checkpoints, metrics, model/"})
    save_every: int = field(default=100, metadata={"help": "checkpoint every N steps"})
    resume: bool = field(default=True, metadata={"help": "resume from output_dir's checkpoint"})
    seed: int = field(default=0, metadata={"help": "seed"})
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads"})
    progress: bool = field(default=True, metadata={"help": "progress bar"})

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {list(FAMILIES)}, got {self.family!r}")
        for name in ("sliding_window", "global_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def train_bpe_tokenizer(text_file: str, vocab_size: int, out_dir: Path):
    """A byte-level BPE trained on the training part of ``text_file`` (the held-out tail is excluded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = Path(text_file).read_text().splitlines()
    lines = lines[: int(round(len(lines) * 0.9))]  # same cut as load_text_data(eval_fraction=0.1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return fast


def scratch_config(a: ScratchArgs, tok):
    """The transformers config of ``a.family`` with its sizes and ``tok``'s vocabulary and special tokens."""
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if a.family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=len(tok), n_positions=a.context, n_embd=a.n_embd, n_layer=a.n_layer,
                          n_head=a.n_head, **special)
    if a.family == "gemma3":
        from transformers import Gemma3TextConfig

        head_dim = a.n_embd // a.n_head
        types = ["full_attention" if (i + 1) % a.global_every == 0 else "sliding_attention" for i in range(a.n_layer)]
        # RoPE positions have no table: max_position_embeddings only bounds what evaluations may ask for (32k, as
        # Gemma 3 1B)
        return Gemma3TextConfig(vocab_size=len(tok), hidden_size=a.n_embd, intermediate_size=4 * a.n_embd,
                                num_hidden_layers=a.n_layer, num_attention_heads=a.n_head,
                                num_key_value_heads=max(1, a.n_head // 2), head_dim=head_dim,
                                query_pre_attn_scalar=head_dim, sliding_window=a.sliding_window, layer_types=types,
                                max_position_embeddings=32768, **special)
    raise ValueError(f"family must be one of {list(FAMILIES)}, got {a.family!r}")


def train_scratch(a: ScratchArgs) -> dict:
    from accelerate import Accelerator
    from transformers import Gemma3ForCausalLM, GPT2LMHeadModel

    if a.threads:
        torch.set_num_threads(a.threads)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    out = Path(a.output_dir)
    if not a.data or not Path(a.data).exists():
        raise FileNotFoundError(f"{a.data} does not exist (the from-scratch tokenizer is trained on a local file)")
    tok_dir = out / "tokenizer"
    if acc.is_main_process and not (tok_dir / "tokenizer.json").exists():
        train_bpe_tokenizer(a.data, a.vocab_size, tok_dir)
    acc.wait_for_everyone()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    data = load_text_data(a.data, tok, eval_fraction=0.1, max_eval_tokens=a.eval_tokens)
    torch.manual_seed(a.seed)
    cfg = scratch_config(a, tok)
    model = (GPT2LMHeadModel if a.family == "gpt2" else Gemma3ForCausalLM)(cfg)
    params = list(model.named_parameters())
    wrapped = acc.prepare(model)
    loop = LoopConfig(output_dir=str(out), max_steps=a.steps, lr=a.lr, weight_decay=0.1,
                      warmup_steps=max(1, a.steps // 20), save_every=a.save_every, resume=a.resume,
                      desc="pretrain", progress=a.progress)
    fp = fingerprint_of(params, stage="pretrain", **{k: v for k, v in asdict(a).items()
                                                     if k in ("data", "vocab_size", "n_layer", "n_embd", "n_head",
                                                              "context", "batch_size", "lr", "seed")
                                                     or (k in ("family", "sliding_window", "global_every")
                                                         and a.family != "gpt2")})
    summary = train_loop(acc, wrapped, params,
                         lambda s, m, r: lm_batch(data.train_ids, batch_size=a.batch_size, context=a.context,
                                                  seed=a.seed, step=s, micro=m, rank=r, world=acc.num_processes),
                         lambda m, b: m(**b).loss, loop, fp)
    model = acc.unwrap_model(wrapped)
    ev = perplexity(model, data.eval_ids, context=a.context, stride=a.context, progress=a.progress)
    result = {"args": asdict(a), "pretrain": {k: v for k, v in summary.items() if k != "history"},
              "eval": ev, "data": data.describe()}
    if acc.is_main_process:
        model.save_pretrained(out / "model")
        tok.save_pretrained(out / "model")
        (out / "results.json").write_text(json.dumps(result, indent=2))
        print(f"held-out perplexity {ev['perplexity']:.2f}; retrofit: hf-polyattn retrofit --model {out / 'model'}")
    finish_run(acc)
    return result
