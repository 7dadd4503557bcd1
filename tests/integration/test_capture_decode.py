"""hf_polyattn.capture_decode: decoding steps replayed from CUDA graphs give the eager tokens.

On the CPU ``DecodeGraphs(record=False)`` runs the same static steps eagerly and checks that ``advance`` (what a
replay does to the states' Python values instead of the step's code) leaves every state as the step did; the CUDA
test records and replays real graphs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_polyattn
from hf_polyattn.integration.graphs import DecodeGraphs


def _model(softmax_heads=None, dtype=torch.float32, **opts):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    settings = dict(kind="linear", feature_map="elu", window=8, sinks=2, decay="gate", softmax_heads=softmax_heads)
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig(**{**settings, **opts}))
    return model.to(dtype).eval()


def _ids(batch=2, length=30):
    return torch.randint(1, 64, (batch, length), generator=torch.Generator().manual_seed(1))


def _generate(model, ids, mask=None, steps=20):
    return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, max_new_tokens=steps,
                          do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)


HEADS = {"linear-only": None, "hybrid": [(1, 0)], "a-layer-all-softmax": [(0, 0), (0, 1)]}


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_static_steps_give_the_eager_tokens(heads, dtype):
    model = _model(HEADS[heads], dtype)
    ids = _ids()
    eager = _generate(model, ids)
    graphs = DecodeGraphs(model, 64, record=False)
    model.forward = graphs
    static = _generate(model, ids)
    # the prompt and the first step eager (it turns the prefill's states into rings), one static step run eagerly
    # (it makes the states static), then every step a "replay"
    assert graphs.counts == {"eager": 2, "static": 1, "replayed": 17, "recorded": 0}
    assert torch.equal(static.sequences, eager.sequences)
    for a, b in zip(static.scores, eager.scores):
        assert torch.isfinite(a).all()
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(a, b, **tol)


def test_left_padding_replays_once_every_new_token_is_real():
    """A left-padded batch: the softmax heads keep a padding mask, so a hybrid model decodes eagerly throughout;
    a linear-only one replays (its rings hold the padded keys as empty slots)."""
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    for heads, replayed in (("linear-only", 17), ("hybrid", 0)):
        model = _model(HEADS[heads])
        eager = _generate(model, ids, mask)
        graphs = DecodeGraphs(model, 64, record=False)
        model.forward = graphs
        static = _generate(model, ids, mask)
        assert graphs.counts["replayed"] == replayed, heads
        assert torch.equal(static.sequences, eager.sequences)
        for a, b in zip(static.scores, eager.scores):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _calls(model, ids, chunks):
    """Logits of a prefill, then each chunk of tokens in one call (its own length), through one cache."""
    cache, out = hf_polyattn.PolyAttnCache(model), []
    with torch.no_grad():
        for s, t in chunks:
            out.append(model(ids[:, s:t], **hf_polyattn.cache_kwargs(cache), use_cache=True).logits)
    return torch.cat(out, 1)


def test_a_multi_token_call_and_a_full_buffer_go_eager_and_then_static_again():
    """Single tokens, a 3-token call in between (the states leave the static form), single tokens again, past the
    softmax buffers' max_length (eager from there): the logits of plain eager calls throughout."""
    model = _model(HEADS["hybrid"])
    ids = _ids(length=60)
    chunks = [(0, 20), *((i, i + 1) for i in range(20, 30)), (30, 33), *((i, i + 1) for i in range(33, 60))]
    eager = _calls(model, ids, chunks)
    graphs = DecodeGraphs(model, 50, record=False)
    model.forward = graphs
    static = _calls(model, ids, chunks)
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    # the prefill eager; tokens 20-29: eager, static, 8 replays; 30-32 eager; 33: eager (back to rings), 34: static
    # again, 35-49 replays (a call with i tokens before it writes position i < 50), 50-59 eager (no room)
    assert graphs.counts == {"eager": 1 + 1 + 1 + 1 + 10, "static": 2, "replayed": 8 + 15, "recorded": 0}


def test_capture_decode_refuses_what_it_cannot_serve():
    model = _model()
    with pytest.raises(ValueError, match="records CUDA graphs: the model is on 'cpu'"):
        hf_polyattn.capture_decode(model)
    with pytest.raises(TypeError, match="enabled must be True or False"):
        hf_polyattn.capture_decode(model, enabled="yes")
    assert hf_polyattn.capture_decode(model, enabled=False) is None  # nothing installed: nothing to take back
    assert "forward" not in model.__dict__


