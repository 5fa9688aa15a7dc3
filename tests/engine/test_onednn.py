"""Linear layers prepacked for oneDNN: the same products as torch's linear, the chat model's
greedy tokens those of its own head, and an encoder's feed-forward activation fused into its
product only where that gives the block's own output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine.onednn import PrepackedLinear, available, fuse_activations, prepack_linears, prepack_output_head, prepacked

pytestmark = pytest.mark.skipif(not available(torch.zeros(1)), reason="torch without oneDNN on this CPU")


@pytest.mark.parametrize("bias", [False, True])
def test_a_prepacked_linear_computes_torchs_product_for_any_rows(bias):
    linear = nn.Linear(64, 300, bias=bias)
    swapped = prepacked(linear)
    assert isinstance(swapped, PrepackedLinear)
    assert swapped.weight is linear.weight  # shared, not copied: a tied embedding keeps working
    with torch.inference_mode():
        for shape in ((1, 64), (7, 64), (129, 64), (2, 5, 64), (0, 64)):
            x = torch.randn(shape)
            got, want = swapped(x), linear(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_layers_it_cannot_run_are_kept_as_they_are():
    half = nn.Linear(8, 8).to(torch.bfloat16)
    assert prepacked(half) is half
    conv = nn.Conv1d(2, 2, 1)
    assert prepacked(conv) is conv

    class Sub(nn.Linear):  # a subclass may compute something else: left alone
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    sub = Sub(8, 8)
    assert prepacked(sub) is sub


def test_a_layer_whose_prepacked_product_differs_is_kept(monkeypatch):
    import engine.onednn as onednn

    monkeypatch.setattr(onednn.PrepackedLinear, "forward", lambda self, x: torch.zeros(*x.shape[:-1], 16))
    linear = nn.Linear(8, 16)
    assert prepacked(linear) is linear


def test_every_linear_of_a_module_is_swapped_in_place():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        want = model(x)
        assert prepack_linears(model) == 2
        torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-4)
    assert isinstance(model[0], PrepackedLinear) and isinstance(model[2][0], PrepackedLinear)


class Intermediate(nn.Module):
    """BERT's feed-forward block as transformers writes it: `dense`, then its activation."""

    def __init__(self, act: nn.Module, then: float = 0.0) -> None:
        super().__init__()
        self.dense, self.intermediate_act_fn, self.then = nn.Linear(16, 48), act, then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x) + self.then)


@pytest.mark.parametrize(
    ("act", "fused"),
    [(nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), None), (nn.SiLU(), None), (nn.ReLU(), None)],
)
def test_a_feed_forward_activation_runs_in_the_products_pass_where_oneDNN_has_it(act, fused):
    block = nn.Sequential(Intermediate(act))
    x = torch.randn(2, 9, 16)
    with torch.inference_mode():
        want = block(x)
        prepack_linears(block)
        packed = block[0].dense.packed
        assert fuse_activations(block) == (1 if fused else 0)
        torch.testing.assert_close(block(x), want, rtol=1e-4, atol=1e-4)
    inner = block[0]
    assert inner.dense.activation == (fused or "none")
    assert isinstance(inner.intermediate_act_fn, nn.Identity) == bool(fused)
    assert inner.dense.packed is packed  # the same packed weight, not a second copy


def test_a_nan_through_the_feed_forward_block_stays_nan():
    """ReLU is not fused (oneDNN's fused ReLU makes a NaN 0); a fused GELU keeps it."""
    for act in (nn.GELU(), nn.ReLU()):
        block = Intermediate(act)
        prepack_linears(block)
        fuse_activations(block)
        x = torch.randn(1, 3, 16)
        x[0, 1, 4] = float("nan")
        with torch.inference_mode():
            out = block(x)
        assert out[0, 1].isnan().all() and not out[0, [0, 2]].isnan().any()


def test_a_block_that_is_not_product_then_activation_is_left_as_it_was():
    """A block that adds between its product and its activation: the fused product differs on
    the check's sample rows, so the swap is undone."""
    block = Intermediate(nn.GELU(), then=-0.5)
    prepack_linears(block)
    dense, act = block.dense, block.intermediate_act_fn
    assert fuse_activations(block) == 0
    assert block.dense is dense and block.intermediate_act_fn is act


