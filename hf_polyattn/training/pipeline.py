"""The retrofit pipeline behind the recipes: load -> convert -> transfer -> fine-tune -> evaluate -> save.

``RetrofitArgs`` holds every option (HfArgumentParser reads it from the command line); ``run`` executes
the stages whose step counts are > 0. Everything that can fail on bad input (data files, columns,
model id, architecture, a checkpoint of another run in ``output_dir``) is checked in ``prepare`` before
the first training step.

Output folder layout::

    output_dir/
      run_config.json          the arguments that must match to resume
      checkpoint-transfer/     resumable state of each stage (trainable params, optimizer, step)
      checkpoint-finetune/
      transfer_metrics.json, transfer_loss.png, finetune_metrics.json, finetune_loss.png
      results.json             evaluation after each stage, times
      model/                   Hub-ready: weights, config (with the attention settings), tokenizer, README.md
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import machine, registry
from ..checkpoints import CheckpointError, check_supported, resolve_checkpoint
from ..config import PolyAttnConfig
from ..data import (
    DataError,
    classification_batch,
    lm_batch,
    load_classification_data,
    load_text_data,
)
from ..eval.metrics import accuracy, perplexity
from . import sharding
from .loop import IncompatibleCheckpointError, LoopConfig, fingerprint_of, finish_run, train_loop
from .transfer import distillation, polyattn_parameters, transfer_loss

__all__ = ["RetrofitArgs", "Retrofit", "polyattn_config_from_args", "run"]

TASKS = ("causal_lm", "classification")


def attentions() -> tuple[str, ...]:
    """--attention choices: softmax (the model as it is) and every registered kind."""
    return ("softmax", *registry.kind_names())


@dataclass
class RetrofitArgs:
    """Arguments of the retrofit recipes (``--help`` lists them)."""

    model: str = field(default="smollm2", metadata={"help": "local checkpoint dir, Hub id, or an offline alias: "
                                                            "'smollm2', 'minilm'"})
    task: str = field(default="causal_lm", metadata={"help": f"one of {list(TASKS)}"})
    data: str | None = field(default=None, metadata={"help": "local .txt (causal_lm) / .csv/.tsv (classification) "
                                                             "file, or Hub id (required; the recipes default to "
                                                             "the repository's Tiny Shakespeare copy)"})
    text_column: str | None = field(default=None, metadata={"help": "default: 'text' (causal_lm), 'sentence' "
                                                                     "(classification)"})
    label_column: str = field(default="label", metadata={"help": "classification label column (int ids)"})
    eval_fraction: float = field(default=0.1, metadata={"help": "causal_lm: held-out tail fraction of the lines"})
    max_eval_tokens: int | None = field(default=8192, metadata={"help": "causal_lm: cap on held-out tokens"})
    num_eval: int = field(default=2000, metadata={"help": "classification: size of the seeded validation split"})
    attention: str = field(default="polysketch", metadata={"help": "softmax or an attention kind (`hf-polyattn kinds` "
                                                                   "lists them)"})
    degree: int = field(default=4, metadata={"help": "PolyAttnConfig.degree"})
    sketch: str = field(default="learned", metadata={"help": "PolyAttnConfig.sketch"})
    sketch_size: int = field(default=32, metadata={"help": "PolyAttnConfig.sketch_size"})
    feature_map: str = field(default="elu", metadata={"help": "PolyAttnConfig.feature_map (kind=linear)"})
    num_features: int = field(default=256, metadata={"help": "PolyAttnConfig.num_features (kind=performer)"})
    local_exact: bool = field(default=True, metadata={"help": "PolyAttnConfig.local_exact (ignored for polynomial)"})
    local_kernel: str | None = field(default=None, metadata={"help": "PolyAttnConfig.local_kernel"})
    window: int | None = field(default=None, metadata={
        "help": "PolyAttnConfig.window: an exact sliding window of this many keys, used instead of the local_exact "
                "blocks (0: blocks as local_exact says); default: the measured best for the task, 128 for causal_lm "
                "and 16 for classification (0 for polynomial, which is exact everywhere)"})
    feature_proj: int | None = field(default=None, metadata={
        "help": "PolyAttnConfig.feature_proj: a learnable projection of q and k to this many dimensions before the "
                "kernel (0: off); default: the measured best, the model's head_dim for causal_lm, off otherwise"})
    block_size: int = field(default=64, metadata={"help": "PolyAttnConfig.block_size"})
    qk_norm: bool = field(default=True, metadata={"help": "PolyAttnConfig.qk_norm"})
    sinks: int | None = field(default=None, metadata={"help": "PolyAttnConfig.sinks: sink tokens kept exactly beside "
                                                              "the window (default: the measured best, 4 for a "
                                                              "causal_lm with a window, else 0)"})
    learned_sinks: int | None = field(default=None, metadata={"help": "PolyAttnConfig.learned_sinks: learnable "
                                                                      "key/value slots beside the window"})
    decay: str | None = field(default=None, metadata={"help": "PolyAttnConfig.decay of the kernel state: none, "
                                                              "scalar or gate (default: the measured best, gate for "
                                                              "a causal_lm kernel kind with a window, else none)"})
    decay_horizon: float | None = field(default=None, metadata={"help": "PolyAttnConfig.decay_horizon (tokens)"})
    softmax_heads: str | None = field(default=None, metadata={
        "help": "PolyAttnConfig.softmax_heads: kv heads kept as exact softmax, 'LAYER:HEAD,...', a JSON list, "
                "@scores.json (written by `hf-polyattn score-heads`), or 'auto' / 'auto:K': the checkpoint's own "
                "top quarter / top K kv heads by retrieval score, measured before conversion (causal_lm)"})
    polyattn_json: str | None = field(default=None, metadata={"help": "a JSON dict of PolyAttnConfig fields that "
                                                                      "overrides the options above"})
    transfer_steps: int = field(default=0, metadata={"help": "attention-transfer steps (0: none)"})
    transfer_lr: float = field(default=1e-2, metadata={"help": "attention-transfer learning rate"})
    transfer_batch_size: int = field(default=4, metadata={"help": "per-process transfer batch size"})
    attn_ce_weight: float = field(default=0.0, metadata={"help": "weight of the attention-weight cross-entropy "
                                                                 "added to the transfer MSE (0: MSE only)"})
    finetune_steps: int = field(default=0, metadata={"help": "fine-tuning optimizer steps (0: none)"})
    finetune_lr: float = field(default=1e-4, metadata={"help": "fine-tuning learning rate"})
    polyattn_lr: float | None = field(default=None, metadata={"help": "fine-tuning lr of the polyattn params "
                                                                      "(default: finetune_lr)"})
    batch_size: int = field(default=4, metadata={"help": "per-process fine-tuning micro-batch size"})
    grad_accum: int = field(default=1, metadata={"help": "gradient accumulation steps"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps of each stage"})
    lora: bool = field(default=False, metadata={"help": "fine-tune with LoRA (peft) instead of all weights"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha"})
    context: int = field(default=256, metadata={"help": "causal_lm: training window length (tokens)"})
    transfer_schedule: str | None = field(default=None, metadata={
        "help": "causal_lm: a length curriculum for attention transfer, 'LEN:STEPS[:BATCH],...' run in order, e.g. "
                "'256:20:4,1024:40:1' (their steps must add up to transfer_steps; BATCH defaults to "
                "transfer_batch_size); default: every step at --context"})
    finetune_schedule: str | None = field(default=None, metadata={
        "help": "causal_lm: the same for fine-tuning (steps add up to finetune_steps, BATCH defaults to batch_size)"})
    max_length: int = field(default=128, metadata={"help": "classification: max tokens per example"})
    eval_context: int = field(default=256, metadata={"help": "causal_lm: perplexity window length"})
    eval_stride: int = field(default=256, metadata={"help": "causal_lm: perplexity window stride"})
    eval_batch_size: int = field(default=8, metadata={"help": "evaluation batch size"})
    eval_before: bool = field(default=True, metadata={"help": "also evaluate right after the swap, before training"})
    eval_contexts: str | None = field(default=None, metadata={
        "help": "causal_lm: long-context evaluation after the last stage: perplexity at these comma-separated "
                "contexts on the same held-out tokens (e.g. 256,1024,2048,4096), beside the baseline rows "
                "(training.long_context); writes output_dir/long_context.{json,md,png}"})
    passkey_lengths: str | None = field(default=None, metadata={
        "help": "causal_lm: passkey retrieval at these comma-separated prompt lengths after the last stage"})
    passkey_depths: int = field(default=10, metadata={"help": "needle depths per passkey length"})
    long_eval_tokens: int = field(default=12288, metadata={"help": "held-out tokens of the long-context evaluation"})
    long_eval_baselines: str = field(default="softmax,streaming", metadata={
        "help": "baseline rows of the long-context evaluation: a comma-separated subset of softmax,streaming, or "
                "none"})
    lm_eval_tasks: str | None = field(default=None, metadata={
        "help": "causal_lm: comma-separated lm-eval tasks scored at every evaluation, besides perplexity (pip "
                "install 'hf_polyattn[eval]'), e.g. polyattn_tinyshakespeare,polyattn_sst2 (shipped, local files) "
                "or any lm-eval task the Hub serves"})
    lm_eval_limit: float | None = field(default=None, metadata={"help": "lm-eval's --limit: documents per task "
                                                                        "(a count, or a fraction below 1)"})
    lm_eval_metadata: str | None = field(default=None, metadata={
        "help": "lm-eval's --metadata, a JSON object, e.g. the shipped tasks' files: "
                '\'{"tinyshakespeare_file": PATH, "sst2_file": PATH}\' (default: ../shared/data beside a checkout)'})
    mixed_precision: str = field(default="no", metadata={"help": "'no' (fp32) or 'bf16'"})
    fsdp: bool = field(default=False, metadata={
        "help": "shard the model across the launched processes with FSDP2 (each decoder layer, then the whole "
                "model): `torchrun --nproc_per_node N` on CPUs (gloo) or GPUs, or `accelerate launch` with an FSDP "
                "config on GPUs (recipes/README.md)"})
    output_dir: str = field(default="runs/retrofit", metadata={"help": "where checkpoints, metrics, model/ go"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0: at the end and on "
                                                         "interruption only)"})
    resume: bool = field(default=True, metadata={"help": "resume from output_dir's checkpoints (--no_resume: start "
                                                         "over, deleting them)"})
    save_model: bool = field(default=True, metadata={"help": "write the Hub-ready folder output_dir/model"})
    push_to_hub: bool = field(default=False, metadata={"help": "push output_dir/model to the Hub"})
    hub_model_id: str | None = field(default=None, metadata={"help": "repo id for --push_to_hub"})
    seed: int = field(default=0, metadata={"help": "seed of data sampling, splits and sketches"})
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)"})
    progress: bool = field(default=True, metadata={"help": "tqdm progress bars"})

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {self.task!r}")
        if self.attention not in attentions():
            raise ValueError(f"attention must be one of {list(attentions())}, got {self.attention!r}")
        if self.text_column is None:
            self.text_column = "text" if self.task == "causal_lm" else "sentence"
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {self.mixed_precision!r}")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id")
        for name in ("window", "feature_proj"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be None (the measured default) or an int >= 0, got {v!r}")
        if self.window and self.attention != "softmax" and "window" not in registry.get_kind(self.attention).fields:
            # silently dropped before: kind='polynomial' is exact everywhere, there is no window to add
            raise ValueError(f"--window {self.window} applies to the kinds with an exact local part; "
                             f"attention={self.attention!r} has none: leave --window 0")
        if self.attn_ce_weight and self.attention != "softmax":
            from ..ops.attention import PolyAttention

            if not issubclass(registry.get_kind(self.attention).module_class(), PolyAttention):
                raise ValueError(f"--attn_ce_weight compares attention weights, which only the kernel kinds write out "
                                 f"(ops.reference_weights); attention={self.attention!r} has none: leave it 0")
        if self.lm_eval_tasks:
            self._check_lm_eval()
        if self.attention == "softmax" and self.transfer_steps:
            raise ValueError("attention='softmax' has nothing to transfer: set --transfer_steps 0")
        if (self.eval_contexts or self.passkey_lengths) and self.task != "causal_lm":
            raise ValueError("eval_contexts / passkey_lengths evaluate a causal LM: task must be 'causal_lm'")
        self.long_context_settings()  # bad lists fail here, before anything loads
        if auto_heads(self.softmax_heads) is not None and self.task != "causal_lm":
            raise ValueError("--softmax_heads auto scores heads on passkey prompts: causal_lm only; pass pairs")
        for stage in ("transfer", "finetune"):
            self.schedule(stage)
        for name in ("transfer_steps", "finetune_steps", "grad_accum", "batch_size", "transfer_batch_size"):
            v = getattr(self, name)
            if v < (1 if name in ("grad_accum", "batch_size", "transfer_batch_size") else 0):
                raise ValueError(f"{name} must be >= {1 if name != 'transfer_steps' else 0}, got {v}")

    def _check_lm_eval(self) -> None:
        if self.task != "causal_lm":
            raise ValueError("--lm_eval_tasks scores causal LMs (lm-eval's hf model): leave it out for "
                             f"task={self.task!r}")
        if self.fsdp:
            raise ValueError("--lm_eval_tasks with --fsdp: lm-eval would run a sharded model in one process; score "
                             "the saved folder instead: hf-polyattn lm-eval --model hf --model_args "
                             "pretrained=OUTPUT_DIR/model --tasks ...")
        if self.lm_eval_metadata is not None:
            try:
                ok = isinstance(json.loads(self.lm_eval_metadata), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise ValueError(f"--lm_eval_metadata must be a JSON object, got {self.lm_eval_metadata!r}")


    def schedule(self, stage: str) -> list[tuple[int, int, int]]:
        """(context, steps, batch size) phases of a stage ('transfer' / 'finetune'), in order."""
        steps = getattr(self, f"{stage}_steps")
        batch = self.transfer_batch_size if stage == "transfer" else self.batch_size
        text = getattr(self, f"{stage}_schedule")
        if not text:
            return [(self.context, steps, batch)]
        if self.task != "causal_lm":
            raise ValueError(f"{stage}_schedule is a length curriculum for causal_lm; task is {self.task!r}")
        phases = []
        for part in text.replace(" ", "").split(","):
            bits = part.split(":")
            try:
                nums = [int(b) for b in bits]
            except ValueError:
                nums = []
            if len(nums) not in (2, 3) or min(nums) < 1 or nums[0] < 2:
                raise ValueError(f"{stage}_schedule must be 'LEN:STEPS[:BATCH],...' with LEN >= 2 and STEPS, BATCH "
                                 f">= 1, got {part!r} in {text!r}")
            phases.append((nums[0], nums[1], nums[2] if len(nums) == 3 else batch))
        if sum(p[1] for p in phases) != steps:
            raise ValueError(f"{stage}_schedule {text!r} has {sum(p[1] for p in phases)} steps, {stage}_steps is "
                             f"{steps}: they must agree")
        return phases

    def long_context_settings(self):
        """The ``LongContextSettings`` of the long-context evaluation, or None when it is off."""
        if not (self.eval_contexts or self.passkey_lengths):
            return None
        from ..eval.long_context import LongContextSettings

        def ints(name: str) -> tuple[int, ...]:
            text = getattr(self, name) or ""
            try:
                return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
            except ValueError:
                raise ValueError(f"{name} must be comma-separated ints, got {text!r}") from None

        baselines = [b for b in self.long_eval_baselines.replace(" ", "").split(",") if b]
        if baselines == ["none"]:
            baselines = []
        if self.attention == "softmax":  # the run's own row is the softmax row
            baselines = [b for b in baselines if b != "softmax"]
        kw = {"contexts": ints("eval_contexts")} if self.eval_contexts else {"contexts": (self.eval_context,)}
        return LongContextSettings(**kw, passkey_lengths=ints("passkey_lengths"), passkey_depths=self.passkey_depths,
                                   max_tokens=self.long_eval_tokens, baselines=tuple(baselines), passkey_seed=self.seed)


# The measured best per task (recipes/results/SECTION_retrofit_window.md, one budget for every row): SmolLM2 at
# context 256: 128-token window 1.33x softmax's perplexity -> 1.21x with the projection (block-diagonal blocks
# 4.58x); MiniLM / SST-2: a 16-token bidirectional window kept 99.8-101.3% of softmax accuracy.
RECOMMENDED_WINDOW = {"causal_lm": 128, "classification": 16}
# and for a causal LM with a window, the measured best at long context (SECTION_long_context.md, SmolLM2-135M judged
# at 256 ... 8,192 tokens): 4 sink tokens (the window without them is 2x worse already at 256), a gated decay of the
# kernel state (at 8k 378 against 756 without, transfer at 1k) and the kernel part starting nearly off
# (window_mix_init 0.01: from 1, 30 transfer steps left per-layer MSE 0.046, worse than the window alone's 0.0068;
# from 0.01, 0.0037). Each applies where the kind reads it and the run does not set it.
RECOMMENDED_LONG_CONTEXT = {"sinks": 4, "decay": "gate", "window_mix": True, "window_mix_init": 0.01}
# the gated decay's horizon where one measured better than PolyAttnConfig's 1,024: polysketch at 256 (the
# recommended row's 8k perplexity 33.9 -> 29.7, 4k 29.6 -> 29.0: its state saturates inside the 1k training length,
# so longer contexts add no unseen kernel mass); linear (measured with elu features) at 256 too: the recommended
# row 27.08 -> 26.97 at 8k, passkey 9/10/10 -> 10/10/10, on held-out license texts 1.17x -> 1.10x softmax at 8k
# (SECTION_long_context.md). The other kinds keep 1,024 (not measured).
RECOMMENDED_DECAY_HORIZON = {"polysketch": 256.0, "linear": 256.0}


def resolved_window_and_projection(a: RetrofitArgs, model_config=None) -> tuple[int, int]:
    """(window, feature_proj) of a run: the explicit values, else the measured best for the task.

    The model's head size is needed only when the default projection applies (causal_lm): read
    from ``model_config`` when the caller has it loaded, else from the checkpoint's config
    (``resolve_checkpoint`` + ``AutoConfig``: no weights are loaded).
    """
    if a.attention == "softmax":
        return a.window or 0, a.feature_proj or 0
    reads = registry.get_kind(a.attention).fields
    if "window" not in reads:  # exact everywhere (polynomial), or no window at all
        return a.window or 0, a.feature_proj or 0
    window = RECOMMENDED_WINDOW[a.task] if a.window is None else a.window
    if "feature_proj" not in reads:  # the window alone (sliding_window): no kernel part to project
        return window, a.feature_proj or 0
    proj = a.feature_proj
    if proj is None:
        proj = 0
        if a.task == "causal_lm":
            if model_config is None:
                from transformers import AutoConfig

                model_config = AutoConfig.from_pretrained(resolve_checkpoint(a.model))
            proj = _config_head_dim(model_config, a.model)
    return window, proj


def _config_head_dim(cfg, model: str) -> int:
    """The head size a transformers config declares (head_dim, or hidden size / heads)."""
    if getattr(cfg, "head_dim", None):
        return int(cfg.head_dim)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not hidden or not heads:
        raise CheckpointError(f"cannot tell the head dimension of {model!r}: pass --feature_proj (0 = off)")
    return int(hidden) // int(heads)


def polyattn_config_from_args(a: RetrofitArgs, model_config=None) -> PolyAttnConfig | None:
    if a.attention == "softmax":
        return None
    window, proj = resolved_window_and_projection(a, model_config)
    reads = registry.get_kind(a.attention).fields
    # the recipe's options a kind reads (KindSpec.fields); a sliding window is the other form of the
    # exact local part: it replaces the blocks
    given = {"degree": a.degree, "block_size": a.block_size, "qk_norm": a.qk_norm, "sketch": a.sketch,
             "sketch_size": a.sketch_size, "feature_map": a.feature_map, "num_features": a.num_features,
             "local_exact": a.local_exact and not window, "local_kernel": a.local_kernel, "window": window,
             "feature_proj": proj}
    d: dict[str, Any] = {"kind": a.attention, "seed": a.seed}
    d.update({name: value for name, value in given.items() if name in reads})
    # set only when given: a kind that does not read one refuses it by name (PolyAttnConfig)
    if a.task == "causal_lm" and window:
        d.update({name: value for name, value in RECOMMENDED_LONG_CONTEXT.items() if name in reads})
        if a.attention in RECOMMENDED_DECAY_HORIZON and "decay_horizon" in reads:
            d["decay_horizon"] = RECOMMENDED_DECAY_HORIZON[a.attention]
    d.update({name: getattr(a, name) for name in ("sinks", "learned_sinks", "decay", "decay_horizon")
              if getattr(a, name) is not None})
    if a.softmax_heads and auto_heads(a.softmax_heads) is None:  # 'auto' is scored on the model (_load_model)
        from ..eval.heads import parse_head_pairs

        d["softmax_heads"] = parse_head_pairs(a.softmax_heads)
    if "window" in reads and "local_exact" not in reads and not window:  # the window alone: it cannot be off
        del d["window"]
    given_json = json.loads(a.polyattn_json) if a.polyattn_json else {}
    d.update(given_json)
    if not d.get("window_mix") and "window_mix_init" not in given_json:  # window_mix turned off: no default init
        d.pop("window_mix_init", None)
    given_horizon = a.decay_horizon is not None or "decay_horizon" in given_json
    if d.get("decay", "none") == "none" and not given_horizon:  # decay turned off: no default horizon
        d.pop("decay_horizon", None)
    return PolyAttnConfig.from_dict(d)


# --softmax_heads auto: the retrieval scores of the loaded checkpoint on AUTO_PROMPTS passkey prompts of AUTO_LENGTH
# tokens (training.heads.score_heads, seed AUTO_SEED: not the long-context evaluation's keys, which use --seed).
# SmolLM2-135M: 4 prompts of 1,024 tokens chose 21 of the 22 heads that 8 prompts of 2,048 chose, in 38 s of one
# CPU thread instead of 8 minutes (recipes/results/long_context/head_scores_smollm2.json).
AUTO_PROMPTS, AUTO_LENGTH, AUTO_SEED = 4, 1024, 1


def auto_heads(text: str | None) -> float | int | None:
    """'auto' -> 0.25 (a quarter of the kv heads), 'auto:K' -> K heads, anything else -> None."""
    if not text or not text.strip().startswith("auto"):
        return None
    head, _, k = text.strip().partition(":")
    if head != "auto" or (k and not k.isdigit()):
        raise ValueError(f"softmax_heads must be 'auto', 'auto:K' (K kv heads), pairs or @scores.json, got {text!r}")
    return int(k) if k else 0.25


def _settings(a: RetrofitArgs) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote output_dir."""
    cfg = polyattn_config_from_args(a)
    return {
        "model": a.model, "task": a.task, "data": a.data, "attention": cfg.to_dict() if cfg else "softmax",
        "seed": a.seed, "context": a.context, "max_length": a.max_length, "lora": a.lora, "lora_r": a.lora_r,
        "transfer_lr": a.transfer_lr, "transfer_batch_size": a.transfer_batch_size, "finetune_lr": a.finetune_lr,
        "batch_size": a.batch_size, "grad_accum": a.grad_accum, "attn_ce_weight": a.attn_ce_weight,
        "transfer_schedule": a.transfer_schedule, "finetune_schedule": a.finetune_schedule,
        "fsdp": a.fsdp,  # sharded checkpoints hold the optimizer state keyed by names, DDP's by position
    }


