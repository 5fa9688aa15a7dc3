"""Embeddings batches with their rows packed into one (engine/packed_encoder.py): the vectors
must be the model's, whatever the rows' lengths, and a model that cannot run packed keeps
padding."""

from __future__ import annotations

import numpy as np
import pytest

from .test_embeddings import TEXTS, eager_vectors

MIXED = [
    "ferry",
    "a much longer sentence about ferries crossing a wide grey river at dawn, with gulls " * 3,
    "queues",
    "latency budgets decide when a batch must go",
    "word " * 400,  # truncated at the model's limit
    "one more",
    "and a sentence of middling length about batching by length",
    "x",
]


@pytest.fixture(scope="module")
def packed():
    from engine.embeddings import HFEmbeddingEngine

    return HFEmbeddingEngine(torch_threads=1)


def vectors(engine, texts):
    return np.stack([r.vector for r in engine.embed(engine.tokenize(texts))])


def test_the_default_model_runs_packed_rows_as_a_traced_graph(packed):
    import torch

    assert packed.packed and packed.graph == "torchscript"
    assert isinstance(packed._packed, torch.jit.ScriptModule)


def test_packed_attention_runs_through_the_kernel_and_gives_sdpas_vectors(packed):
    """engine/rows_attention.py's kernel where it builds (it does on the test machine), with
    the vectors of SDPA per row (`native_attention=False`, `--no-native-attention`)."""
    from engine.embeddings import HFEmbeddingEngine
    from engine.rows_attention import rows_attention_kernel

    assert packed._packed.kernel is rows_attention_kernel()[0]
    assert "attention by Ferry's kernel" in packed.rows
    sdpa = HFEmbeddingEngine(torch_threads=1, native_attention=False)
    assert sdpa.packed and sdpa._packed.kernel is None and "SDPA per row" in sdpa.rows
    np.testing.assert_allclose(vectors(packed, MIXED * 3), vectors(sdpa, MIXED * 3), atol=1e-6)


@pytest.mark.parametrize("texts", [MIXED, MIXED[:1], MIXED * 5, TEXTS[::-1]])
def test_packed_rows_give_each_text_its_own_vector(packed, texts):
    """One trace serves any number of rows of any lengths (the row loop is scripted, not
    unrolled): each vector equals the text embedded alone, with no padding."""
    np.testing.assert_allclose(vectors(packed, texts), eager_vectors(packed, texts), atol=1e-5)


def test_usage_counts_the_tokens_embedded(packed):
    ids = packed.tokenize(MIXED)
    assert [r.tokens for r in packed.embed(ids)] == [len(x) for x in ids]
    assert max(len(x) for x in ids) == packed.max_length


def test_packed_eager_when_torchscript_is_off():
    import torch

    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=1, torchscript=False)
    assert engine.packed and not isinstance(engine._packed, torch.jit.ScriptModule)
    np.testing.assert_allclose(vectors(engine, MIXED), eager_vectors(engine, MIXED), atol=1e-5)


def test_packing_can_be_turned_off():
    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=1, packed=False)
    assert not engine.packed and engine.model.config._attn_implementation == "sdpa"
    np.testing.assert_allclose(vectors(engine, MIXED), eager_vectors(engine, MIXED), atol=1e-5)


def test_a_packed_forward_that_differs_from_padding_is_not_used(monkeypatch):
    import engine.packed_encoder as pe
    from engine.embeddings import HFEmbeddingEngine

    real = pe.rows_attention

    def off_by_a_little(q, k, v, bounds, scale):
        return real(q, k, v, bounds, scale) * 1.01

    monkeypatch.setattr(pe, "rows_attention", off_by_a_little)
    monkeypatch.setattr(pe, "_kernel", lambda model, device: off_by_a_little)  # the kernel too
    engine = HFEmbeddingEngine(torch_threads=1)
    assert not engine.packed and engine.model.config._attn_implementation == "sdpa"
    np.testing.assert_allclose(vectors(engine, MIXED), eager_vectors(engine, MIXED), atol=1e-5)


