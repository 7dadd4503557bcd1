"""The model-type matrix (rows in model_matrix.py): every supported decoder type with the long-context recipe (and
one kv head softmax) keeps cache = no cache over 150 generated tokens after a prompt longer than window + sinks,
a left-padded batch equals each prompt alone, its RoPE is read from the model (each layer's rotation turns the
model's own queries at one position into its queries at another; a layer read as without RoPE has the same query
at every position), its layers take the roles the row names (sliding layers kept exact, the others converted),
save -> reload is bit-identical and ``trust_remote_code=True`` loads it without the plugin imported; every
supported encoder type does the same with polysketch; every refused row raises its own message, also under the
other settings it names; docs/supported_models.md is the rendering of these rows."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from integration_helpers import check_left_padded_generation, perturb_polyattn
from model_matrix import DOC, ROWS, VOCAB, counts, installed, render
from test_capture_decode import _Trace

import hf_polyattn
from hf_polyattn import PolyAttnCache, PolyAttnConfig, returned_cache
from hf_polyattn.integration.compatibility import find_attention_modules
from hf_polyattn.integration.layout import layer_layout
from hf_polyattn.integration.rope import model_rope
from hf_polyattn.integration.state import HFPolyAttention
from hf_polyattn.ops.sliding import SlidingWindowSoftmax

ROOT = Path(__file__).resolve().parents[2]
W, S = 16, 2
RECIPE = PolyAttnConfig(kind="linear", window=W, sinks=S, decay="gate")
RECIPES = ("long-context", "softmax-heads")
ENCODER_KIND = PolyAttnConfig(kind="polysketch", degree=4, sketch="learned", sketch_size=8, local_exact=True,
                              block_size=4)
PROMPT, NEW = 24, 150  # a prompt beyond w + s = 18, and 150 tokens decoded past it

# the rows as the installed transformers has them (GPT-J and CodeGen are refused on 5.23)
NOW = [installed(r) for r in ROWS]
SUPPORTED_DECODERS = [pytest.param(r, id=r.id) for r in NOW if not r.encoder and r.supported]
ROPE_DECODERS = [pytest.param(r, id=r.id) for r in NOW if not r.encoder and r.supported and any(r.rope)]
SUPPORTED_ENCODERS = [pytest.param(r, id=r.id) for r in NOW if r.encoder and r.supported]
REFUSED = [pytest.param(r, id=r.id) for r in NOW if r.refusal is not None]


def layout(row) -> tuple:
    """The row's (layer, role, window) per attention layer: as it names it, else every layer converted."""
    return row.layout if row.layout is not None else tuple((i, "kind", None) for i in range(2))


def kind(row, recipe: str = "long-context") -> PolyAttnConfig:
    """The row's config: polysketch for an encoder, else the recipe; 'softmax-heads': kv head 0 of the last
    converted layer kept softmax. With the row's own settings on top."""
    if row.encoder:
        return ENCODER_KIND.replace(**row.polyattn)
    cfg = RECIPE.replace(**row.polyattn)
    if recipe == "softmax-heads":
        cfg = cfg.replace(softmax_heads=((max(i for i, role, _ in layout(row) if role != "sliding"), 0),))
    return cfg


