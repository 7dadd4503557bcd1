"""Which kv heads to keep as softmax (``PolyAttnConfig.softmax_heads``): retrieval scores of a softmax model's heads.

DuoAttention (Xiao et al. 2024, arXiv:2410.10819) keeps the "retrieval heads" exact. The score here is measured on
the model with its own softmax attention (``attn_implementation="eager"``, which hands each layer's attention
weights out; a forward hook reduces them as each layer runs, so that no more than one layer's (H, L, L) weights
are alive: 30 layers of SmolLM2-135M at 2k tokens would hold 4.5 GB in float32):

* retrieval: seeded passkey prompts (an instruction, filler sentences, the needle "The pass key is 12345. Remember
  it. 12345 is the pass key." at a different depth in each prompt, the question, then the key as the answer). A
  head's score is the attention mass that the queries predicting the answer's key tokens put on the needle's key
  tokens (both mentions), averaged over those queries, the G query heads of the kv head and the prompts;
* beyond window (optional, on a token stream of ordinary text): the mean attention mass each query puts beyond the
  first ``sinks`` tokens and its last ``window`` keys, which a sinks + window head would lose.

``score_heads`` returns both as (num_layers, num_kv_heads) tensors; ``select_heads`` takes the top k pairs.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..validation import check_choice, check_int
from .passkey import PasskeyPrompt, passkey_prompt

__all__ = ["HeadScores", "parse_head_pairs", "score_heads", "select_heads"]

@dataclass
class HeadScores:
    """Scores of every kv head, (num_layers, num_kv_heads) each, and how they were measured."""

    retrieval: torch.Tensor
    beyond_window: torch.Tensor | None
    num_prompts: int
    length: int
    seed: int
    sinks: int
    window: int
    prompt_lengths: list[int] = field(default_factory=list)
    text_windows: int = 0
    # the layers a conversion gives the kind (a model's sliding-window layers kept exact are not among them):
    # select_heads picks among these; None = every layer
    layers: list[int] | None = None

    @property
    def candidate_heads(self) -> int:
        """How many kv heads ``select_heads`` may pick: those of the candidate layers (``layers``)."""
        rows = self.retrieval.shape[0] if self.layers is None else len(self.layers)
        return rows * self.retrieval.shape[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "retrieval": self.retrieval.tolist(),
            "beyond_window": None if self.beyond_window is None else self.beyond_window.tolist(),
            "num_prompts": self.num_prompts, "length": self.length, "seed": self.seed, "sinks": self.sinks,
            "window": self.window, "prompt_lengths": self.prompt_lengths, "text_windows": self.text_windows,
            "layers": self.layers,
        }


@contextlib.contextmanager
def _eager(model) -> Iterator[None]:
    """The model with transformers' eager softmax attention (and in eval mode) inside; restored after."""
    previous, training = model.config._attn_implementation, model.training
    model.set_attn_implementation("eager")
    model.eval()
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        model.train(training)


