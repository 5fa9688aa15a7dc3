"""The shipped custom-model example (docs/examples/custom_model.py, a zero-shot topic
classifier over the real all-MiniLM-L6-v2 weights) behind a real uvicorn, called by Triton's
own client unchanged: metadata, readiness and a BYTES input of several rows; batching does
not change its answers, and a row that is not UTF-8 fails its request alone."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
import yaml
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import ServerConfig
from gateway.metrics.registry import GatewayMetrics
from gateway.models.catalogue import custom_spec

from ..live import live

TEXTS = {
    "The striker scored twice in the cup final": "sports",
    "The central bank raised interest rates again": "business",
    "The senate passed the budget bill after a long debate": "politics",
    "Doctors recommend more sleep and less sugar": "health",
    "Astronomers found a new planet orbiting a distant star": "science",
}


@pytest.fixture(scope="module")
def topics():
    """The example as docs/examples/custom.yaml names it, served in this process."""
    with open("docs/examples/custom.yaml", encoding="utf-8") as f:
        [entry] = [m for m in yaml.safe_load(f)["models"] if m["kind"] == "custom"]
    spec = custom_spec(entry["source"], entry["name"], "cpu", "float32", entry["batching"], entry["options"])
    app = create_app(ServerConfig(warmup=False, engine_cores=False), [spec], GatewayMetrics(CollectorRegistry()))
    with live(app, ready_timeout=120) as server:
        yield server


@pytest.mark.model
def test_tritonclient_calls_the_example_unchanged(topics):
    client = triton.InferenceServerClient(topics.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("topics")
    meta = client.get_model_metadata("topics")
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"][1] == {"name": "scores", "datatype": "FP32", "shape": [-1, -1]}
    text = triton.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array(list(TEXTS), dtype=object))
    result = client.infer("topics", [text], request_id="news")
    assert result.get_response()["id"] == "news"
    assert [v.decode() for v in result.as_numpy("label")] == list(TEXTS.values())
    scores = result.as_numpy("scores")
    assert scores.shape == (len(TEXTS), 6) and np.allclose(scores.sum(axis=1), 1.0, atol=1e-5)
    client.close()

    # The same texts one request each, batched with one another and with a text that is not
    # UTF-8 (binary BYTES): the same answers, and that one fails alone.
    head = orjson.dumps(
        {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 5}}]}
    )

    async def one_by_one() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=topics.url, timeout=60) as c:
            url = "/v2/models/topics/infer"
            return await asyncio.gather(
                *(
                    c.post(url, json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [t]}]})
                    for t in TEXTS
                ),
                c.post(
                    url,
                    content=head + b"\x01\x00\x00\x00\xff",
                    headers={"Inference-Header-Content-Length": str(len(head))},
                ),
            )

    *answers, broken = asyncio.run(one_by_one())
    assert [r.json()["outputs"][0]["data"][0] for r in answers] == list(TEXTS.values())
    for r, row in zip(answers, scores, strict=True):
        np.testing.assert_allclose(r.json()["outputs"][1]["data"], row, atol=1e-4)
    assert broken.status_code == 500 and broken.json() == {
        "error": "model execution failed for this input: the text is not UTF-8"
    }
