"""Linear layers through oneDNN with their weights prepacked once, at load.

On the CPU torch runs an fp32 `nn.Linear` through MKL's sgemm, which repacks the weight on
every call and, on this project's AMD EPYC hosts, runs far from the core's peak. oneDNN's
linear with a weight reordered once into its blocked layout (the path torch.compile's CPU
backend and vLLM's CPU build take) does the same product faster, most of all where the
weight is large and the rows few: a chat model's output head (vocabulary x hidden, the
built-in model's 8,192 x 256) at a decode step's 32 rows took 2.0-4.3 ms with MKL and
1.2-1.7 ms prepacked (one thread); the embeddings encoder's forward 1.1-1.3x
(docs/benchmarks-history.md, "Chunks priced by their tokens, and a prepacked output head").

Only on the CPU, in float32, where torch has the two oneDNN ops; each layer swapped in is
checked at load against `F.linear` on sample rows (a mismatch, or an op this torch lacks,
keeps the layer as it was). The products differ from MKL's in the last bits (another
summation order), as two BLAS builds do.

What the packed copy does not follow: the weight changed in place after the swap (a
LoRA merge, `load_state_dict`), a later `.to()` of another dtype or device, `deepcopy`
(an opaque oneDNN tensor has no storage to copy). The engines swap layers once a model
is loaded and its weights are final, and never move or copy it afterwards. The packed
copy takes the weight's memory again (an embedding tied to the head stays as it is).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, List, Optional, Union  # noqa: UP035 (TorchScript reads these annotations)

import torch
from torch import nn

log = logging.getLogger("ferry.engine")

ROWS_HINT = 32  # rows the packing is tuned for; any row count runs


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], attr: str) -> torch.Tensor:  # noqa: UP045
    # Scripted (`_scripted`) so that a traced model (engine/embeddings.py) records the call:
    # tracing alone cannot type the op's empty `Scalar?[]` argument (a TorchScript `number`).
    # `attr` is the activation applied to the product in the same pass ("none", or "gelu":
    # erf's, algorithm "none" in oneDNN's terms).
    scalars: List[Optional[Union[int, float, complex]]] = []  # noqa: UP006, UP007, UP045
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, scalars, "none" if attr == "gelu" else "")


@functools.cache
def _scripted() -> Any:
    """`_linear` compiled, once, when a layer is first swapped (a torch without the op
    fails here, inside `prepacked`'s check, not at import)."""
    with warnings.catch_warnings():  # TorchScript is deprecated (so is the trace it serves)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_linear)


class PrepackedLinear(nn.Module):
    """`linear` with its weight reordered for oneDNN. The original weight stays the
    module's `weight` (a tied embedding shares it; state dicts and model utilities see it);
    the packed copy is what the forward reads."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor | None = None, activation: str = "none") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)
        # A buffer, not a plain attribute: a traced graph reads it as the module's own (a plain
        # tensor attribute would be baked in as a constant, which an opaque tensor cannot be).
        self.register_buffer("packed", packed, persistent=False)
        self.activation = activation
        self.product = _scripted()

    def with_activation(self, activation: str) -> PrepackedLinear:
        """The same product (the same packed weight) with `activation` applied in its pass."""
        # A shell on the meta device (no weight allocated nor initialised), given this one's.
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        packed: Any = self.packed  # a buffer (mypy reads nn.Module's attributes as Tensor | Module)
        return PrepackedLinear(linear, packed, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.packed, self.bias, self.activation)


def available(weight: torch.Tensor) -> bool:
    """Whether a layer of this weight can run prepacked here."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
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
    except Exception as exc:  # an op this torch build lacks or calls otherwise, or refuses for this shape
        log.warning("linear layers not prepacked: %s", exc)
    return linear


def _fusable(module: nn.Module) -> str | None:
    """oneDNN's name for the activation `module` computes, where a fused product gives the
    same: GELU with erf (transformers' GELUActivation as BERT's `gelu` builds it). Not ReLU:
    oneDNN's fused ReLU turns a NaN into 0 where torch's keeps it, so a row that overflowed
    would come out as a finite vector instead of a visibly broken one."""
    if type(module) is nn.GELU and module.approximate == "none":
        return "gelu"
    if type(module).__name__ == "GELUActivation" and getattr(module, "act", None) is nn.functional.gelu:
        return "gelu"
    return None


def fuse_activations(model: nn.Module) -> int:
    """Each feed-forward block of the BERT family (a module with a prepacked `dense` and its
    `intermediate_act_fn`: BERT, RoBERTa, XLM-R, ELECTRA, MPNet and the embedding models built
    on them) with its activation run in the product's pass, not as a pass of its own over the
    widest activations of the layer (4% of all-MiniLM-L6-v2's forward). Each swap is checked on
    sample rows against the block as it was, and undone where it differs; how many."""
    count = 0
    for block in list(model.modules()):
        dense, act = getattr(block, "dense", None), getattr(block, "intermediate_act_fn", None)
        if not isinstance(dense, PrepackedLinear) or dense.activation != "none" or not isinstance(act, nn.Module):
            continue
        name = _fusable(act)
        if name is None:
            continue
        try:
            with torch.inference_mode():
                x = torch.randn((2, 7, dense.in_features), generator=torch.Generator().manual_seed(0))
                want = block(x)
                block.dense, block.intermediate_act_fn = dense.with_activation(name), nn.Identity()
                got = block(x)
            scale = float(want.abs().max()) or 1.0
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale):
                count += 1
                continue
            log.warning("a fused %s differs from the product and its activation apart; keeping them apart", name)
        except Exception as exc:  # a block whose forward is not product-then-activation, an op this torch lacks
            log.warning("activation not fused: %s", exc)
        block.dense, block.intermediate_act_fn = dense, act
    return count


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