class Retrofit:
    """State of one pipeline run; ``prepare()`` does every check, the stage methods train/evaluate."""

    def __init__(self, args: RetrofitArgs, accelerator=None):
        from accelerate import Accelerator

        self.args = args
        if args.threads:
            torch.set_num_threads(args.threads)
        sharding.check_before_accelerator(args.fsdp)
        # cpu=True without CUDA: otherwise a `--multi_gpu` launch on a CPU machine gives two unconnected processes
        self.acc = accelerator or Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available())
        self.peft = None  # the LoRA wrapper, when adapters were added before sharding (_shard)
        self.out = Path(args.output_dir)
        self.results: dict[str, Any] = {"args": asdict(args), "evaluations": {}, "stages": {}}
        self.cpu0, self.wall0 = time.process_time(), time.time()

    # ------------------------------------------------------------------ checks + loading
    def log(self, msg: str) -> None:
        if self.acc.is_main_process:
            print(msg, flush=True)

    def prepare(self) -> Retrofit:
        a = self.args
        from transformers import AutoConfig, AutoTokenizer

        # 0. processes: a launch that would train unconnected or unsharded copies -> LaunchError
        self.results["distributed"] = sharding.check_launch(self.acc, a.fsdp)
        # 1. data (missing file / column / unreachable dataset id -> DataError)
        # 2. model (unreachable id / unsupported architecture -> CheckpointError)
        path = resolve_checkpoint(a.model)
        mcfg = AutoConfig.from_pretrained(path)
        check_supported(mcfg)
        self.model_path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if not a.data:
            raise DataError("data is required: a local .txt/.csv/.tsv file or a Hub dataset id (--data ...)")
        if a.task == "causal_lm":
            self.data = load_text_data(a.data, self.tokenizer, eval_fraction=a.eval_fraction,
                                       text_column=a.text_column, max_eval_tokens=a.max_eval_tokens)
            longest = max(p[0] for stage in ("transfer", "finetune") for p in a.schedule(stage))
            if self.data.train_ids.numel() <= longest:
                raise DataError(f"{a.data!r} has {self.data.train_ids.numel()} training tokens, need > {longest}")
        else:
            self.data = load_classification_data(a.data, text_column=a.text_column, label_column=a.label_column,
                                                  num_eval=a.num_eval, seed=a.seed)
        self.results["data"] = self.data.describe()
        self._warn_if_window_covers_context()
        # 3. a checkpoint of another run in output_dir -> IncompatibleCheckpointError
        settings = _settings(a)
        rc = self.out / "run_config.json"
        if rc.exists() and a.resume:
            old = json.loads(rc.read_text())
            diffs = [f"{k}: {old.get(k)!r} there, {settings.get(k)!r} here" for k in sorted(set(old) | set(settings))
                     if old.get(k) != settings.get(k)]
            if diffs:
                raise IncompatibleCheckpointError(
                    f"{self.out} holds a run with other settings ({'; '.join(diffs)}); "
                    "use another --output_dir or --no_resume"
                )
        if self.acc.is_main_process:
            if not a.resume:
                import shutil

                for p in self.out.glob("checkpoint-*"):
                    shutil.rmtree(p)
            self.out.mkdir(parents=True, exist_ok=True)
            rc.write_text(json.dumps(settings, indent=2))
        self.acc.wait_for_everyone()
        self.settings = settings
        self.model_config = mcfg
        self.model = self._load_model(path, mcfg)
        if a.fsdp:
            self._shard()
        return self

    def _load_model(self, path: str, mcfg):
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        a = self.args
        # Attention-probability dropout has no linear-time equivalent (no n x n weights exist), so the polyattn
        # kinds refuse it in training; it is switched off for every run, softmax included, to keep the
        # comparison like for like (MiniLM/BERT: attention_probs_dropout_prob 0.1, GPT-2: attn_pdrop 0.1).
        kw = {k: 0.0 for k in ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
              if float(getattr(mcfg, k, 0.0) or 0.0) > 0}
        self.results["attention_dropout_disabled"] = sorted(kw)
        if a.task == "causal_lm":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
        else:
            num_labels = self.data.num_labels
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels,
                                                                       dtype=torch.float32, **kw)
            if model.config.pad_token_id is None:
                model.config.pad_token_id = self.tokenizer.pad_token_id
        pcfg = polyattn_config_from_args(a, mcfg)
        from ..integration.layout import layer_layout

        existing = _converted_kind(model)
        if existing is not None:
            # a folder written by this pipeline / hf_polyattn.convert + save_pretrained: already swapped
            if a.attention != existing:
                raise CheckpointError(f"{path!r} was converted to attention {existing!r}; pass --attention {existing}")
            saved = getattr(model.config, "polyattn", None)
            self.pcfg = PolyAttnConfig.from_dict(saved) if isinstance(saved, dict) else pcfg
            self.results["layer_layout"] = layer_layout(model)  # which layers run the kind (sliding ones stay exact)
            return self._placed(model)
        if pcfg is not None:
            import hf_polyattn

            if not hasattr(hf_polyattn, "convert"):
                raise CheckpointError("hf_polyattn.convert is not available (integration layer missing)")
            if auto_heads(a.softmax_heads) is not None:
                pcfg = pcfg.replace(softmax_heads=self._score_heads(model, auto_heads(a.softmax_heads),
                                                                    pcfg.sliding_layers))
            model = hf_polyattn.convert(model, pcfg) or model
            self.results["layer_layout"] = layer_layout(model)
        self.pcfg = pcfg
        return self._placed(model)

    def _score_heads(self, model, k: float | int, sliding_layers: str = "exact") -> tuple[tuple[int, int], ...]:
        """--softmax_heads auto: the top ``k`` kv heads (a fraction: of all) of the softmax ``model`` by retrieval
        score (``training.heads.score_heads``); the scores go to results.json."""
        from ..eval.heads import score_heads, select_heads

        t0 = time.time()
        limit = getattr(model.config, "max_position_embeddings", None) or AUTO_LENGTH
        scores = score_heads(model, self.tokenizer, num_prompts=AUTO_PROMPTS, length=min(AUTO_LENGTH, limit),
                             seed=AUTO_SEED, sliding_layers=sliding_layers)
        total = scores.candidate_heads  # the converted layers' kv heads (sliding layers kept exact are not)
        count = round(total * k) if isinstance(k, float) else k
        if count > total:
            raise ValueError(f"--softmax_heads auto:{count}: the model has {total} kv heads")
        pairs = tuple(sorted(select_heads(scores, count)))
        self.results["head_scores"] = {**scores.to_dict(), "selected": [list(p) for p in pairs],
                                       "wall_s": round(time.time() - t0, 1)}
        self.log(f"[softmax heads] {count} of {total} kv heads by retrieval score: "
                 + ", ".join(f"{layer}:{head}" for layer, head in pairs))
        return pairs

    def _warn_if_window_covers_context(self) -> None:
        """Training sequences no longer than the window: the kernel part never sees a key, so attention transfer
        has nothing to fit (its loss is the window's own, ~0) and fine-tuning leaves the kernel untouched. Legal
        (the parameters get zero gradients: ops/window.py), but the run is then a softmax-window model."""
        a = self.args
        cfg = polyattn_config_from_args(a) if a.attention != "softmax" else None
        longest = a.context if a.task == "causal_lm" else a.max_length
        if cfg is not None and cfg.window and longest <= cfg.window:
            msg = (f"every training sequence ({'--context' if a.task == 'causal_lm' else '--max_length'} {longest}) "
                   f"fits in the window ({cfg.window}): the {a.attention} kernel part is never used in training")
            self.results.setdefault("warnings", []).append(msg)
            self.log(f"warning: {msg}")

    def _placed(self, model):
        # sharded runs leave the model where it was loaded: fully_shard moves each group to the device as it
        # shards it, so a GPU never holds the whole model
        return model if self.args.fsdp else model.to(self.acc.device)

    # ------------------------------------------------------------------ sharding (FSDP2, sharding.py)
    def _add_lora(self, model):
        """PEFT LoRA adapters on the attention projections, initialised from the run's seed (the same adapters
        whether they are added before sharding or at fine-tuning)."""
        from peft import LoraConfig, get_peft_model

        a = self.args
        task_type = "CAUSAL_LM" if a.task == "causal_lm" else "SEQ_CLS"
        config = LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, target_modules=_lora_targets(model),
                            task_type=task_type, lora_dropout=0.0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(a.seed)
            return get_peft_model(model, config)

    def _shard(self) -> None:
        """FSDP2 over the launched processes. LoRA adapters are added first when fine-tuning will use them:
        fully_shard groups the parameters that exist when it runs, and adapters added to a sharded model would
        be neither sharded nor synchronised. They start as zero (LoRA's B = 0), so the transfer stage and the
        evaluations before fine-tuning see the model unchanged."""
        a = self.args
        if a.lora and a.finetune_steps:
            self.peft = self._add_lora(self.model)
        replicated = [(n, p) for n, p in self.model.named_parameters() if ".polyattn." in n]
        info = sharding.shard(self.model, self.acc.device, replicated=replicated)
        self.results["distributed"].update(info)
        self.log(f"[fsdp] {self.acc.num_processes} processes, sharded units {info['fsdp_units']}")

    def _unsharded(self, state: dict[str, torch.Tensor]):
        """A whole, unsharded copy of the trained model built on this process from the gathered state dict,
        LoRA merged: what save_pretrained writes."""
        copy = self._load_model(self.model_path, self.model_config)
        target = self._add_lora(copy) if self.peft is not None else copy
        missing, unexpected = target.load_state_dict(state, strict=False)
        missing = sorted(k for k in missing if not _is_tied(target, k))
        if missing or unexpected:
            raise RuntimeError(f"the gathered checkpoint does not fit the model: missing {missing}, "
                               f"unexpected {sorted(unexpected)}")
        return target.merge_and_unload() if self.peft is not None else target

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tag: str) -> dict[str, Any]:
        a = self.args
        t0, c0 = time.time(), time.process_time()
        model = self.acc.unwrap_model(self.model)
        if a.task == "causal_lm":
            r = perplexity(model, self.data.eval_ids, context=a.eval_context, stride=a.eval_stride,
                           batch_size=a.eval_batch_size, progress=a.progress and self.acc.is_main_process,
                           desc=f"eval {tag}")
        else:
            n = len(self.data.eval)
            batches = (classification_batch(self.data, self.tokenizer, batch_size=a.eval_batch_size,
                                            max_length=a.max_length, seed=a.seed, step=0, split="eval",
                                            indices=list(range(i, min(n, i + a.eval_batch_size))))
                       for i in range(0, n, a.eval_batch_size))
            r = accuracy(model, batches, progress=a.progress and self.acc.is_main_process, desc=f"eval {tag}")
        if a.lm_eval_tasks:
            r["lm_eval"] = self._lm_eval(model, tag)
        r["wall_s"], r["cpu_s"] = round(time.time() - t0, 1), round(time.process_time() - c0, 1)
        self.results["evaluations"][tag] = r
        main = "perplexity" if a.task == "causal_lm" else "accuracy"
        self.log(f"[eval {tag}] {main} = {r[main]:.4f}")
        return r

    def evaluate_long_context(self) -> dict[str, Any]:
        """Perplexity at every context and passkey retrieval of the final model beside the baseline rows
        (``training.long_context``); written to output_dir/long_context.{json,md,png} and into results.json."""
        from transformers import AutoModelForCausalLM

        from ..eval.compare import attention_label
        from ..eval.long_context import evaluate_rows, long_context_markdown, write_long_context

        a = self.args
        settings = a.long_context_settings()
        if self.data.eval_ids.numel() < settings.max_tokens:
            # load_text_data capped the stream at max_eval_tokens: read the held-out tail again, longer
            self.long_ids = load_text_data(a.data, self.tokenizer, eval_fraction=a.eval_fraction,
                                           text_column=a.text_column, max_eval_tokens=settings.max_tokens).eval_ids
        else:
            self.long_ids = self.data.eval_ids
        model = self.acc.unwrap_model(self.model)
        label = attention_label(a.attention, self.pcfg.to_dict() if self.pcfg else None)

        def load_base():
            return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.acc.device)

        result = evaluate_rows(model, self.tokenizer, self.long_ids, settings, label=label, load_base=load_base,
                               progress=a.progress and self.acc.is_main_process, log=self.log)
        if self.acc.is_main_process:
            write_long_context(result, self.out)
            self.log(long_context_markdown(result))
        self.results["long_context"] = result
        return result

    def _lm_eval(self, model, tag: str) -> dict[str, dict[str, float]] | None:
        """--lm_eval_tasks on the current model, in the main process (the others wait), windows of eval_context."""
        from ..eval import harness

        a = self.args
        scores = None
        if self.acc.is_main_process:
            tasks = [t.strip() for t in a.lm_eval_tasks.split(",") if t.strip()]
            scores = harness.evaluate(model, self.tokenizer, tasks, limit=a.lm_eval_limit,
                                      batch_size=a.eval_batch_size, max_length=a.eval_context,
                                      metadata=json.loads(a.lm_eval_metadata or "{}"))
            for task, values in scores.items():
                metric, value = harness.main_metric(values)
                self.log(f"[eval {tag}] lm-eval {task} {metric} = {value:.4f}")
        self.acc.wait_for_everyone()
        return scores

    # ------------------------------------------------------------------ stages
    def _batch_fn(self, stage: str):
        a = self.args
        phases = a.schedule(stage)
        world = self.acc.num_processes  # each rank its slice of the global batch (data._global_draw)
        if a.task == "causal_lm":
            ids = self.data.train_ids

            def lm(step, micro, rank):
                # the phase of this step (a pure function of the step, so a resumed run draws the same batches)
                end, phase = 0, phases[-1]
                for p in phases:
                    end += p[1]
                    if step < end:
                        phase = p
                        break
                return lm_batch(ids, batch_size=phase[2], context=phase[0], seed=a.seed, step=step, micro=micro,
                                rank=rank, world=world)

            return lm
        batch_size = phases[0][2]
        return lambda step, micro, rank: classification_batch(
            self.data, self.tokenizer, batch_size=batch_size, max_length=a.max_length, seed=a.seed, step=step,
            micro=micro, rank=rank, world=world)

    def transfer(self) -> dict[str, Any]:
        a = self.args
        model = self.model
        with distillation(model, attn_ce_weight=a.attn_ce_weight) as coll:
            params = polyattn_parameters(model)
            if a.fsdp:  # every forward through the FSDP root: the whole model, the head on one position only
                base, extra = model, ({"logits_to_keep": 1} if a.task == "causal_lm" else {})
            else:
                base, extra = self.acc.prepare(model.base_model), {}
            cfg = LoopConfig(output_dir=str(self.out), max_steps=a.transfer_steps, lr=a.transfer_lr,
                             warmup_steps=a.warmup_steps, schedule="cosine", grad_accum=1,
                             save_every=a.save_every, resume=a.resume, desc="transfer", progress=a.progress)
            fp = fingerprint_of(params, stage="transfer", **{k: v for k, v in self.settings.items()})
            summary = train_loop(self.acc, base, params, self._batch_fn("transfer"),
                                 lambda m, b: transfer_loss(m, b, coll, **extra), cfg, fp)
        self.results["stages"]["transfer"] = {k: v for k, v in summary.items() if k != "history"}
        return summary

    def finetune(self) -> dict[str, Any]:
        a = self.args
        model = self.model
        if a.lora:
            model = self.peft if self.peft is not None else self._add_lora(model)
            for n, p in model.named_parameters():  # the retrofitted attention keeps training under LoRA
                if ".polyattn." in n:
                    p.requires_grad_(True)
        else:
            for p in model.parameters():
                p.requires_grad_(True)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        poly = [p for n, p in params if ".polyattn." in n]
        rest = [p for n, p in params if ".polyattn." not in n]
        cfg = LoopConfig(output_dir=str(self.out), max_steps=a.finetune_steps, lr=a.finetune_lr,
                         warmup_steps=a.warmup_steps, schedule="cosine", grad_accum=a.grad_accum,
                         save_every=a.save_every, resume=a.resume, desc="finetune", progress=a.progress)
        fp = fingerprint_of(params, stage="finetune", **self.settings)
        wrapped = model if a.fsdp else self.acc.prepare(model)
        summary = train_loop(self.acc, wrapped, params, self._batch_fn("finetune"),
                             lambda m, b: m(**b).loss, cfg, fp,
                             param_groups=_groups(rest, poly, a.finetune_lr, a.polyattn_lr))
        if a.lora and not a.fsdp:  # sharded: merged in the whole copy that save() writes (_unsharded)
            model = self.acc.unwrap_model(wrapped).merge_and_unload()
        self.model = model
        self.results["stages"]["finetune"] = {k: v for k, v in summary.items() if k != "history"}
        return summary

    def close(self) -> None:
        """Ends the run: the processes meet and the process group goes (``finish_run``)."""
        finish_run(self.acc)

    # ------------------------------------------------------------------ outputs
    def save(self) -> Path | None:
        a = self.args
        self.results["total_cpu_s"] = round(time.process_time() - self.cpu0, 1)
        self.results["total_wall_s"] = round(time.time() - self.wall0, 1)
        self.results["polyattn"] = self.pcfg.to_dict() if self.pcfg else None
        self.results["machine"] = machine.summary()
        target = None
        # sharded: every process gives its shards (collective); the main process saves one whole checkpoint
        gathered = sharding.full_state_dict(self.model) if a.fsdp and a.save_model else None
        if self.acc.is_main_process:
            (self.out / "results.json").write_text(json.dumps(self.results, indent=2))
            if a.save_model:
                from ..eval.card import eval_results_for_card, write_card

                target = self.out / "model"
                model = self._unsharded(gathered) if a.fsdp else self.acc.unwrap_model(self.model)
                if self.pcfg is not None:  # hf_polyattn's save_pretrained also writes the model card
                    model.save_pretrained(target, eval_results=eval_results_for_card(self.results))
                else:
                    model.save_pretrained(target)
                self.tokenizer.save_pretrained(target)
                write_card(target, self.results, model_path=self.model_path)
                if a.push_to_hub:
                    from huggingface_hub import HfApi

                    api = HfApi()
                    api.create_repo(a.hub_model_id, exist_ok=True)
                    api.upload_folder(folder_path=str(target), repo_id=a.hub_model_id)
                    self.log(f"pushed {target} to https://huggingface.co/{a.hub_model_id}")
        self.acc.wait_for_everyone()
        return target