def test_a_kernel_that_differs_at_load_leaves_packed_rows_to_sdpa(monkeypatch, caplog):
    import logging

    import engine.packed_encoder as pe
    from engine.embeddings import HFEmbeddingEngine

    def off_by_a_little(q, k, v, bounds, scale):
        return pe.rows_attention(q, k, v, bounds, scale) * 1.01

    monkeypatch.setattr(pe, "_kernel", lambda model, device: off_by_a_little)
    with caplog.at_level(logging.WARNING, logger="ferry.engine"):
        engine = HFEmbeddingEngine(torch_threads=1)
    assert "through the attention kernel differ" in caplog.text
    assert engine.packed and engine._packed.kernel is None
    np.testing.assert_allclose(vectors(engine, MIXED), eager_vectors(engine, MIXED), atol=1e-5)


def test_a_kernel_that_raises_at_load_leaves_packed_rows_to_sdpa(monkeypatch, caplog):
    import logging

    import engine.packed_encoder as pe
    from engine.embeddings import HFEmbeddingEngine

    def refuses(q, k, v, bounds, scale):
        raise RuntimeError("value head dim differs from the query's")

    monkeypatch.setattr(pe, "_kernel", lambda model, device: refuses)
    with caplog.at_level(logging.WARNING, logger="ferry.engine"):
        engine = HFEmbeddingEngine(torch_threads=1)
    assert "the attention kernel failed (RuntimeError" in caplog.text
    assert engine.packed and engine._packed.kernel is None  # packed, not padded
    np.testing.assert_allclose(vectors(engine, MIXED), eager_vectors(engine, MIXED), atol=1e-5)


def test_the_default_model_packs_in_bfloat16_and_gives_the_float32_vectors_to_rounding(packed):
    from engine.embeddings import HFEmbeddingEngine

    half = HFEmbeddingEngine(torch_threads=1, dtype="bfloat16")
    assert half.packed and str(half.model.dtype) == "torch.bfloat16"
    got, want = vectors(half, MIXED), vectors(packed, MIXED)
    cosine = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() > 0.999  # measured 0.9999 on the long-tail mix (docs/benchmarks.md)


def _tiny(kind: str, attention: str, dtype: str = "float32"):
    import torch
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        kind,
        vocab_size=1100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        attn_implementation=attention,
        **({"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64} if kind == "distilbert" else {}),
    )
    return AutoModel.from_config(config).to(getattr(torch, dtype)).eval()


@pytest.mark.parametrize(
    ("kind", "attention", "dtype", "packs"),
    [
        ("bert", "sdpa", "float32", True),
        ("distilbert", "sdpa", "float32", True),
        ("roberta", "sdpa", "float32", False),  # positions start after the padding id: packed ones differ, caught
        ("bert", "eager", "float32", False),  # packing goes through SDPA's attention interface only
        ("bert", "sdpa", "bfloat16", True),  # rounded in another order: within the half-precision check
        ("roberta", "sdpa", "bfloat16", False),  # a wrong position is caught in half precision too
    ],
)
def test_which_models_run_packed_is_decided_by_the_check(kind, attention, dtype, packs):
    import torch

    from engine.embeddings import _last_hidden
    from engine.packed_encoder import build_packed, pack_rows

    model = _tiny(kind, attention, dtype)
    impl = model.config._attn_implementation
    padded = _last_hidden(model)
    forward = build_packed(model, padded, name=kind, pad_id=1, device=torch.device("cpu"), trace=True)
    assert (forward is not None) == packs
    if not packs:
        assert model.config._attn_implementation == impl  # the padded forward as loaded
        return
    ids = [[1000 + i for i in range(n)] for n in (3, 20, 7)]
    with torch.inference_mode():
        got = forward(*pack_rows(ids, "cpu")[:3])
        for row, lo in zip(ids, (0, 3, 23), strict=True):
            alone = padded(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))[0]
            if dtype == "float32":
                torch.testing.assert_close(got[lo : lo + len(row)], alone, atol=1e-5, rtol=1e-5)
            else:  # each token within a few eps of its norm (engine/packed_encoder.py's check)
                diff = (got[lo : lo + len(row)].float() - alone.float()).norm(dim=-1)
                assert (diff / alone.float().norm(dim=-1)).max() < 4 * torch.finfo(model.dtype).eps


