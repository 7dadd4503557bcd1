"""The plugin's config hook (hf_polyattn/serving/vllm/config_hook.py): the kernel heads' op is kept out of captured
CUDA graphs (its per-request Python choices would be replayed), prefix caching is switched off, and a folder whose
sparse cache is chosen again by a prompt (sparse_observe) prefills each prompt in one step. Runs in vLLM's venv
without starting an engine (fast); skipped where vLLM is not installed, as test_vllm.py."""


import pytest

from tests.serving.need_vllm import require_vllm  # noqa: E402

require_vllm()

from vllm.config.compilation import CompilationConfig, CUDAGraphMode  # noqa: E402

from hf_polyattn.serving.vllm import register  # noqa: E402
from hf_polyattn.serving.vllm.config_hook import KERNEL_HEADS_OP, graph_safe, whole_prompts  # noqa: E402


def test_register_makes_the_op_a_default_splitting_op():
    register()
    register()  # again: nothing added twice
    assert CompilationConfig._attention_ops.count(KERNEL_HEADS_OP) == 1


@pytest.mark.parametrize("mode", [None, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL,
                                  CUDAGraphMode.FULL_DECODE_ONLY])
def test_on_cuda_full_graphs_become_piecewise(mode):
    config = CompilationConfig(cudagraph_mode=mode)
    graph_safe(config, cuda_alike=True)
    assert config.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_on_cuda_a_given_list_of_splitting_ops_gains_the_op_and_piecewise_stays():
    config = CompilationConfig(cudagraph_mode=CUDAGraphMode.PIECEWISE,
                               splitting_ops=["vllm::unified_attention_with_output"])
    graph_safe(config, cuda_alike=True)
    assert config.splitting_ops == ["vllm::unified_attention_with_output", KERNEL_HEADS_OP]
    assert config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    graph_safe(config, cuda_alike=True)
    assert config.splitting_ops.count(KERNEL_HEADS_OP) == 1


def test_on_the_cpu_nothing_changes():
    config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, splitting_ops=["x"])
    graph_safe(config, cuda_alike=False)
    assert config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE and config.splitting_ops == ["x"]


def _scheduler(**kwargs):
    from vllm.config import SchedulerConfig

    return SchedulerConfig(max_model_len=512, is_encoder_decoder=False, **kwargs)


def test_sparse_observe_switches_chunked_prefill_off_where_a_prompt_fits_a_step():
    scheduler = _scheduler(max_num_batched_tokens=512, enable_chunked_prefill=True)
    whole_prompts(scheduler, 512, 0, None)  # no re-choice by the prompt: chunks equal one call, nothing changes
    assert scheduler.enable_chunked_prefill
    whole_prompts(scheduler, 512, 16, None)
    assert not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens == 512


@pytest.mark.parametrize(("settings", "speculative", "named"), [
    (dict(max_num_batched_tokens=32, max_num_seqs=2, enable_chunked_prefill=True), None,
     "max_num_batched_tokens=32 is below max_model_len=512"),
    (dict(max_num_batched_tokens=512, enable_chunked_prefill=True, long_prefill_token_threshold=64), None,
     "long_prefill_token_threshold=64"),
    (dict(max_num_batched_tokens=512), object(), "speculative decoding is refused"),
])
def test_what_would_split_a_prompt_under_sparse_observe_is_refused_by_name(settings, speculative, named):
    with pytest.raises(ValueError, match="sparse_observe=16") as err:
        whole_prompts(_scheduler(**settings), 512, 16, speculative)
    assert named in str(err.value)
