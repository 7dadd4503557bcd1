"""The user contract on a GPU (skipped without CUDA; recipes/gpu_checks.sh tests runs it on a CUDA machine).

Every kind x Llama (grouped-query attention, RoPE) / GPT-2 / BERT in bf16 on CUDA, where
``backend='auto'`` takes the Triton kernels: ``convert()`` of a model already on the GPU draws the
same seeded tensors as on the CPU (the sketch init once raised 'Expected a cuda device type for
generator'), ``from_pretrained(..., dtype=bf16, device_map="cuda")`` reloads the attention (never
softmax) with the function of the fp32 CPU model up to bf16 rounding, a training step gives finite
gradients everywhere, cache and no cache agree, and save -> reload on the GPU is bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from integration_helpers import ARCHS, KIND_CONFIGS, arch_kind_params, auto_class, build, perturb_polyattn

import hf_polyattn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
BF16 = torch.bfloat16


def _ids(n: int = 40) -> torch.Tensor:
    return torch.randint(3, 100, (2, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch_name,kind", arch_kind_params(["llama", "gpt2", "bert"]))
def test_bf16_model_on_cuda(tmp_path, arch_name, kind):
    arch = ARCHS[arch_name]
    auto = auto_class(arch)
    ids = _ids()

    # convert() on the GPU: the same seeded polyattn tensors as a CPU convert, cast the same way
    on_gpu = build(arch_name, None).to(CUDA, BF16)
    hf_polyattn.convert(on_gpu, KIND_CONFIGS[kind])
    on_cpu = build(arch_name, kind).to(BF16)
    cpu_sd = on_cpu.state_dict()
    for name, t in on_gpu.state_dict().items():
        if ".polyattn." in name:
            assert t.device.type == "cuda", name
            torch.testing.assert_close(t.cpu(), cpu_sd[name], atol=0, rtol=0, msg=name)

    # from_pretrained onto the GPU in bf16: same attention, same function up to bf16 rounding
    fp32 = build(arch_name, kind)
    perturb_polyattn(fp32)
    fp32.save_pretrained(tmp_path / "fp32")
    with torch.no_grad():
        ref = fp32(ids).logits
    model = auto.from_pretrained(tmp_path / "fp32", dtype=BF16, device_map="cuda").eval()
    assert hf_polyattn.get_polyattn_config(model).kind == kind
    with torch.no_grad():
        out = model(ids.to(CUDA)).logits
    assert out.dtype == BF16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref, atol=0.1, rtol=0.05)

    # a training step: finite gradients for every trainable tensor, polyattn ones included
    model.train()
    model(ids.to(CUDA)).logits.float().square().mean().backward()
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            assert torch.isfinite(p.grad).all(), name
    model.zero_grad(set_to_none=True)
    model.eval()

    if arch.causal:
        # the recurrent cache gives the logits of the full forward (bf16 rounding apart)
        with torch.no_grad():
            full = model(ids.to(CUDA), use_cache=False).logits
            cached = model(ids.to(CUDA), use_cache=True).logits
        torch.testing.assert_close(cached.float(), full.float(), atol=0.05, rtol=0.05)
        gen = model.generate(ids[:, :10].to(CUDA), max_new_tokens=8, do_sample=False)
        assert gen.shape == (2, 18)

    # save -> reload on the GPU: bit-identical logits
    model.save_pretrained(tmp_path / "bf16")
    again = auto.from_pretrained(tmp_path / "bf16", dtype=BF16, device_map="cuda").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids.to(CUDA)).logits, out, atol=0, rtol=0)
