import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import cpu_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "two_stage", "window_covers"])
def test_two_process_ddp_ranks_agree(tiny_dirs, text_file, tmp_path, mode):
    """accelerate launch --multi_gpu --num_processes 2 (gloo DDP on CPU): both ranks end with the same weights,
    for full fine-tuning and for the two-stage recipe (window + projection transfer, then LoRA)."""
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    assert launcher, "accelerate CLI not found"
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
           str(ROOT / "tests" / "training" / "ddp_worker.py"), tiny_dirs["llama"], text_file, str(tmp_path), mode]
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["sha"] == ranks[1]["sha"], ranks
    metrics = json.loads((tmp_path / "finetune_metrics.json").read_text())
    assert metrics["num_processes"] == 2 and metrics["steps"] == 2
    transfer = json.loads((tmp_path / "transfer_metrics.json").read_text())
    assert transfer["steps"] == 3
