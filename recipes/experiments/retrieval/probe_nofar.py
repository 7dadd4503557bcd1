"""Probe for issue 32: do the 'vault' answers at 4k depend on the kernel part at all? `hf-polyattn eval` with the
kernel part switched off (``window_mix`` set to 0 in every layer at its first sparse-cache call, as
``probe_selection``'s ``_nofar`` variants do: it multiplies the kernel part in the prefill's rows and the decoding
ring's): the sinks, the window, the pending block and the sparse cache alone, exactly; the evicted keys still fold into
a state nothing reads, and the streaming selection still scores them against it. Attention transfer trains only the
kernel part's parameters (feature maps, projections, q / k norms, gates, ``window_mix``), so answers that do not move
here are answers no transfer of those parameters can move, but through the streaming selection.

    python -m recipes.experiments.retrieval.probe_nofar MODEL [hf-polyattn eval arguments]
"""

from __future__ import annotations

import sys

import torch


def kernel_part_off(module) -> None:
    """``window_mix`` 0 in one layer: it multiplies the kernel part in the prefill's rows and the decoding ring's."""
    if not module.config.window_mix:
        raise NotImplementedError("switching the kernel part off needs window_mix (the factor set to 0)")
    with torch.no_grad():
        module.window_mix.zero_()


def install() -> None:
    from hf_polyattn.ops.sparse import SparseMixin

    original = SparseMixin._sparse_call

    def sparse_call(self, *args, **kwargs):
        kernel_part_off(self)
        return original(self, *args, **kwargs)

    SparseMixin._sparse_call = sparse_call


def main(argv: list[str] | None = None) -> int:
    from hf_polyattn.cli import main as cli_main

    install()
    return cli_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
