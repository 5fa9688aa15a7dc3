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
# Below this many rows a chat model's layers take torch's own product (MKL's matrix-vector
# path): one decode row ran 0.4-0.9x as fast prepacked, four rows 1.0-2.0x, on the Intel Xeon
# (AVX-512) of docs/benchmarks.md (engine/onednn.py's layers measured one by one).
PLAIN_BELOW = 4


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
        # Rows below which torch's own product runs (0: never; a traced forward, as the
        # embeddings engine's, must not branch on its input).
        self.plain_below = 0

    def with_activation(self, activation: str) -> PrepackedLinear:
        """The same product (the same packed weight) with `activation` applied in its pass."""
        # A shell on the meta device (no weight allocated nor initialised), given this one's.
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        packed: Any = self.packed  # a buffer (mypy reads nn.Module's attributes as Tensor | Module)
        return PrepackedLinear(linear, packed, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain_below and self.activation == "none" and x.numel() < self.plain_below * self.in_features:
            return nn.functional.linear(x, self.weight, self.bias)
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


def prepack_output_head(model: nn.Module, plain_below: int = 0) -> bool:
    """A causal LM's output head (vocabulary x hidden: the largest linear of a small
    model, run once per decode row) swapped for its prepacked copy (torch's own product
    below `plain_below` rows). True if it was."""
    get, put = getattr(model, "get_output_embeddings", None), getattr(model, "set_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or not callable(put):
        return False
    swapped = prepacked(head)
    if swapped is head or not isinstance(swapped, PrepackedLinear):
        return False
    swapped.plain_below = plain_below
    put(swapped)
    return True


def prepack_linears(model: nn.Module, plain_below: int = 0) -> int:
    """Every `nn.Linear` of `model` swapped for its prepacked copy where that runs (torch's
    own product below `plain_below` rows: never in a model to be traced); how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swapped = prepacked(child)
            if swapped is not child and isinstance(swapped, PrepackedLinear):
                swapped.plain_below = plain_below
                setattr(parent, name, swapped)
                count += 1
    return count


class _Outputs:
    """The products one fused call computed for one input, until each part is taken."""

    __slots__ = ("input", "left", "parts")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.parts: list[torch.Tensor] = []
        self.left = 0


class FusedProjections(nn.Module):
    """The first of several linear layers of one input (attention's q, k and v), computing
    all of them in one prepacked product and keeping the others' outputs for their own
    layers (`TakenProjection`) to return when called with the same tensor."""

    def __init__(self, linears: list[nn.Linear], outputs: _Outputs) -> None:
        super().__init__()
        first = linears[0]
        self.in_features, self.out_features = first.in_features, first.out_features
        self.weight, self.bias = first.weight, first.bias  # the first layer's, as it was
        self.sizes = [lin.out_features for lin in linears]
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = None if first.bias is None else torch.cat([lin.bias.detach() for lin in linears])
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), persistent=False)
        self.register_buffer("fused_bias", bias, persistent=False)
        self.outputs = outputs
        self.product = _scripted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < PLAIN_BELOW * self.in_features:  # a row or two: each layer its own product
            self.outputs.input, self.outputs.parts = None, []
            return nn.functional.linear(x, self.weight, self.bias)
        parts = list(self.product(x, self.packed, self.fused_bias, "none").split(self.sizes, dim=-1))
        self.outputs.input, self.outputs.parts, self.outputs.left = x, parts, len(parts) - 1
        return parts[0]


class TakenProjection(nn.Module):
    """A linear layer whose output a `FusedProjections` computed: returned when called on
    the same tensor (the one kept holds it alive, so no other can be it), else computed."""

    def __init__(self, linear: nn.Linear, outputs: _Outputs, index: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.outputs, self.index = outputs, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self.outputs
        if held.input is not x or not held.parts:
            return nn.functional.linear(x, self.weight, self.bias)
        out = held.parts[self.index]
        held.left -= 1
        if held.left <= 0:  # every part taken: let go of the step's tensors
            held.input, held.parts = None, []
        return out


class GatedMLP(nn.Module):
    """A gated feed-forward block (Llama's `down(act(gate(x)) * up(x))`, and every family
    built the same way) with its gate and up products as one prepacked product."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act_fn: nn.Module) -> None:
        super().__init__()
        self.width = gate.out_features
        weight = torch.cat([gate.weight.detach(), up.weight.detach()])
        shell = nn.Linear(gate.in_features, 2 * self.width, bias=gate.bias is not None, device="meta")
        shell.weight = nn.Parameter(weight, requires_grad=False)
        if gate.bias is not None and up.bias is not None:
            shell.bias = nn.Parameter(torch.cat([gate.bias.detach(), up.bias.detach()]), requires_grad=False)
        self.gate_up = PrepackedLinear(shell)
        # Their own weights (shared, not copied), for a row or two.
        self.gate_weight, self.gate_bias, self.up_weight, self.up_bias = gate.weight, gate.bias, up.weight, up.bias
        self.down_proj, self.act_fn = prepacked(down), act_fn
        if isinstance(self.down_proj, PrepackedLinear):
            self.down_proj.plain_below = PLAIN_BELOW

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < PLAIN_BELOW * self.gate_weight.shape[1]:
            gate = nn.functional.linear(x, self.gate_weight, self.gate_bias)
            return self.down_proj(self.act_fn(gate) * nn.functional.linear(x, self.up_weight, self.up_bias))
        gate, up = self.gate_up(x).split(self.width, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = float(want.abs().max()) or 1.0
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


def _linears(block: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """`block`'s linear layers of these names, where all are plain fp32 CPU layers of one
    input width, all with a bias or none."""
    found = [getattr(block, n, None) for n in names]
    linears = [x for x in found if type(x) is nn.Linear and available(x.weight)]
    if len(linears) < len(names):
        return None
    same_input = len({x.in_features for x in linears}) == 1
    return linears if same_input and len({x.bias is None for x in linears}) == 1 else None


def fuse_projections(model: nn.Module) -> int:
    """A decoder's products of one input run as one prepacked product each: every
    attention block's q, k and v projections (`q_proj`, `k_proj`, `v_proj`), and every
    gated feed-forward block's gate and up projections (`gate_proj`, `up_proj`, with its
    `down_proj` and `act_fn`): one pass over the input and one call where there were three
    or two. Each feed-forward block swapped is checked on sample rows against the block as
    it was, each fused q/k/v against the three products, and left as it was where they
    differ. How many blocks were fused."""
    count = 0
    for parent in list(model.modules()):
        for name, block in list(parent.named_children()):
            gated = _linears(block, ("gate_proj", "up_proj"))
            down, act = getattr(block, "down_proj", None), getattr(block, "act_fn", None)
            if gated is not None and type(down) is nn.Linear and isinstance(act, nn.Module):
                count += _swap_mlp(parent, name, block, [*gated, down], act)
            elif (qkv := _linears(block, ("q_proj", "k_proj", "v_proj"))) is not None:
                count += _fuse_qkv(block, qkv)
    return count


def _swap_mlp(parent: nn.Module, name: str, block: nn.Module, linears: list[nn.Linear], act: nn.Module) -> int:
    try:
        gate, up, down = linears
        fused = GatedMLP(gate, up, down, act)
        with torch.inference_mode():
            x = torch.randn((2, 7, linears[0].in_features), generator=torch.Generator().manual_seed(0))
            ok = _same(fused(x), block(x))
    except Exception as exc:  # a block whose forward is not the gated product, an op this torch lacks
        log.warning("feed-forward products not fused: %s", exc)
        return 0
    if not ok:
        log.warning("a fused feed-forward block differs from %s; keeping it", type(block).__name__)
        return 0
    setattr(parent, name, fused)
    return 1


def _fuse_qkv(block: nn.Module, linears: list[nn.Linear]) -> int:
    try:
        outputs = _Outputs()
        first = FusedProjections(linears, outputs)
        taken = [TakenProjection(lin, outputs, i) for i, lin in enumerate(linears) if i]
        with torch.inference_mode():
            x = torch.randn((2, 7, linears[0].in_features), generator=torch.Generator().manual_seed(0))
            got = [first(x), *(t(x) for t in taken)]
            want = [nn.functional.linear(x, lin.weight, lin.bias) for lin in linears]
        ok = all(_same(g, w) for g, w in zip(got, want, strict=True))
    except Exception as exc:  # an op this torch lacks or refuses for this shape
        log.warning("attention projections not fused: %s", exc)
        return 0
    if not ok:
        log.warning("fused attention projections differ from torch's; keeping them apart")
        return 0
    block.q_proj, block.k_proj, block.v_proj = first, *taken
    return 1
