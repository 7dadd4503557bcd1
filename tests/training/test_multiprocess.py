import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_polyattn.training.loop import CKPT_DIR, META_FILE
from tests.conftest import cpu_env

from .fsdp_worker import argv

ROOT = Path(__file__).resolve().parents[2]


def _launch(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env={**cpu_env(), **env}, capture_output=True, text=True, timeout=300)


def _torchrun(port: int, *args, **env: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m hf_polyattn.retrofit` with the worker's command line for ``args``."""
    return _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(port), "-m", "hf_polyattn.retrofit", *argv(*args)], **env)


# a sitecustomize that holds the main process between removing a checkpoint and moving the new one in, and the other
# process before it looks for that checkpoint (its docstring): a resume that does not wait for every process to read
# the checkpoint before saving hangs
SLOW_RESUME = {"PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parent / "slow_resume"),
                                                           os.environ.get("PYTHONPATH")) if p),
               "HF_POLYATTN_TEST_SLOW_RESUME": f"{CKPT_DIR}-transfer/{META_FILE}"}


def _losses(folder: Path, stage: str) -> list[float]:
    return [h["loss"] for h in json.loads((folder / f"{stage}_metrics.json").read_text())["history"]]


DDP_MODES = ["full", "two_stage", "hybrid", "window_covers"]


@pytest.mark.slow(seconds=32)
def test_two_process_ddp_ranks_agree(tiny_dirs, text_file, tmp_path):
    """accelerate launch --multi_gpu --num_processes 2 (gloo DDP on CPU): both ranks end with the same weights,
    for full fine-tuning, for the two-stage recipe (window + projection transfer, then LoRA) and with softmax heads
    (DDP fails on a trainable parameter that gets no gradient). The four modes run one after the other in the same
    two processes (one test, not four: pytest-xdist would give a shared launch to each of its workers)."""
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    assert launcher, "accelerate CLI not found"
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
           str(ROOT / "tests" / "training" / "ddp_worker.py"), tiny_dirs["llama"], text_file, str(tmp_path),
           ",".join(DDP_MODES)]
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for mode in DDP_MODES:
        folder = tmp_path / mode
        ranks = [json.loads((folder / f"rank{i}.json").read_text()) for i in (0, 1)]
        assert [r["world"] for r in ranks] == [2, 2], mode
        assert ranks[0]["sha"] == ranks[1]["sha"], (mode, ranks)
        metrics = json.loads((folder / "finetune_metrics.json").read_text())
        assert metrics["num_processes"] == 2 and metrics["steps"] == 2, mode
        transfer = json.loads((folder / "transfer_metrics.json").read_text())
        assert transfer["steps"] == 3, mode


@pytest.mark.slow(seconds=56)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_fsdp_two_processes_match_one_process(tiny_dirs, text_file, tmp_path, mode):
    """torchrun --nproc_per_node 2 with --fsdp (FSDP2 over gloo: each decoder layer and the model sharded, the
    polyattn parameters whole): transfer then LoRA / full fine-tuning give the losses, evaluations and saved weights
    of one unsharded process on the same global batch (4 sequences: 2 per process, 4 in one). Tolerance: relative
    1e-5 (measured: the transfer losses agree to 1e-7 relative, fine-tuning's to every printed digit; the saved
    weights to 6e-7). The saved folder is one whole checkpoint that reloads; a second launch resumes from the
    sharded runs' checkpoints (whole tensors) and evaluates the same, with one process late to read the checkpoint
    the other rewrites."""
    from transformers import AutoModelForCausalLM

    import hf_polyattn  # noqa: F401  (reloads the saved folders)
    from hf_polyattn.training.pipeline import run

    from .fsdp_worker import args

    sharded, single = tmp_path / "fsdp", tmp_path / "single"
    proc = _torchrun(29531 if mode == "lora" else 29533, tiny_dirs["llama"], text_file, str(sharded), mode, 2, True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = run(args(tiny_dirs["llama"], text_file, str(single), mode, 1, False))
    res = json.loads((sharded / "results.json").read_text())
    assert res["distributed"]["processes"] == 2 and res["distributed"]["sharding"] == "fsdp2"
    assert res["distributed"]["fsdp_units"] == {"LlamaDecoderLayer": 2, "root": 1}
    assert res["distributed"]["replicated_parameters"] > 0  # the polyattn parameters, kept whole
    assert ref["distributed"]["processes"] == 1 and ref["distributed"]["sharding"] == "none"
    for stage in ("transfer", "finetune"):
        assert _losses(sharded, stage) == pytest.approx(_losses(single, stage), rel=1e-5), stage
    for tag in ("after_transfer", "after_finetune"):
        assert res["evaluations"][tag]["perplexity"] == pytest.approx(ref["evaluations"][tag]["perplexity"], rel=1e-5)
    got = AutoModelForCausalLM.from_pretrained(sharded / "model").state_dict()
    want = AutoModelForCausalLM.from_pretrained(single / "model").state_dict()
    assert set(got) == set(want) and not any("lora" in k for k in got)  # merged, as the unsharded run saves it
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
    if mode == "full":  # resume: whole tensors back into the shards, then nothing left to train; the main process
        # slowed while it replaces the transfer checkpoint, the other while it looks for it (SLOW_RESUME)
        again = _torchrun(29535, tiny_dirs["llama"], text_file, str(sharded), mode, 2, True, **SLOW_RESUME)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "[transfer] resumed" in again.stdout and "[finetune] resumed" in again.stdout
        res2 = json.loads((sharded / "results.json").read_text())
        assert res2["evaluations"]["after_finetune"]["perplexity"] == pytest.approx(
            res["evaluations"]["after_finetune"]["perplexity"], rel=1e-6)


@pytest.mark.slow(seconds=21)
def test_accelerate_fsdp_launch_without_fsdp_is_refused(tiny_dirs, text_file, tmp_path):
    """`accelerate launch --use_fsdp --fsdp_version 2` on CPUs gives MULTI_CPU (plain data parallel: every process the
    whole model): without --fsdp the run is refused, by name, before any training."""
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    proc = _launch([launcher, "launch", "--use_fsdp", "--fsdp_version", "2", "--num_processes", "2",
                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                    "29537", "-m", "hf_polyattn.retrofit", *argv(tiny_dirs["llama"], text_file, str(tmp_path), "lora",
                                                                2, False)])
    assert proc.returncode != 0
    assert "LaunchError" in proc.stderr and "add --fsdp" in proc.stderr and "MULTI_CPU" in proc.stderr
    assert not (tmp_path / "transfer_metrics.json").exists()