@pytest.mark.parametrize(
    "extra",
    [{"sliding_window": 64}, {"softcap": 30.0}, {"is_causal": True}, {"dropout": 0.1}, {"s_aux": "tensor"}],
)
def test_attention_that_is_more_than_each_row_over_its_tokens_is_refused(extra):
    """A sliding window (ModernBERT's local layers), soft-capping, causal or dropout is not
    what packed rows compute: the packed attention raises, so the check at load (which keeps
    a model that raises padded, as test_which_models_run_packed_is_decided_by_the_check
    shows) never adopts it. Without bounds (a padded batch) it is plain SDPA."""
    import torch

    from engine.packed_encoder import _attention

    q = k = v = torch.randn(1, 2, 10, 8)
    bounds = torch.tensor([0, 4, 10])
    module = torch.nn.Module()
    out, _ = _attention(module, q, k, v, None, ferry_bounds=bounds, scaling=0.35)
    assert out.shape == (1, 10, 2, 8)
    if extra.get("s_aux") == "tensor":
        extra = {"s_aux": torch.zeros(2)}  # attention sinks, a tensor per head
    with pytest.raises(ValueError, match="do not support"):
        _attention(module, q, k, v, None, ferry_bounds=bounds, scaling=0.35, **extra)
    # What a padded model's forward passes by default asks for nothing.
    out, _ = _attention(module, q, k, v, None, ferry_bounds=bounds, scaling=0.35, dropout=0.0, is_causal=False)
    assert out.shape == (1, 10, 2, 8)


def test_the_check_at_load_tries_a_row_at_the_model_limit(monkeypatch):
    """A model right on short rows but not on long ones (positions, windows) is caught."""
    import torch

    import engine.packed_encoder as pe
    from engine.embeddings import _last_hidden

    real = pe.rows_attention

    def wrong_past_64(q, k, v, bounds, scale):
        out = real(q, k, v, bounds, scale)
        return out * 1.01 if q.shape[2] > 100 else out

    monkeypatch.setattr(pe, "rows_attention", wrong_past_64)
    for limit, packs in ((0, True), (120, False)):
        model = _tiny("bert", "sdpa")
        forward = pe.build_packed(
            model,
            _last_hidden(model),
            name="l",
            pad_id=0,
            device=torch.device("cpu"),
            trace=False,
            max_length=limit,
            native_attention=False,
        )
        assert (forward is not None) == packs


def test_a_packed_graph_that_fails_at_run_time_pads_from_then_on():
    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=1)

    def broken(ids, positions, bounds):
        raise RuntimeError("a shape the check did not try")

    engine._packed = broken
    np.testing.assert_allclose(vectors(engine, MIXED), eager_vectors(engine, MIXED), atol=1e-5)
    assert not engine.packed and engine.graph == "torchscript"


def test_out_of_memory_in_the_packed_graph_is_left_to_the_batcher_to_split():
    import torch

    from engine.embeddings import HFEmbeddingEngine

    engine = HFEmbeddingEngine(torch_threads=1)
    real = engine._packed

    def oom(ids, positions, bounds):
        raise torch.OutOfMemoryError("CUDA out of memory")

    engine._packed = oom
    with pytest.raises(torch.OutOfMemoryError):
        engine.embed(engine.tokenize(TEXTS))
    engine._packed = real
    assert engine.packed