def test_a_model_whose_layers_never_decode_static_is_refused(monkeypatch):
    """The layer checks run before the device check would matter: each refusal names the layer and the setting."""
    from hf_polyattn.integration import graphs as graphs_module

    for opts, match in ((dict(window=0, sinks=0), "generic recurrent step"),
                        (dict(sparse_cache=8, sparse_chunk=4), "sparse cache"),
                        (dict(short_conv=2), "short_conv=2")):
        refusal = graphs_module._layer_refusal(_model(**opts))
        assert refusal is not None and match in refusal, (opts, refusal)
    assert graphs_module._layer_refusal(_model(HEADS["a-layer-all-softmax"])) is None
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4))
    assert "no polyattn attention layer" in graphs_module._layer_refusal(plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads", ["linear-only", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_replays_give_the_eager_tokens(heads, dtype):
    model = _model(HEADS[heads], dtype).cuda()
    ids = _ids().cuda()
    eager = _generate(model, ids)
    graphs = hf_polyattn.capture_decode(model, max_length=64)
    static = _generate(model, ids)
    assert graphs.counts == {"eager": 2, "static": 1, "replayed": 17, "recorded": 1}
    assert torch.equal(static.sequences, eager.sequences)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(static.scores, eager.scores):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tol)
    again = _generate(model, ids)  # a new cache: a new recording
    assert graphs.counts["recorded"] == 2 and torch.equal(again.sequences, eager.sequences)
    hf_polyattn.capture_decode(model, enabled=False)
    assert "forward" not in model.__dict__


class _Trace(torch.utils._python_dispatch.TorchDispatchMode):
    """Every dispatched operation of a step: its name, its non-tensor arguments and the storages of the tensors it
    reads that the step did not make itself (buffers, parameters, the states). A CUDA graph replays exactly that:
    the recorded operations, their recorded arguments, the same memory."""

    def __init__(self):
        super().__init__()
        self.ops, self.made = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        scalars = tuple(x for x in leaves if not isinstance(x, torch.Tensor))
        read = tuple(x.untyped_storage().data_ptr() for x in leaves
                     if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in self.made)
        self.ops.append((str(func), scalars, read))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and all(t is not x for x in leaves):  # new, not an in-place result
                self.made.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("heads", ["linear-only", "hybrid"])
def test_every_replayed_step_dispatches_the_recorded_operations(heads):
    """Two consecutive static steps dispatch the same operations with the same non-tensor arguments on the same
    persistent memory: nothing that changes between tokens (a position, a ring slot, the sinks' query shift) is a
    Python value a graph would record once. This is what makes the CPU's eager static steps (the tests above) stand
    for the CUDA graph's replays."""
    model = _model(HEADS[heads])
    ids = _ids(length=30)
    graphs = DecodeGraphs(model, 64, record=False)
    model.forward = graphs
    cache, traces = hf_polyattn.PolyAttnCache(model), []
    static_forward = graphs._static_forward

    def traced():
        with _Trace() as trace:
            out = static_forward()
        traces.append(trace.ops)
        return out

    graphs._static_forward = traced
    with torch.no_grad():
        model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True)
        for i in range(30, 36):
            model(ids[:, i % 30:i % 30 + 1], **hf_polyattn.cache_kwargs(cache), use_cache=True)
    assert graphs.counts["replayed"] == 4 and len(traces) == 5  # the static step run eagerly, then 4 replays
    first, *later = traces[1:]
    assert len(first) > 100
    for ops in later:
        assert len(ops) == len(first)
        for a, b in zip(first, ops):
            assert a == b, (a, b)


def test_static_buffers_are_what_decode_memory_counts_with_a_capacity():
    """While decoding from graphs the softmax heads' buffers hold max_length positions: the cache's bytes are
    decode_memory's with capacity=max_length (the bench's check), not its growing buffers'."""
    from hf_polyattn.integration.cache import cache_nbytes

    model = _model(HEADS["hybrid"])
    ids = _ids(length=40)
    graphs = DecodeGraphs(model, 64, record=False)
    model.forward = graphs
    cache = hf_polyattn.PolyAttnCache(model)
    with torch.no_grad():
        model(ids[:, :30], **hf_polyattn.cache_kwargs(cache), use_cache=True)
        for i in range(30, 40):
            model(ids[:, i:i + 1], **hf_polyattn.cache_kwargs(cache), use_cache=True)
    assert graphs.counts["replayed"] == 8
    static = hf_polyattn.decode_memory(model, (30,), batch=2, decoded=10, capacity=64).total[0]
    growing = hf_polyattn.decode_memory(model, (30,), batch=2, decoded=10).total[0]
    assert cache_nbytes(cache) == static != growing
    with pytest.raises(ValueError, match="capacity must be an int >= 1 or None"):
        hf_polyattn.decode_memory(model, (30,), capacity=0)
