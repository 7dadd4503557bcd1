"""The vLLM plugin (hf_polyattn/serving/vllm): converted folders served by vLLM give transformers' greedy tokens.

Runs in vLLM's own venv (``make test-vllm``: vLLM pins an older transformers than the package), on the CPU build.
The folders and transformers' reference tokens are made by ``build_folders.py`` in the package's venv
(``HF_POLYATTN_REFERENCE_PYTHON``, default ``.venv/bin/python``). Each ``LLM`` takes 20-40 s to start on a 2-core
CPU, so one engine serves every prompt case of a folder: prompts shorter than, equal to and longer than window +
sinks, in one batch of mixed lengths, under a budget of 32 tokens a step (chunked prefill of the long prompts; a
folder whose sparse cache is chosen again by the prompt takes max_model_len, each prompt in one step) and at most 2
sequences at a time (slots reused by later requests).

Skipped where vLLM is not installed (the package's own venv); ``make test-vllm`` sets HF_POLYATTN_REQUIRE_VLLM=1,
which turns that skip into a failure.
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(ROOT))
from tests.serving.need_vllm import require_vllm  # noqa: E402

require_vllm()

# the engine's settings for every case: float32 as the reference, a small budget so that the 90-token prompt is
# prefilled in chunks, two sequences at a time so that later requests reuse slots
ENGINE = dict(dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=2 ** 28,
              skip_tokenizer_init=True, max_num_batched_tokens=32, max_num_seqs=2, seed=0)
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = tmp_path_factory.mktemp("served")
    python = os.environ.get("HF_POLYATTN_REFERENCE_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    env = dict(os.environ, OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([python, str(ROOT / "tests" / "serving" / "build_folders.py"), str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "reference.json").read_text())


def _serve(folder: Path, prompts: dict, extra: str = "", env: dict | None = None,
           engine: dict | None = None) -> subprocess.CompletedProcess:
    """Run vLLM in a fresh process (``LLM`` spawns its engine; one engine per process) on ``prompts`` with
    ``ENGINE`` updated by ``engine``; prints a JSON line of prompt name -> (tokens, logprobs)."""
    engine = {**ENGINE, **(engine or {})}
    code = textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        if __name__ == "__main__":
            llm = LLM(model={str(folder)!r}, **{engine!r}{extra})
            names = list({prompts!r})
            params = SamplingParams(temperature=0, max_tokens={NEW_TOKENS}, ignore_eos=True, logprobs=0)
            outs = llm.generate([TokensPrompt(prompt_token_ids={prompts!r}[n]) for n in names], params)
            result = {{}}
            for name, out in zip(names, outs):
                o = out.outputs[0]
                result[name] = [list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]]
            print("RESULT " + json.dumps(result))
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **(env or {})))


from tests.serving.build_folders import NEW_TOKENS  # noqa: E402


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _assert_equals_transformers(served: dict, reference: dict, case: str) -> None:
    """Every prompt's greedy tokens served equal transformers' for the folder ``case``, and their log-probabilities
    within LOGPROB_TOLERANCE."""
    expected = reference["cases"][case]
    for name in reference["prompts"]:
        tokens, logprobs = served[name]
        assert tokens == expected["tokens"][name], (case, name)
        assert max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"][name])) < LOGPROB_TOLERANCE, (case, name)


# the Llama family's layouts, then the other families (each a hybrid layout: build_folders.FAMILIES says what each
# sets apart: Qwen2's q/k/v bias, Qwen3's q/k norms and head_dim, Gemma 3's scale, norms, logit soft-cap, local and
# global RoPE and its sliding-window layers kept vLLM's own)
# 'sparse_stream': the bounded sparse cache chosen by the streaming rule, its 90-token prompt prefilled in chunks
@pytest.mark.parametrize("case", ["hybrid", "linear_only", "sliding", "qwen2", "qwen3", "gemma3", "sparse_stream"])
def test_greedy_tokens_and_logprobs_equal_transformers(folders, case):
    out, reference = folders
    served = _result(_serve(out / case, reference["prompts"]))
    _assert_equals_transformers(served, reference, case)


def test_without_the_native_step_the_compiled_step_gives_the_same_tokens(folders):
    """HF_POLYATTN_NATIVE_KERNELS=0 (as where no C compiler runs): the steady rings decode through ``slot_step``
    under torch.compile, warmed up when vLLM binds the state, and the plugin says so in its log."""
    out, reference = folders
    proc = _serve(out / "hybrid", reference["prompts"], env={"HF_POLYATTN_NATIVE_KERNELS": "0"})
    served = _result(proc)
    assert "switched off by HF_POLYATTN_NATIVE_KERNELS=0" in proc.stdout + proc.stderr
    _assert_equals_transformers(served, reference, "hybrid")


def test_the_demo_layout_on_smollm2_equals_transformers(folders):
    """The demo's attention on the real SmolLM2-135M (30 layers, 22 softmax kv heads scattered over them), at its
    full 8,192 positions, where the state plan stacks several layers' states in each state layer
    (servable.state_plan), and vLLM's own count of sequences its KV memory holds is the plan's."""
    out, reference = folders
    demo = reference["smollm2_demo"]
    tokens_max = 8192
    proc = _serve(out / "smollm2_demo", {"text": demo["prompt"]}, engine={"max_model_len": tokens_max})
    tokens, logprobs = _result(proc)["text"]
    assert tokens == demo["tokens"]
    assert max(abs(a - b) for a, b in zip(logprobs, demo["logprobs"])) < LOGPROB_TOLERANCE

    from transformers import AutoConfig

    from hf_polyattn.serving.vllm.servable import request_pages, state_layout, state_plan

    config = AutoConfig.from_pretrained(out / "smollm2_demo")
    plan = state_plan(config, tokens_max, torch.float32)
    assert plan.per_module > 1, plan  # the stacked path is what this case runs
    kv_heads, head_token = config.num_key_value_heads, 2 * 64 * 4
    pages, group, page = request_pages(22, plan.modules,
                                       plan.per_module * state_layout(config, key_dtype=torch.float32).nbytes(),
                                       kv_heads * head_token, head_token, tokens_max)
    logged = re.search(r"Maximum concurrency for 8,192 tokens per request: ([0-9.]+)x", proc.stdout + proc.stderr)
    assert logged, (proc.stdout + proc.stderr)[-3000:]
    # vLLM prints two decimals of (whole pages in the pool) / (pages a request takes)
    assert float(logged.group(1)) == pytest.approx(ENGINE["kv_cache_memory_bytes"] // (group * page) / pages,
                                                   abs=0.006)


@pytest.mark.parametrize("case", ["linear_only_sparse", "linear_only_sparse_value"])
def test_the_linear_only_layout_with_a_sparse_cache_chosen_again_by_the_prompt_equals_transformers(folders, case):
    """The linear-only preset's layout (no softmax head, a 16-key sparse cache ranked by attention and chosen again
    by each prompt's last 4 queries, sinks at their own positions, Hedgehog, decay; 'linear_only_sparse_value':
    half of it kept for the keys of largest |v|): every prompt case in one batch of mixed lengths, two sequences at
    a time (later requests reuse slots). transformers' generate() re-chooses the cache once, at the end of the
    prompt's one call; so each prompt is prefilled in one step (the config hook switches chunked prefill off: a
    budget of max_model_len tokens a step)."""
    out, reference = folders
    proc = _serve(out / case, reference["prompts"], engine={"max_num_batched_tokens": ENGINE["max_model_len"]})
    assert "chunked prefill is switched off for this model (sparse_observe=4)" in proc.stdout + proc.stderr
    served = _result(proc)
    _assert_equals_transformers(served, reference, case)


def test_a_budget_that_would_split_a_prompt_is_refused_where_the_prompt_chooses_the_cache(folders):
    """sparse_observe with a budget of 32 tokens a step (below max_model_len 512): a longer prompt would be prefilled
    in chunks, each chunk re-choosing the cache over its own keys; refused by name at start, not served
    differently."""
    out, reference = folders
    proc = _serve(out / "linear_only_sparse", {"short": reference["prompts"]["short"]})
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "max_num_batched_tokens=32 is below max_model_len=512" in text and "sparse_observe=4" in text


def test_without_the_plugin_vllm_refuses_the_folder(folders):
    out, reference = folders
    # VLLM_PLUGINS names the plugins vLLM loads: none of ours
    proc = _serve(out / "hybrid", {"short": reference["prompts"]["short"]}, env={"VLLM_PLUGINS": "none"})
    assert proc.returncode != 0
    assert "PolyAttnLlamaForCausalLM" in proc.stderr and "are not supported" in proc.stderr


def test_transformers_backend_refuses_instead_of_serving_softmax(folders):
    out, reference = folders
    proc = _serve(out / "hybrid", {"short": reference["prompts"]["short"]},
                  extra=", model_impl='transformers', trust_remote_code=True")
    assert proc.returncode != 0
    assert "vLLM's Transformers backend (model_impl='transformers') would replace" in proc.stdout + proc.stderr


def test_a_folder_the_plugin_cannot_serve_is_refused_by_name(folders):
    out, reference = folders
    proc = _serve(out / "sparse", {"short": reference["prompts"]["short"]})
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    # a sparse cache on a layer that keeps a short convolution's state: not on the decoding ring the plugin packs
    assert "sparse_cache=32 is served on the decoding ring only" in text and "cannot serve this folder" in text


def test_bfloat16_serving_gives_the_float32_tokens(folders):
    """A bf16 engine (the dtype models are served in): the kernel heads' state stays in float32 (``RingLayout``'s
    working dtype), every log-probability is finite and the greedy tokens are float32 transformers' for every prompt
    case (the log-probabilities differ by bf16 rounding: 0.004-0.006 on this folder, measured once)."""
    out, reference = folders
    served = _result(_serve(out / "hybrid", reference["prompts"], engine={"dtype": "bfloat16"}))
    for name in reference["prompts"]:
        tokens, logprobs = served[name]
        assert all(math.isfinite(x) for x in logprobs), name
        assert tokens == reference["cases"]["hybrid"]["tokens"][name], name