def test_the_encoders_feed_forward_blocks_are_fused_and_its_vectors_unchanged():
    from engine.embeddings import HFEmbeddingEngine

    fused = HFEmbeddingEngine(torch_threads=1, packed=False)
    apart = HFEmbeddingEngine(torch_threads=1, packed=False, prepacked_linears=False)
    assert fused.fused == fused.model.config.num_hidden_layers and apart.fused == 0
    texts = ["ferry", "a longer sentence about the river crossing at dawn " * 4]
    got = np.stack([r.vector for r in fused.embed(fused.tokenize(texts))])
    want = np.stack([r.vector for r in apart.embed(apart.tokenize(texts))])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_chat_engines_head_is_prepacked_and_greedy_tokens_are_the_models_own(_shared_engine, tiny_chat_dir):
    """The engine's head runs prepacked; a plain greedy loop through the model with its own
    head and with the prepacked one picks the same tokens."""
    from transformers import AutoModelForCausalLM

    assert _shared_engine.head_prepacked
    assert isinstance(_shared_engine.model.get_output_embeddings(), PrepackedLinear)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_chat_dir), dtype=torch.float32).eval()
    ids = torch.tensor([_shared_engine.encode_chat([{"role": "user", "content": "When does the ferry leave?"}])])

    def greedy(steps: int = 24) -> list[int]:
        seq = ids
        with torch.inference_mode():
            for _ in range(steps):
                nxt = model(input_ids=seq).logits[0, -1].argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        return seq[0, ids.shape[1] :].tolist()

    own = greedy()
    assert prepack_output_head(model)
    assert greedy() == own


def test_no_prepacked_linears_keeps_torchs_own_layers(tiny_chat_dir):
    """`--no-prepacked-linears`: neither engine swaps a layer."""
    from engine.embeddings import HFEmbeddingEngine
    from engine.generation import HFGenerationEngine

    chat = HFGenerationEngine(str(tiny_chat_dir), max_running=2, prepacked_linears=False)
    assert not chat.head_prepacked and type(chat.model.get_output_embeddings()) is nn.Linear
    encoder = HFEmbeddingEngine(torch_threads=1, prepacked_linears=False)
    assert encoder.prepacked == 0 and not any(isinstance(m, PrepackedLinear) for m in encoder.model.modules())
    assert encoder.graph == "torchscript"


def test_a_decoders_projections_of_one_input_run_as_one_product_with_the_models_logits(tiny_chat_dir):
    """Every attention block's q/k/v and every gated feed-forward block's gate/up become one
    product each; the model's logits over a prompt (and its greedy tokens) are its own."""
    from transformers import AutoModelForCausalLM

    from engine.onednn import FusedProjections, GatedMLP, TakenProjection, fuse_projections

    model = AutoModelForCausalLM.from_pretrained(str(tiny_chat_dir), dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        layers = model.config.num_hidden_layers
        assert fuse_projections(model) == 2 * layers
        assert prepack_linears(model) == layers + 1  # each o_proj, and the head
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    block = model.model.layers[0]
    assert isinstance(block.mlp, GatedMLP) and isinstance(block.self_attn.q_proj, FusedProjections)
    assert isinstance(block.self_attn.k_proj, TakenProjection) and isinstance(block.self_attn.o_proj, PrepackedLinear)


def test_a_taken_projection_called_on_another_input_computes_its_own_product():
    """k and v come from the fused call only for the tensor it ran on; any other input (or
    a call before it) gets the layer's own product, and nothing is kept once all are taken."""
    from engine.onednn import FusedProjections, TakenProjection, _fuse_qkv

    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)
    original = [block.q_proj, block.k_proj, block.v_proj]
    assert _fuse_qkv(block, list(original)) == 1
    q, k, v = block.q_proj, block.k_proj, block.v_proj
    assert isinstance(q, FusedProjections) and isinstance(k, TakenProjection)
    x, other = torch.randn(3, 16), torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(k(other), original[1](other))  # before any fused call
        torch.testing.assert_close(q(x), original[0](x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v(other), original[2](other))  # another input
        torch.testing.assert_close(k(x), original[1](x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v(x), original[2](x), rtol=1e-4, atol=1e-4)
    assert k.outputs.input is None and k.outputs.parts == []


def test_a_feed_forward_block_that_computes_something_else_is_left_as_it_is():
    """Fusion keeps a block's `act_fn` and checks the whole block: one whose forward is not
    `down(act(gate(x)) * up(x))` (here the activation on the other product) stays."""
    from engine.onednn import GatedMLP, fuse_projections

    class Swapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 32), nn.Linear(8, 32), nn.Linear(32, 8)
            self.act_fn = nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))

    class Plain(Swapped):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    model = nn.ModuleDict({"odd": Swapped(), "plain": Plain()})
    assert fuse_projections(model) == 1
    assert isinstance(model["plain"], GatedMLP) and isinstance(model["odd"], Swapped)


def test_no_fused_projections_prepacks_only_the_head(tiny_chat_dir):
    from engine.generation import HFGenerationEngine

    chat = HFGenerationEngine(str(tiny_chat_dir), max_running=2, fused_projections=False)
    assert chat.fused == 0 and chat.head_prepacked
    assert type(chat.model.model.layers[0].self_attn.q_proj) is nn.Linear