def build(row, cfg: PolyAttnConfig | None = None, seed: int = 0):
    """The row's tiny model (its own config object), converted to ``cfg`` with the polyattn tensors moved off their
    seed values (a reload that fell back to them would differ)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if row.encoder else AutoModelForCausalLM
    model = auto.from_config(row.make_config()).eval()
    if cfg is not None:
        hf_polyattn.convert(model, cfg)
        perturb_polyattn(model)
    if not row.encoder:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return model


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, HFPolyAttention)]


# ----------------------------------------------------------------------------- decoders
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("row", SUPPORTED_DECODERS)
def test_decoder_cache_equals_no_cache(row, recipe):
    """Greedy generate() with the recurrent cache: its logits at each of the 150 steps are the uncached forward's
    over the sequence so far (one forward gives them all: it is causal), and each token is their argmax."""
    model = build(row, kind(row, recipe))
    ids = _ids(1, PROMPT, seed=1)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert isinstance(returned_cache(out), PolyAttnCache) and out.sequences.shape[1] == PROMPT + NEW
    with torch.no_grad():
        full = model(out.sequences[:, :-1], use_cache=False).logits[:, PROMPT - 1 :]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=1e-4)
    assert torch.equal(full.argmax(-1), out.sequences[:, PROMPT:])


@pytest.mark.parametrize("row", SUPPORTED_DECODERS)
def test_decoder_left_padded_batch_equals_each_prompt(row):
    """Prompts of 24 and 19 tokens (both beyond w + s) left-padded in one batch: each row generates the tokens and
    logits it generates alone."""
    check_left_padded_generation(build(row, kind(row)), [_ids(1, PROMPT, seed=2)[0], _ids(1, PROMPT - 5, seed=3)[0]],
                                 PROMPT)


_CAPTURED: dict = {}


def _capture(module, query, key, value, attention_mask, **kwargs):
    """Keeps each layer's queries and attends causally: every value of a layer is the same here (one token
    repeated), so any attention weights give the same output."""
    _CAPTURED[id(module)] = query.detach()
    groups = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), is_causal=True)
    return out.transpose(1, 2).contiguous(), None


POSITIONS = [0, 1, 2, 3, 5, 23, 100, 255]
FIRST = 3  # compared from the 4th token: LFM2's convolution (kernel 3) sees three of the same token from there


@pytest.mark.parametrize("row", ROPE_DECODERS)
def test_rope_is_the_models_own(row):
    """The acceptance check of the RoPE reading, through the model itself (its own rotary embedding, its own
    attention forward with apply_rotary_pos_emb): one token repeated at positions P reaches every attention layer as
    the same hidden state, so its queries there are R_layer(P_i) q; the rotation of each converted layer (and the
    reading of each sliding layer kept exact) turns the query at P_i into the one at P_j for every pair, both
    directions (sinks turn queries back). A layer read as without RoPE (EXAONE 4's global layers, SmolLM3's NoPE
    layers) must have the same query at every position. Every layer reads the layout, rotated dims and rope_theta
    the row names."""
    from transformers import AttentionInterface

    model = build(row)
    AttentionInterface.register("matrix_capture", _capture)
    model.config._attn_implementation = "matrix_capture"
    _CAPTURED.clear()
    with torch.no_grad():
        model(torch.full((1, len(POSITIONS)), 7), position_ids=torch.tensor([POSITIONS]))
    converted = {idx: mod._modules.get("polyattn") for _, mod, idx in find_attention_modules(build(row, kind(row)))}
    pos = torch.tensor(POSITIONS[FIRST:])
    n = len(pos)
    found = find_attention_modules(model)
    assert len(found) == len(row.rope)
    for (_, mod, idx), want in zip(found, row.rope):
        query = _CAPTURED[id(mod)][:, :, FIRST:].double()  # (1, H, n, D)
        scale = float(query.abs().amax())
        layer = converted[idx]
        rope = layer.rope if isinstance(layer, HFPolyAttention) else model_rope(mod, idx)  # kept exact: the reading
        if rope is None:
            assert want is None, (idx, want)
            assert float((query - query[:, :, :1]).abs().amax()) <= 1e-5 * scale  # no rotation in the model either
            continue
        turned = rope.rotate(query[:, :, :, None].expand(-1, -1, n, n, -1), pos[None, :] - pos[:, None])
        assert float((turned - query[:, :, None].expand_as(turned)).abs().amax()) <= 1e-4 * scale, idx
        assert float((query[:, :, 1:] - query[:, :, :1]).abs().amax()) > 0.1 * scale  # it turns
        assert want is not None and want[:2] == ("rotate_half" if rope.pairs is None else "interleaved",
                                                 rope.rotary_dim), (idx, want)
        if rope.pairs is not None:
            half = rope.rotary_dim // 2
            assert torch.equal(rope.pairs, torch.arange(2 * half).reshape(half, 2).T)
        if len(want) == 3:  # inv_freq[t] = theta^(-2t / rotary_dim)
            theta = float(rope.inv_freq[1].double()) ** (-rope.rotary_dim / 2)
            assert math.isclose(theta, want[2], rel_tol=1e-3), (idx, theta, want[2])


@pytest.mark.parametrize("row", [*SUPPORTED_DECODERS, *SUPPORTED_ENCODERS])
def test_layer_roles_are_the_rows(row):
    """hf_polyattn.layer_layout of the converted model: which layers kept their sliding window exact and which got
    the kind (and the window a converted layer had)."""
    got = tuple((e["layer"], e["role"], e.get("window")) for e in layer_layout(build(row, kind(row))))
    assert got == layout(row)


# ----------------------------------------------------------------------------- encoders
@pytest.mark.parametrize("row", SUPPORTED_ENCODERS)
def test_encoder_padded_batch_equals_each_sequence(row):
    """polysketch (learned sketch, exact local blocks): a batch of 12 and 9 real tokens right-padded gives each
    row's real positions the logits of the sequence alone."""
    model = build(row, kind(row))
    ids = _ids(2, 12, seed=4)
    mask = torch.ones_like(ids)
    ids[1, 9:], mask[1, 9:] = model.config.pad_token_id or 0, 0
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        for row_idx, real in ((0, 12), (1, 9)):
            alone = model(input_ids=ids[row_idx : row_idx + 1, :real]).logits
            torch.testing.assert_close(batch[row_idx, :real], alone[0], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("row", REFUSED)
def test_refused_rows_raise_their_reason(row):
    """convert raises the row's ValueError before changing anything (the encoder rows with polysketch), under the
    recipe and each other setting the row names; with the setting its reason offers, it converts."""
    model = build(row)
    for extra in ({}, *row.refused_also):
        with pytest.raises(ValueError, match=row.refusal):
            hf_polyattn.convert(model, kind(row).replace(**extra))
        assert not any(isinstance(m, (HFPolyAttention, SlidingWindowSoftmax)) for m in model.modules())
    if row.converts_with is not None:
        hf_polyattn.convert(model, kind(row).replace(**row.converts_with))
        assert _layers(model)


# ----------------------------------------------------------------------------- save, reload, remote code
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every supported row converted (the recipe; polysketch for encoders), saved, with its inputs (row 1 padded:
    left for decoders, right for encoders) and logits."""
    root = tmp_path_factory.mktemp("matrix")
    cases = {}
    for row in NOW:
        if not row.supported:
            continue
        model = build(row, kind(row))
        ids = _ids(2, PROMPT, seed=5)
        mask = torch.ones_like(ids)
        if row.encoder:
            mask[1, -6:] = 0
        else:
            mask[1, :6] = 0
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        folder = root / row.id
        model.save_pretrained(folder)
        torch.save({"ids": ids, "mask": mask, "logits": logits}, root / f"{row.id}.pt")
        auto = "AutoModelForMaskedLM" if row.encoder else "AutoModelForCausalLM"
        cases[row.id] = (str(folder), auto, kind(row).kind)
    return root, cases


@pytest.mark.parametrize("row", [*SUPPORTED_DECODERS, *SUPPORTED_ENCODERS])
def test_save_reload_gives_identical_logits(row, saved):
    import transformers

    root, cases = saved
    folder, auto, kind = cases[row.id]
    ref = torch.load(root / f"{row.id}.pt")
    model = getattr(transformers, auto).from_pretrained(folder).eval()
    assert model.config._attn_implementation == kind and _layers(model)
    with torch.no_grad():
        logits = model(input_ids=ref["ids"], attention_mask=ref["mask"]).logits
    assert torch.equal(logits, ref["logits"])


def test_trust_remote_code_loads_every_supported_row(saved):
    """One fresh process that never imports the plugin itself loads every saved row with trust_remote_code=True:
    the stock class, the kind, and bit-identical logits."""
    root, cases = saved
    code = textwrap.dedent(f"""
        import json, sys, torch, transformers
        transformers.logging.set_verbosity_error()
        assert "hf_polyattn" not in sys.modules  # the script never imports the plugin (only the loaders do)
        results = {{}}
        for name, (folder, auto, kind) in {cases!r}.items():
            ref = torch.load({str(root)!r} + f"/{{name}}.pt")
            model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
            with torch.no_grad():
                logits = model(input_ids=ref["ids"], attention_mask=ref["mask"]).logits
            own = json.load(open(folder + "/config.json"))["architectures"][0].removeprefix("PolyAttn")
            results[name] = dict(stock=type(model) is getattr(transformers, own),
                                 attn=model.config._attn_implementation == kind,
                                 equal=torch.equal(logits, ref["logits"]))
        print(json.dumps(results))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(root / "modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(cases)
    bad = {name: r for name, r in results.items() if not all(r.values())}
    assert not bad, bad


# ----------------------------------------------------------------------------- the rows themselves
def test_matrix_covers_the_model_types_it_claims():
    """At least 25 decoder and 8 encoder model types supported with the recipe as it is (a row's own option, such as
    Mistral's sliding_layers='kind', not counted), each refused row with a reason, one row per id."""
    n = counts()
    assert n["decoders"] >= 25 and n["encoders"] >= 8, n
    assert all(r.reason for r in ROWS if not r.supported)
    assert not any(r.refusal and (r.layout or r.rope) for r in ROWS)
    assert len({r.id for r in ROWS}) == len(ROWS)


def test_supported_models_doc_is_up_to_date():
    """docs/supported_models.md is what the rows render to: rerun `python tests/integration/model_matrix.py`."""
    assert DOC.read_text() == render(), "stale: run python tests/integration/model_matrix.py"


@pytest.mark.parametrize("row", SUPPORTED_DECODERS)
def test_decoder_static_steps_equal_eager_decoding(row):
    """Every supported decoder type decodes through the static steps of ``capture_decode`` (run eagerly here:
    ``DecodeGraphs(record=False)``) to the eager tokens and logits, with a softmax head kept; a model that keeps
    exact sliding layers or has mixer layers (a convolution, a linear-attention layer of its own) is refused by
    name instead."""
    from hf_polyattn.integration.cache import PolyAttnCacheLayer, cache_layers
    from hf_polyattn.integration.graphs import DecodeGraphs, _layer_refusal

    model = build(row, kind(row, "softmax-heads"))
    if any(not isinstance(layer, PolyAttnCacheLayer) for layer in cache_layers(model.config)):
        assert "a layer of another type" in _layer_refusal(model)
        return
    if any(role == "sliding" for _, role, _ in layout(row)):
        assert "exact sliding-window softmax layer" in _layer_refusal(model)
        return
    assert _layer_refusal(model) is None
    ids = _ids(2, PROMPT, seed=2)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    eager = model.generate(ids, **kw)
    graphs = DecodeGraphs(model, 64, record=False)
    model.forward = graphs
    static_forward, traces = graphs._static_forward, []

    def traced():  # each step's operations, as a CUDA graph would record them (test_capture_decode._Trace)
        with _Trace() as trace:
            out = static_forward()
        traces.append(trace.ops)
        return out

    graphs._static_forward = traced
    static = model.generate(ids, **kw)
    assert graphs.counts["replayed"] == 9, graphs.counts
    assert torch.equal(static.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(static.logits, 1), torch.stack(eager.logits, 1), rtol=1e-4, atol=1e-4)
    # every replay dispatches what the first replay did: nothing a graph would record once changes between tokens
    assert len(traces) == 10 and all(ops == traces[1] for ops in traces[2:])
