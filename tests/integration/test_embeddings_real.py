"""The real all-MiniLM-L6-v2 behind a real uvicorn: batching must not change answers."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

SENTENCES = [
    f"Sentence number {i} talks about {topic}."
    for i, topic in enumerate(
        ["ferries", "rivers", "harbours", "timetables", "latency", "throughput", "queues", "tokens"] * 8
    )
]
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def direct_embeddings(texts: list[str]) -> np.ndarray:
    """The model computed directly, one sentence at a time, sentence-transformers style."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from engine.embeddings import default_model_path

    path = default_model_path()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    out = []
    with torch.inference_mode():
        for t in texts:
            enc = tok([t], return_tensors="pt", truncation=True, max_length=256)
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            v = (hidden * mask).sum(1) / mask.sum(1)
            out.append(torch.nn.functional.normalize(v, dim=1)[0].numpy())
    return np.stack(out)


def scraped(url: str, name: str, labels: dict[str, str]) -> float:
    """One sample of the server's /metrics (with engine cores, the core's series are merged
    into that scrape, not held in the server's registry)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_64_concurrent_requests_batch_and_match_the_model(real_server):
    labels = {"model": MODEL, "phase": "embed"}
    before = scraped(real_server.url, "ferry_batch_size_items_count", labels)

    async def fire():
        async with httpx.AsyncClient(
            base_url=real_server.url, timeout=120, limits=httpx.Limits(max_connections=64)
        ) as c:
            return await asyncio.gather(
                *(c.post("/v1/embeddings", json={"model": MODEL, "input": s}) for s in SENTENCES)
            )

    responses = asyncio.run(fire())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:1]
    got = np.stack([np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32) for r in responses])
    want = direct_embeddings(SENTENCES)
    cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.9999
    batches = scraped(real_server.url, "ferry_batch_size_items_count", labels) - before
    items = scraped(real_server.url, "ferry_batch_size_items_sum", labels)
    assert batches < 64  # 64 requests rode in fewer batches
    assert max(int(r.headers["X-Ferry-Batch-Size"]) for r in responses) > 1
    assert items >= 64


def test_openai_client_embeddings(real_server):
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused")
    res = client.embeddings.create(model=MODEL, input=["hello ferry", "goodbye ferry"])
    assert [d.index for d in res.data] == [0, 1]
    assert len(res.data[0].embedding) == 384
    assert res.usage.prompt_tokens > 0
    # The client asks for base64 by default when numpy is present; both paths agree.
    floats = client.embeddings.create(model=MODEL, input="hello ferry", encoding_format="float").data[0].embedding
    np.testing.assert_allclose(floats, res.data[0].embedding, rtol=1e-5, atol=1e-6)
    models = {m.id for m in client.models.list()}
    assert MODEL in models


def test_inputs_given_as_token_ids_are_the_texts_own_vectors(real_server):
    """The openai client's token-id inputs (one list, or a list of lists): the model's ids
    for a text give that text's vector; an id outside its vocabulary is refused."""
    from transformers import AutoTokenizer

    from engine.embeddings import default_model_path

    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused")
    texts = ["hello ferry", "the river crossing at dawn"]
    ids = AutoTokenizer.from_pretrained(default_model_path())(texts)["input_ids"]
    by_text = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    np.testing.assert_allclose(
        [d.embedding for d in by_ids.data], [d.embedding for d in by_text.data], rtol=1e-5, atol=1e-6
    )
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[0].embedding, rtol=1e-5, atol=1e-6)
    r = httpx.post(real_server.url + "/v1/embeddings", json={"model": MODEL, "input": [101, 10**6, 102]}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_token_id"