def _converted_kind(model) -> str | None:
    """The attention kind of an already converted model (it carries polyattn submodules), else None."""
    for m in model.modules():
        poly = getattr(m, "polyattn", None)
        if poly is not None and hasattr(poly, "config"):
            return poly.config.kind
    return None


def _groups(rest, poly, lr, poly_lr):
    groups = []
    if rest:
        groups.append({"params": rest, "lr": lr})
    if poly:
        groups.append({"params": poly, "lr": poly_lr if poly_lr is not None else lr})
    return groups


def _is_tied(model, key: str) -> bool:
    """Whether parameter ``key`` shares its storage with another parameter of ``model`` (a tied head): a state
    dict may hold it under the other name only."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return False
    ptr = params[key].data_ptr()
    return any(n != key and p.data_ptr() == ptr for n, p in params.items())


def _lora_targets(model) -> list[str]:
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for cand in (["q_proj", "k_proj", "v_proj", "o_proj"], ["query", "key", "value"], ["c_attn", "c_proj"]):
        if set(cand) <= names:
            return cand
    raise CheckpointError(f"no known attention projection names for LoRA among {sorted(names)}")


def run(args: RetrofitArgs) -> dict[str, Any]:
    """The whole pipeline; returns the results dict (also written to output_dir/results.json)."""
    r = Retrofit(args).prepare()
    if args.eval_before:
        r.evaluate("before" if args.attention == "softmax" else "swapped")
    if args.transfer_steps:
        r.transfer()
        r.evaluate("after_transfer")
    if args.finetune_steps:
        r.finetune()
        r.evaluate("after_finetune")
    if args.long_context_settings() is not None:
        r.evaluate_long_context()
    r.save()
    r.close()
    return r.results