def _attention_layers(model) -> list[tuple[int, Any, int]]:
    """(layer index, attention module, query heads per kv head) of every layer, in layer order."""
    from ..integration.compatibility import attention_dims, find_attention_modules

    found = find_attention_modules(model)
    indices = sorted(idx for _, _, idx in found)
    if not found or indices != list(range(len(found))):
        raise ValueError(f"score_heads needs a decoder with one self-attention module per layer 0..L-1 that routes "
                         f"through transformers' AttentionInterface; {type(model).__name__} has layer indices "
                         f"{indices}")
    layers = []
    for _, module, idx in found:
        heads, _, kv_heads = attention_dims(module)
        layers.append((idx, module, heads // kv_heads))
    return sorted(layers, key=lambda t: t[0])


def _per_kv_head(model, layers, ids: Sequence[int], reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(num_layers, num_kv_heads): ``reduce`` of each layer's (H, L, L) softmax weights, per query head (H,),
    averaged over the query heads of each kv head. One forward of ``ids``; each layer's weights are reduced by a
    hook as the layer returns them and dropped there (the model's output carries none)."""
    results: dict[int, torch.Tensor] = {}

    def hook_for(idx: int, groups: int):
        def hook(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if not isinstance(weights, torch.Tensor):
                raise ValueError(f"{type(module).__name__} returned no attention weights with attn_implementation="
                                 "'eager': its heads cannot be scored")
            per_head = reduce(weights[0].double())
            results[idx] = per_head.reshape(-1, groups).mean(-1)
            return (output[0], None, *output[2:])

        return hook

    # prepend: before transformers' own output-capturing hooks, which would otherwise keep every layer's weights
    handles = [module.register_forward_hook(hook_for(idx, groups), prepend=True) for idx, module, groups in layers]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([results[idx].cpu() for idx, _, _ in layers])


def score_heads(model, tokenizer, *, num_prompts: int = 8, length: int = 2048, seed: int = 0,
                text_ids: Sequence[int] | torch.Tensor | None = None, sinks: int = 4, window: int = 128,
                sliding_layers: str = "exact") -> HeadScores:
    """Retrieval scores of every kv head of a causal LM with its softmax attention (module docstring).

    Args:
        model: a transformers causal LM; run with ``attn_implementation="eager"`` for the scoring (a polyattn
            model's stored softmax projections too), its own attention and train/eval mode restored after.
        tokenizer: its tokenizer (``tokenizer(text, add_special_tokens=False)["input_ids"]``).
        num_prompts: passkey prompts, the needle at depths (i + 0.5) / num_prompts; also the most windows of
            ``text_ids`` read.
        length: tokens per prompt (at most; whole filler sentences) and per text window.
        seed: seed of the keys (5-digit numbers).
        text_ids: a 1-D token stream of ordinary text for the ``beyond_window`` score (None: not measured).
        sinks, window: the sinks + window a streaming head keeps (DuoAttention: 4 + 128 here).
        sliding_layers: ``PolyAttnConfig.sliding_layers`` of the conversion the heads are for: with 'exact' a model's
            sliding-window layers stay exact softmax and are no candidates (``HeadScores.layers``).

    Returns: :class:`HeadScores` with ``retrieval`` and ``beyond_window`` of shape (num_layers, num_kv_heads) (every
    layer scored) and ``layers``, the candidate layers.
    """
    num_prompts = check_int("num_prompts", num_prompts, 1)
    length = check_int("length", length, 2)
    seed = check_int("seed", seed, 0)
    sinks, window = check_int("sinks", sinks, 0), check_int("window", window, 1)
    from ..config import SLIDING_LAYERS
    from ..integration.layout import converted_layers

    check_choice("sliding_layers", sliding_layers, SLIDING_LAYERS)
    layers = _attention_layers(model)
    candidates = converted_layers(model, sliding_layers)
    rng = random.Random(seed)
    prompts = [passkey_prompt(tokenizer, length=length, depth=(i + 0.5) / num_prompts,
                              key=str(rng.randint(10000, 99999))) for i in range(num_prompts)]
    text = None
    if text_ids is not None:
        text = [int(t) for t in (text_ids.flatten().tolist() if isinstance(text_ids, torch.Tensor) else text_ids)]
        if len(text) <= sinks + window:
            raise ValueError(f"text_ids must hold more than sinks + window = {sinks + window} tokens (a query with a "
                             f"key beyond them), got {len(text)}")

    def mass_on_needle(p: PasskeyPrompt) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda w: w[:, p.query_positions][:, :, p.needle_positions].sum(-1).mean(-1)

    with _eager(model):
        retrieval = sum(_per_kv_head(model, layers, p.ids, mass_on_needle(p)) for p in prompts) / num_prompts
        beyond, chunks = None, []
        if text is not None:
            chunks = [c for c in (text[i:i + length] for i in range(0, len(text), length)) if len(c) > sinks + window]
            chunks = chunks[:num_prompts]
            beyond = sum(_per_kv_head(model, layers, c, _beyond_mass(len(c), sinks, window)) for c in chunks)
            beyond = beyond / len(chunks)
    return HeadScores(retrieval.float(), None if beyond is None else beyond.float(), num_prompts, length, seed,
                      sinks, window, [len(p.ids) for p in prompts], len(chunks),
                      None if len(candidates) == len(layers) else candidates)


def _beyond_mass(n: int, sinks: int, window: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Per query head: the mean over the queries that have such keys of the mass on keys j >= sinks with
    i - j >= window (neither a sink nor among the query's last ``window`` keys, itself included)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    far = (j >= sinks) & (i - j >= window)
    rows = far.any(-1)

    def reduce(w: torch.Tensor) -> torch.Tensor:
        f = far.to(w.device)
        return (w * f).sum(-1)[:, rows.to(w.device)].mean(-1)

    return reduce


def select_heads(scores: torch.Tensor | HeadScores, k: int) -> tuple[tuple[int, int], ...]:
    """The ``k`` (layer, kv_head) pairs with the highest scores, best first (ties: the lower layer, then head, first);
    a :class:`HeadScores` gives its retrieval scores, among its candidate layers (``HeadScores.layers``: the layers
    the kind converts). For ``PolyAttnConfig(softmax_heads=...)``."""
    candidates = None
    if isinstance(scores, HeadScores):
        scores, candidates = scores.retrieval, scores.layers
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        shown = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a 2-D float tensor (num_layers, num_kv_heads), got {shown}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite, got NaN or inf")
    heads = scores.shape[1]
    keys = -scores.double()
    if candidates is not None:  # layers kept exact (sliding windows) last, and never taken
        keys[[i for i in range(scores.shape[0]) if i not in candidates]] = float("inf")
    k = check_int("k", k, 0, scores.numel() if candidates is None else len(candidates) * heads)
    order = torch.sort(keys.flatten(), stable=True).indices[:k]
    return tuple((int(i) // heads, int(i) % heads) for i in order)


def heads_for_share(scores: HeadScores, share: float) -> int:
    """The fewest candidate kv heads (``HeadScores.layers``) whose retrieval scores, best first, hold at least
    ``share`` of the candidates' total (scores below 0 count as 0); 0 when no head scores above 0."""
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0.0 < share <= 1.0:
        raise ValueError(f"share must be a number in (0, 1], got {share!r}")
    rows = scores.retrieval if scores.layers is None else scores.retrieval[list(scores.layers)]
    values = torch.sort(rows.double().clamp(min=0).flatten(), descending=True).values
    total = float(values.sum())
    if total <= 0.0:
        return 0
    # a small tolerance: a share the best heads hold exactly must not need one head more from rounding
    return int(torch.searchsorted(torch.cumsum(values, 0), share * total * (1 - 1e-12)).item()) + 1


def parse_head_pairs(text: str, name: str = "softmax_heads") -> list[list[int]]:
    """(layer, kv head) pairs from text: "6:0,7:2", a JSON list [[6, 0], [7, 2]], or @FILE: a JSON file holding such
    a list or the object ``hf-polyattn score-heads`` writes (its ``name`` entry). ``PolyAttnConfig`` validates the
    pairs themselves; ValueError for text that is none of these."""
    import json
    from pathlib import Path

    text = text.strip()
    if text.startswith("@"):
        try:
            data = json.loads(Path(text[1:]).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read a JSON file: {err}") from None
        return data.get(name) if isinstance(data, dict) and name in data else data
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError as err:
            raise ValueError(f"not JSON: {err}") from None
    pairs = []
    for item in (t for t in text.split(",") if t.strip()):
        layer, _, head = item.partition(":")
        try:
            pairs.append([int(layer), int(head)])
        except ValueError:
            raise ValueError(f"expected LAYER:HEAD pairs, e.g. {name}=6:0,7:2 (or a JSON list, or "
                             "@scores.json)") from None
    return pairs
