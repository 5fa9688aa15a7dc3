"""The embeddings engine: the traced graph must be the model, and anything that does not
trace faithfully must run eager. These run batches padded (`packed=False`); packed rows are
tests/engine/test_packed_encoder.py's."""

from __future__ import annotations

import numpy as np
import pytest

TEXTS = [
    "a ferry",
    "a much longer sentence about ferries crossing a wide grey river at dawn",
    "queues",
    "latency budgets decide when a batch must go, not a timer alone",
]


@pytest.fixture(scope="module")
def traced():
    from engine.embeddings import HFEmbeddingEngine

    return HFEmbeddingEngine(torch_threads=1, packed=False)


def eager_vectors(engine, texts: list[str], model=None) -> np.ndarray:
    """Each text alone through the eager model (the engine's, or `model`): no padding, no graph."""
    import torch

    model = engine.model if model is None else model
    out = []
    for ids in engine.tokenize(texts):
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        v = torch.nn.functional.normalize(hidden.last_hidden_state.mean(1), dim=1)
        out.append(v[0].numpy())
    return np.stack(out)


def test_default_model_runs_as_a_graph_that_matches_the_eager_model(traced):
    assert traced.graph == "torchscript"
    for batch in (TEXTS, TEXTS[:1], TEXTS[::-1] * 3):  # padded, single, shapes never traced
        got = np.stack([r.vector for r in traced.embed(traced.tokenize(batch))])
        np.testing.assert_allclose(got, eager_vectors(traced, batch), atol=1e-5)


def test_a_model_that_refuses_tracing_runs_eager(monkeypatch):
    import torch

    from engine.embeddings import HFEmbeddingEngine

    def refuse(*a, **kw):
        raise RuntimeError("this model cannot be traced")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    engine = HFEmbeddingEngine(torch_threads=1, packed=False)
    assert engine.graph == "eager"
    got = np.stack([r.vector for r in engine.embed(engine.tokenize(TEXTS))])
    np.testing.assert_allclose(got, eager_vectors(engine, TEXTS), atol=1e-5)


def test_a_graph_that_differs_from_the_model_is_not_used(monkeypatch):
    """A forward that branches in Python on its input traces one branch only; the check at
    load sees the other shapes answer differently and keeps the model eager."""
    import torch

    import engine.embeddings as emb

    real = emb._last_hidden

    class DataDependent(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = real(model)

        def forward(self, input_ids, attention_mask):
            hidden = self.inner(input_ids, attention_mask)
            if bool(attention_mask.all()):  # baked in as whichever branch the example took
                return hidden
            return hidden * 2.0

    monkeypatch.setattr(emb, "_last_hidden", DataDependent)
    engine = emb.HFEmbeddingEngine(torch_threads=1, packed=False)
    assert engine.graph == "eager"


def test_torchscript_can_be_turned_off():
    from engine.embeddings import HFEmbeddingEngine

    assert HFEmbeddingEngine(torch_threads=1, torchscript=False, packed=False).graph == "eager"


def test_a_graph_that_fails_at_run_time_falls_back_to_eager_for_good():
    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=1, packed=False)
    assert engine.graph == "torchscript"

    def broken(ids, mask):
        raise RuntimeError("shape the trace did not foresee")

    engine._forward = broken
    got = np.stack([r.vector for r in engine.embed(engine.tokenize(TEXTS))])
    np.testing.assert_allclose(got, eager_vectors(engine, TEXTS), atol=1e-5)
    assert engine.graph == "eager"


def test_a_row_whose_vector_is_not_finite_fails_alone(traced, monkeypatch):
    """A row that overflowed comes back as that item's error (JSON would carry its NaNs as
    nulls); its batch mates get their vectors."""
    forward = traced._forward

    def overflows_on_row_one(ids, mask):
        hidden = forward(ids, mask).clone()
        hidden[1, 0, 0] = float("inf")
        return hidden

    monkeypatch.setattr(traced, "_forward", overflows_on_row_one)
    results = traced.embed(traced.tokenize(TEXTS))
    assert isinstance(results[1], ValueError) and "not finite" in str(results[1])
    got = np.stack([results[i].vector for i in (0, 2, 3)])
    np.testing.assert_allclose(got, eager_vectors(traced, [TEXTS[i] for i in (0, 2, 3)]), atol=1e-5)


def test_out_of_memory_in_the_graph_is_left_to_the_batcher_to_split():
    import torch

    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=1, packed=False)

    def oom(ids, mask):
        raise torch.OutOfMemoryError("CUDA out of memory")

    engine._forward = oom
    with pytest.raises(torch.OutOfMemoryError):
        engine.embed(engine.tokenize(TEXTS))
    assert engine.graph == "torchscript"


def test_the_prepacked_graph_gives_the_vectors_of_the_model_as_loaded(traced):
    """Its linear layers run through oneDNN, prepacked (engine/onednn.py), inside the traced
    graph; each text's vector is that of the model as transformers loads it."""
    import torch
    from transformers import AutoModel

    from engine.embeddings import default_model_path
    from engine.onednn import PrepackedLinear, available

    if not available(torch.zeros(1)):
        pytest.skip("torch without oneDNN on this CPU")
    assert traced.graph == "torchscript" and traced.prepacked > 0
    assert sum(isinstance(m, PrepackedLinear) for m in traced.model.modules()) == traced.prepacked
    assert not any(type(m) is torch.nn.Linear for m in traced.model.modules())
    plain = AutoModel.from_pretrained(default_model_path()).eval()
    assert not any(isinstance(m, PrepackedLinear) for m in plain.modules())
    got = np.stack([r.vector for r in traced.embed(traced.tokenize(TEXTS))])
    np.testing.assert_allclose(got, eager_vectors(traced, TEXTS, plain), atol=1e-5)
