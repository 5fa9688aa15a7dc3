"""Linear layers through oneDNN with their weights prepacked once, at load.

On the CPU torch runs an fp32 `nn.Linear` through MKL's sgemm, which repacks the weight on
every call and, on this project's AMD EPYC hosts, runs far from the core's peak. oneDNN's
linear with a weight reordered once into its blocked layout (the path torch.compile's CPU
backend and vLLM's CPU build take) does the same product faster, most of all where the
weight is large and the rows few: a chat model's output head (vocabulary x hidden) at a
decode step's 16-64 rows took 4.3 ms with MKL and 1.7 ms prepacked on the built-in model
(one thread); an encoder's layers at a batch's 256-1,024 tokens 1.1-1.4x, 1.3-1.8x with two
threads (docs/benchmarks.md).

Only on the CPU, in float32, where torch has oneDNN; each layer swapped in is checked at
load against `F.linear` on sample rows (a mismatch keeps the layer as it was). The result
differs from MKL's in the last bits (another summation order), as two BLAS builds do.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("ferry.engine")

ROWS_HINT = 32  # rows the packing is tuned for; any row count runs


class PrepackedLinear(nn.Module):
    """`linear` with its weight reordered for oneDNN. The original weight stays the
    module's `weight` (a tied embedding shares it; state dicts and model utilities see it);
    the packed copy is what the forward reads."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def available(weight: torch.Tensor) -> bool:
    """Whether a layer of this weight can run prepacked here."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def prepacked(linear: nn.Module) -> nn.Module:
    """`linear` as a PrepackedLinear where that runs here and gives its outputs (checked on
    sample rows); otherwise `linear` itself."""
    if type(linear) is not nn.Linear or not available(linear.weight):
        return linear
    try:
        swapped = PrepackedLinear(linear)
        with torch.inference_mode():
            x = torch.randn((3, 5, linear.in_features), generator=torch.Generator().manual_seed(0))
            got, want = swapped(x), nn.functional.linear(x, linear.weight, linear.bias)
        scale = float(want.abs().max()) or 1.0
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale):
            return swapped
        log.warning("a prepacked linear layer differs from torch's; keeping torch's")
    except RuntimeError as exc:  # an op this torch build lacks, or refuses for this shape
        log.warning("linear layers not prepacked: %s", exc)
    return linear


def prepack_output_head(model: nn.Module) -> bool:
    """A causal LM's output head (vocabulary x hidden: the largest linear of a small
    model, run once per decode row) swapped for its prepacked copy. True if it was."""
    get, put = getattr(model, "get_output_embeddings", None), getattr(model, "set_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or not callable(put):
        return False
    swapped = prepacked(head)
    if swapped is head:
        return False
    put(swapped)
    return True


def prepack_linears(model: nn.Module) -> int:
    """Every `nn.Linear` of `model` swapped for its prepacked copy where that runs; how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swapped = prepacked(child)
            if swapped is not child:
                setattr(parent, name, swapped)
                count += 1
    return count
