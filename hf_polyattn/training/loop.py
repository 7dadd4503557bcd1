"""One small training loop shared by attention transfer and fine-tuning.

* Batches are a pure function of the step (``batch_fn(step, micro, rank)``), so resuming needs
  no sampler state; each rank of a multi-process run takes its reproducible slice of one global batch
  (``data.lm_batch``'s ``world``).
* Gradient accumulation over ``grad_accum`` micro-batches (no DDP all-reduce until the last).
* Checkpoints hold only what training changes (trainable parameters, optimizer, scheduler, step,
  loss history) and a *fingerprint* of the run. Resuming checks the fingerprint first, so a
  checkpoint of another model / attention kind / trainable set fails with a clear message before
  any step is taken. A checkpoint is also written when the run is interrupted (Ctrl-C, SIGTERM),
  so an interrupted run resumes at the step it reached.
* A metrics JSON (loss history, wall and CPU time) and a loss plot PNG per run.
* A model sharded with FSDP2 (``sharding.py``) trains the same way: gradient sync, clipping and checkpoints
  (whole tensors, gathered from every process) go through ``sharding``; accelerate never wraps it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import sharding

__all__ = ["IncompatibleCheckpointError", "LoopConfig", "fingerprint_of", "plot_losses", "train_loop"]

CKPT_DIR = "checkpoint"
STATE_FILE = "trainer_state.pt"
META_FILE = "trainer_state.json"


class IncompatibleCheckpointError(ValueError):
    """The checkpoint in output_dir belongs to a different run."""


@dataclass
class LoopConfig:
    output_dir: str
    max_steps: int
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"  # "cosine" | "constant"
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    save_every: int = 0  # 0: only at the end / on interruption
    log_every: int = 1
    resume: bool = True
    desc: str = "train"
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def fingerprint_of(params: list[tuple[str, torch.nn.Parameter]], **settings: Any) -> dict[str, Any]:
    """What must match for a checkpoint to be resumable: settings + names/shapes of the trained params."""
    h = hashlib.sha256()
    for n, p in params:
        h.update(f"{n}:{tuple(p.shape)};".encode())
    return {**{k: settings[k] for k in sorted(settings)}, "trainable": h.hexdigest()[:16],
            "num_trainable": int(sum(p.numel() for _, p in params))}


def _lr_lambda(cfg: LoopConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        t = min(1.0, (step - cfg.warmup_steps) / span)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


def _diff(a: dict, b: dict) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [f"{k}: checkpoint={a.get(k)!r}, this run={b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def plot_losses(history: list[dict[str, Any]], path: str | os.PathLike, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_loop(
    accelerator,
    model: torch.nn.Module,
    params: list[tuple[str, torch.nn.Parameter]],
    batch_fn: Callable[[int, int, int], dict[str, torch.Tensor]],
    loss_fn: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    cfg: LoopConfig,
    fingerprint: dict[str, Any],
    param_groups: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train ``params`` of ``model`` (already ``accelerator.prepare``-d) for ``cfg.max_steps`` steps.

    Returns the run summary (also written to ``output_dir/<desc>_metrics.json``).
    """
    if not params:
        raise ValueError("nothing to train: no parameter requires grad")
    out = Path(cfg.output_dir)
    ckpt = out / f"{CKPT_DIR}-{cfg.desc}"
    sharded = sharding.is_sharded(model)
    opt = torch.optim.AdamW(param_groups or [p for _, p in params], lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    start_step, history = 0, []
    cpu_before, wall_before = 0.0, 0.0
    if cfg.resume and (ckpt / META_FILE).exists():
        meta = json.loads((ckpt / META_FILE).read_text())
        diffs = _diff(meta["fingerprint"], fingerprint)
        if diffs:
            raise IncompatibleCheckpointError(
                f"cannot resume from {ckpt}: it was written by a different run ({'; '.join(diffs)}). "
                "Use another --output_dir or --no_resume to start over."
            )
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
        by_name = dict(params)
        if set(state["params"]) != set(by_name):
            raise IncompatibleCheckpointError(f"cannot resume from {ckpt}: trainable parameter names differ")
        for n, t in state["params"].items():
            if by_name[n].shape != t.shape:
                raise IncompatibleCheckpointError(
                    f"cannot resume from {ckpt}: {n} has shape {tuple(t.shape)} there, {tuple(by_name[n].shape)} here"
                )
        if sharded:  # every process keeps its shard of the whole tensors the checkpoint holds
            sharding.load_full_tensors(params, state["params"])
            sharding.load_optimizer_state(model, opt, state["optimizer"])
        else:
            with torch.no_grad():
                for n, t in state["params"].items():
                    by_name[n].copy_(t)
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start_step, history = state["step"], state["history"]
        cpu_before, wall_before = state.get("cpu_s", 0.0), state.get("wall_s", 0.0)
        if accelerator.is_main_process:
            print(f"[{cfg.desc}] resumed from {ckpt} at step {start_step}")
    # Every process has read the checkpoint (or seen none) before any process can write one. Without this meeting
    # the main process, with nothing left to train and no collective in its save (a stage that trains only the
    # parameters kept whole), replaced the folder while a slower process was still about to look for it: that process
    # saw no checkpoint, started from step 0 and waited in a forward's all-gather that never came (a 300 s hang of
    # the FSDP resume test in CI).
    accelerator.wait_for_everyone()

    cpu0, wall0 = time.process_time(), time.time()

    def save(step: int) -> None:
        if sharded:  # collective: every process gives its shards, the main process writes whole tensors
            tensors, optimizer = sharding.full_tensors(params), sharding.optimizer_state(model, opt)
        elif accelerator.is_main_process:
            tensors, optimizer = {n: p.detach().cpu().clone() for n, p in params}, opt.state_dict()
        if not accelerator.is_main_process:
            return
        tmp = out / f"{CKPT_DIR}-{cfg.desc}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        torch.save({
            "params": tensors,
            "optimizer": optimizer,
            "scheduler": sched.state_dict(),
            "step": step,
            "history": history,
            "cpu_s": cpu_before + time.process_time() - cpu0,
            "wall_s": wall_before + time.time() - wall0,
        }, tmp / STATE_FILE)
        (tmp / META_FILE).write_text(json.dumps({"step": step, "fingerprint": fingerprint}, indent=2))
        if ckpt.exists():
            shutil.rmtree(ckpt)
        os.replace(tmp, ckpt)

    bar = None
    if cfg.progress and accelerator.is_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=start_step, desc=cfg.desc, unit="step")
    rank = accelerator.process_index
    step = start_step
    interrupted = {"flag": False}
    old_handler = None
    if accelerator.is_main_process and hasattr(signal, "SIGTERM"):
        def on_term(signum, frame):
            interrupted["flag"] = True
        try:
            old_handler = signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread
            old_handler = None
    model.train()
    try:
        while step < cfg.max_steps:
            if interrupted["flag"]:
                raise KeyboardInterrupt
            total = 0.0
            for micro in range(cfg.grad_accum):
                batch = {k: v.to(accelerator.device) for k, v in batch_fn(step, micro, rank).items()}
                sync = micro == cfg.grad_accum - 1
                if sharded:
                    sharding.set_gradient_sync(model, sync)
                ctx = (accelerator.no_sync(model) if not sync and accelerator.num_processes > 1 and not sharded
                       else _null())
                with ctx, accelerator.autocast():
                    loss = loss_fn(model, batch) / cfg.grad_accum
                with ctx:
                    accelerator.backward(loss)
                total += loss.detach().float().item()
            if sharded:
                sharding.sync_replicated_grads(model)
            if cfg.max_grad_norm:
                clip = sharding.clip_grad_norm_ if sharded else accelerator.clip_grad_norm_
                clip([p for _, p in params], cfg.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            loss_val = accelerator.reduce(torch.tensor(total, device=accelerator.device), "mean").item()
            if not math.isfinite(loss_val):
                raise FloatingPointError(f"[{cfg.desc}] loss is {loss_val} at step {step}")
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                history.append({"step": step, "loss": loss_val, "lr": sched.get_last_lr()[0],
                                "cpu_s": round(cpu_before + time.process_time() - cpu0, 2)})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_val:.4g}")
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
                save(step)
    except KeyboardInterrupt:
        save(step)
        if accelerator.is_main_process:
            print(f"\n[{cfg.desc}] interrupted: checkpoint at step {step} in {ckpt}; rerun to resume")
        if interrupted["flag"]:
            raise SystemExit(143) from None  # SIGTERM: exit non-zero so wrappers see the run did not finish
        raise
    finally:
        if bar is not None:
            bar.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    save(step)
    accelerator.wait_for_everyone()
    summary = {
        "stage": cfg.desc,
        "steps": step,
        "resumed_from": start_step,
        "final_loss": history[-1]["loss"] if history else None,
        "cpu_s": round(cpu_before + time.process_time() - cpu0, 1),
        "wall_s": round(wall_before + time.time() - wall0, 1),
        "num_processes": accelerator.num_processes,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("extra",)},
        "fingerprint": fingerprint,
        "history": history,
        **cfg.extra,
    }
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{cfg.desc}_metrics.json").write_text(json.dumps(summary, indent=2))
        plot_losses(history, out / f"{cfg.desc}_loss.png", f"{cfg.desc} loss")
    return summary


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def finish_run(accelerator) -> None:
    """Ends a (distributed) run while the interpreter is whole: the processes meet, the DDP wrappers accelerate keeps
    (they hold the gloo process group) are dropped and collected, then the group is destroyed. Left to the
    interpreter's exit, gloo's worker threads aborted a finished 2-process run now and then ("terminate called
    without an active exception", exit -6): 1 of 9 runs with no teardown, and 1 CI run with the group destroyed
    while the wrappers lived on."""
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()
