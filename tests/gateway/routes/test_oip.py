"""The Open Inference Protocol routes (/v2/...) over a real uvicorn with a fake custom model
(engine/fake.py, FakeCustomModel): metadata and health, JSON and binary tensors, Triton's
own client, bad input refused before the model, faults confined to the rows they touched,
and Ferry's budget and priority carried as request parameters."""

from __future__ import annotations

import asyncio
import struct
from collections import Counter

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from engine.custom import load_custom
from engine.fake import FakeCustomModel
from gateway.translate.oip import encode_response, parse_infer

from ...waiting import async_wait_until

MODEL = "fake-custom"
INFER = f"/v2/models/{MODEL}/infer"


def body(*texts: str, vectors: list[list[float]] | None = None, **extra) -> dict:
    vectors = vectors if vectors is not None else [[1.0, 2.0]] * len(texts)
    return {
        "inputs": [
            {"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": list(texts)},
            {"name": "vector", "shape": [len(vectors), len(vectors[0])], "datatype": "FP32", "data": vectors},
        ],
        **extra,
    }


@pytest.fixture
def served(fake_server_factory):
    model = FakeCustomModel()
    server = fake_server_factory(custom=model, max_inputs=8)
    return server, model


def test_server_and_model_metadata_and_health(served):
    s, _ = served
    c = httpx.Client(base_url=s.url)
    assert c.get("/v2").json() | {"version": "x"} == {
        "name": "ferry",
        "version": "x",
        "extensions": ["binary_tensor_data"],
    }
    assert [c.get(p).status_code for p in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready")] == [
        200,
        200,
        200,
    ]
    meta = c.get(f"/v2/models/{MODEL}").json()
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert meta["inputs"] == [
        {"name": "text", "datatype": "BYTES", "shape": [-1]},
        {"name": "vector", "datatype": "FP32", "shape": [-1, -1]},
    ]
    for path in ("/v2/models/nope", "/v2/models/fake-embed", "/v2/models/nope/ready", "/v2/models/nope/infer"):
        r = c.post(path, json=body("a")) if path.endswith("infer") else c.get(path)
        assert r.status_code == 404 and set(r.json()) == {"error"} and "does not exist" in r.json()["error"]


def test_infer_answers_each_row_in_json_with_the_request_id_echoed(served):
    s, _ = served
    r = httpx.post(s.url + INFER, json=body("hi", "there", vectors=[[1, 2], [3, 4.5]], id="req-7"))
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert r.json()["id"] == "req-7" and r.json()["model_name"] == MODEL
    assert out["length"] == {"name": "length", "datatype": "INT64", "shape": [2], "data": [2, 5]}
    assert out["sum"]["data"] == [3.0, 7.5] and out["upper"]["data"] == ["HI", "THERE"]
    assert r.headers["X-Ferry-Batch-Size"] == "2"  # the rows are work items, batched together
    only = httpx.post(s.url + INFER, json=body("x", outputs=[{"name": "upper"}])).json()["outputs"]
    assert [o["name"] for o in only] == ["upper"]
    flat = body("ab")
    flat["inputs"][1]["data"] = [1.0, 2.0]  # flat or nested, row-major
    assert httpx.post(s.url + INFER, json=flat).json()["outputs"][1]["data"] == [3.0]


def test_binary_tensors_in_and_out():
    """The binary tensor data extension, read and written without a client's help."""
    text = b"".join(struct.pack("<I", len(t)) + t for t in (b"ab", b"xyz"))
    vec = np.array([[1, 2], [3, 4]], dtype="<f4").tobytes()
    head = {
        "inputs": [
            {"name": "text", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(text)}},
            {"name": "vector", "shape": [2, 2], "datatype": "FP32", "parameters": {"binary_data_size": len(vec)}},
        ],
        "outputs": [{"name": "sum", "parameters": {"binary_data": True}}, {"name": "upper"}],
    }
    raw_head = orjson.dumps(head)
    engine = load_custom("engine.fake:FakeCustomModel", MODEL)
    work = parse_infer(raw_head + text + vec, str(len(raw_head)), engine, 8)
    assert [r.tensors["text"][2] for r in work.rows] == [[b"ab"], [b"xyz"]]
    results = engine.predict(work.rows)
    payload, headers = encode_response(MODEL, work, results)
    cut = int(headers["Inference-Header-Content-Length"])
    outs = orjson.loads(payload[:cut])["outputs"]
    assert outs[0]["parameters"] == {"binary_data_size": 8} and "data" not in outs[0]
    assert np.frombuffer(payload[cut:], dtype="<f4").tolist() == [3.0, 7.0]
    assert outs[1]["data"] == ["AB", "XYZ"]


def test_tritonclient_calls_it_unchanged(served):
    s, _ = served
    client = triton.InferenceServerClient(s.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert [i["name"] for i in client.get_model_metadata(MODEL)["inputs"]] == ["text", "vector"]
    texts = np.array(["one", "two", "three"], dtype=object)
    vectors = np.arange(6, dtype=np.float32).reshape(3, 2)
    for binary in (True, False):
        text = triton.InferInput("text", [3], "BYTES")
        text.set_data_from_numpy(texts, binary_data=binary)
        vector = triton.InferInput("vector", [3, 2], "FP32")
        vector.set_data_from_numpy(vectors, binary_data=binary)
        outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("length", "sum", "upper")]
        result = client.infer(MODEL, [text, vector], outputs=outputs, request_id="t1")
        assert result.get_response()["id"] == "t1"
        assert result.as_numpy("length").tolist() == [3, 3, 5]
        assert result.as_numpy("sum").tolist() == [1.0, 5.0, 9.0]
        assert [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("upper")] == ["ONE", "TWO", "THREE"]
    # A client that names the version reaches the same model; another version is not served.
    assert client.get_model_metadata(MODEL, model_version="1")["versions"] == ["1"]
    assert client.is_model_ready(MODEL, model_version="1")
    versioned = client.infer(MODEL, [text, vector], model_version="1")
    assert versioned.as_numpy("length").tolist() == [3, 3, 5]
    with pytest.raises(InferenceServerException, match="no version '2'"):
        client.infer(MODEL, [text, vector], model_version="2")
    with pytest.raises(InferenceServerException, match="unknown"):
        bad = triton.InferInput("txt", [1], "BYTES")
        bad.set_data_from_numpy(np.array(["x"], dtype=object))
        client.infer(MODEL, [bad])
    # The exception carries the server's own words.
    with pytest.raises(InferenceServerException, match=r"The model 'no-such-model' does not exist"):
        client.get_model_metadata("no-such-model")
    client.close()


EXTRA = {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}
BAD = [
    ({"inputs": []}, "inputs"),
    (body("a") | {"inputs": body("a")["inputs"][:1]}, "missing ['vector']"),
    (
        body("a") | {"inputs": [*body("a")["inputs"], EXTRA]},
        "unknown ['x']",
    ),
    ({"inputs": [{**body("a")["inputs"][0], "datatype": "FP32"}, body("a")["inputs"][1]]}, "is BYTES"),
    ({"inputs": [body("a", "b")["inputs"][0], body("a")["inputs"][1]]}, "same number of rows"),
    ({"inputs": [{**body("a")["inputs"][0], "data": ["a", "b"]}, body("a")["inputs"][1]]}, "holds 1 elements"),
    ({"inputs": [{**body("a")["inputs"][0], "data": [3]}, body("a")["inputs"][1]]}, "are strings"),
    ({"inputs": [body("a")["inputs"][0], {**body("a")["inputs"][1], "data": ["x", "y"]}]}, "are numbers"),
    ({"inputs": [body("a")["inputs"][0], {**body("a")["inputs"][1], "data": [1e39, 1]}]}, "outside FP32"),
    ({"inputs": [body("a")["inputs"][0], {**body("a")["inputs"][1], "shape": [1]}]}, "row shape [-1]"),
    (body("a", outputs=[{"name": "nope"}]), "not 'nope'"),
    (body("a", parameters={"latency_budget_ms": "soon"}), "latency_budget_ms"),
    (body("a", parameters={"latency_budget_ms": 0}), "latency_budget_ms"),
    (body("a", parameters={"latency_budget_ms": 1e300}), "latency_budget_ms"),
    (body("a", parameters={"binary_data_output": "false"}), "true or false"),
    (body("a", outputs=[{"name": "sum", "parameters": {"classification": 2}}]), "classification"),
    ({"inputs": [{**body("a")["inputs"][0], "data": None}, body("a")["inputs"][1]]}, "has no data"),
]


@pytest.mark.parametrize(("payload", "words"), BAD)
def test_bad_input_is_a_400_in_the_protocols_shape_and_never_reaches_the_model(served, payload, words):
    s, model = served
    r = httpx.post(s.url + INFER, json=payload)
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    assert words in r.json()["error"]
    assert model.batches == []


def test_limits_and_unparseable_bodies(served):
    s, model = served
    r = httpx.post(s.url + INFER, json=body(*"abcdefghi"))  # nine rows, max_inputs 8
    assert r.status_code == 422 and "9 rows exceed the limit of 8" in r.json()["error"]
    r = httpx.post(s.url + INFER, content=b"{not json")
    assert r.status_code == 400 and "invalid inference request" in r.json()["error"]
    r = httpx.post(s.url + INFER, content=b"{}", headers={"Inference-Header-Content-Length": "99"})
    assert r.status_code == 400 and "not a length within the body" in r.json()["error"]
    r = httpx.post(s.url + INFER, content=b"{}", headers={"Inference-Header-Content-Length": "\u00b2".encode()})
    assert r.status_code == 400 and "not a length within the body" in r.json()["error"]
    nan = b'{"inputs": [], "parameters": {"latency_budget_ms": NaN}}'
    assert httpx.post(s.url + INFER, content=nan).status_code == 400
    big = b"{" + b" " * s.ferry.config.max_body_bytes + b"}"
    r = httpx.post(s.url + INFER, content=big)
    assert r.status_code == 413 and set(r.json()) == {"error"} and "exceeds the limit" in r.json()["error"]
    assert model.batches == []


async def _concurrently(url: str, payloads: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        return await asyncio.gather(*(c.post(INFER, json=p) for p in payloads))


def test_a_failing_row_fails_its_request_only_never_its_batch_mates(fake_server_factory):
    model = FakeCustomModel(delay=0.01)
    s = fake_server_factory(custom=model, max_batch_size=8, max_wait_ms=300, policy="fixed")
    payloads = [body(f"fine {i}") for i in range(6)] + [body("fine", "FAIL_ITEM"), body("OOM", "ok"), body("x")]
    rs = asyncio.run(_concurrently(s.url, payloads))
    assert [r.status_code for r in rs] == [200] * 6 + [500, 500, 200]
    assert "simulated failure of 'FAIL_ITEM'" in rs[6].json()["error"]
    assert max(model.batches) > 2  # they shared batches
    outcomes = s.ferry.models[MODEL].batcher.inner.outcomes
    assert Counter({o.name: n for o, n in outcomes.items() if n})["RESULT"] >= 7
    boom = asyncio.run(_concurrently(s.url, [body("FAIL_BATCH")]))[0]
    assert boom.status_code == 500 and "simulated model failure" in boom.json()["error"]
    assert httpx.post(s.url + INFER, json=body("after")).status_code == 200


def test_a_model_slower_than_the_budget_gets_429s_at_once(fake_server_factory):
    model = FakeCustomModel(delay=0.05)
    s = fake_server_factory(custom=model, max_batch_size=4, max_wait_ms=0)
    c = httpx.Client(base_url=s.url, timeout=30)
    for i in range(8):  # enough batches for the cost model to learn what one takes
        assert c.post(INFER, json=body(f"learn {i}")).status_code == 200
    served_batches = len(model.batches)
    for r in (
        c.post(INFER, json=body("hurry", parameters={"latency_budget_ms": 5})),
        c.post(INFER, json=body("hurry"), headers={"X-Ferry-Latency-Budget-Ms": "5"}),
    ):
        assert r.status_code == 429 and set(r.json()) == {"error"}, r.text
        assert int(r.headers["Retry-After"]) >= 1
    assert len(model.batches) == served_batches  # refused before the queue, never computed
    ok = c.post(INFER, json=body("relaxed", parameters={"latency_budget_ms": 5000, "priority": "batch"}))
    assert ok.status_code == 200
    bad = c.post(INFER, json=body("x", parameters={"priority": "urgent"}))
    assert bad.status_code == 400 and "urgent" in bad.json()["error"]
    # The request may choose to be served late rather than refused.
    for late in (
        c.post(INFER, json=body("late", parameters={"latency_budget_ms": 5, "on_infeasible": "serve"})),
        c.post(INFER, json=body("late"), headers={"X-Ferry-Latency-Budget-Ms": "5", "X-Ferry-On-Infeasible": "serve"}),
    ):
        assert late.status_code == 200 and late.headers["X-Ferry-Best-Effort"] == "true", late.text
    bad = c.post(INFER, json=body("x", parameters={"on_infeasible": "maybe"}))
    assert bad.status_code == 400 and "maybe" in bad.json()["error"]


class ThreadSafeFake(FakeCustomModel):
    thread_safe = True


@pytest.mark.parametrize("model_class", [ThreadSafeFake, FakeCustomModel])
def test_the_interactive_lane_serves_a_thread_safe_model_beside_a_long_batch(fake_server_factory, model_class):
    """A class that says `thread_safe` gets the lane: an interactive request is answered while
    a batch-class batch is still running. Without it, the class is called one batch at a time."""
    from batcher.cost import CostModel, LinearCost

    model = model_class(hang_seconds=2.0)
    s = fake_server_factory(custom=model, max_wait_ms=0)
    # The cost model knows a batch takes seconds: the one in flight has time left for the lane.
    s.ferry.models[MODEL].batcher.inner.cost = CostModel(LinearCost(2.0, 0.0, 0.0))

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            slow = asyncio.create_task(c.post(INFER, json=body("HANG", parameters={"priority": "batch"})))
            await async_wait_until(lambda: model.started, message="the long batch to start")
            quick = await c.post(INFER, json=body("quick"))
            return [quick.status_code, (await slow).status_code]

    assert asyncio.run(scenario()) == [200, 200]
    # In the model's own order of events: with the lane the quick batch ran and ended inside
    # the long one; without it, after.
    assert model.started == [["HANG"], ["quick"]]
    assert model.finished == ([["quick"], ["HANG"]] if model_class is ThreadSafeFake else [["HANG"], ["quick"]])


def test_the_live_page_and_metrics_show_a_custom_model(served):
    s, _ = served
    httpx.get(s.url + "/ui/stats")  # the first snapshot
    assert httpx.post(s.url + INFER, json=body("a", "b")).status_code == 200
    stats = httpx.get(s.url + "/ui/stats").json()
    custom = next(m for m in stats["models"] if m["name"] == MODEL)
    assert custom["kind"] == "custom" and custom["latency"]["request"]["count"] == 1
    assert "predict" in custom["cost"] and custom["batch_sizes"]["predict"]
    scraped = httpx.get(s.url + "/metrics").text
    assert f'ferry_batch_size_items_sum{{model="{MODEL}",phase="predict"}} 2.0' in scraped
    assert f'ferry_requests_total{{model="{MODEL}",route="/v2/models/{{model}}/infer",status="200"}} 1.0' in scraped


class Unruly(FakeCustomModel):
    """Outputs that cannot be read, on some rows only."""

    def predict(self, batch):
        out = super().predict(batch)
        for i, row in enumerate(batch):
            if row["text"] == "surrogate":
                out[i] = {**out[i], "upper": "\udcff"}  # not encodable as UTF-8
            elif row["text"] == "weird":
                out[i] = {**out[i], "sum": Weird()}
        return out


class Weird:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("cannot be an array")


def test_outputs_that_cannot_be_read_fail_their_row_alone(fake_server_factory):
    model = Unruly()
    s = fake_server_factory(custom=model, max_batch_size=8, max_wait_ms=300, policy="fixed")
    rs = asyncio.run(_concurrently(s.url, [body("fine"), body("surrogate"), body("weird"), body("also fine")]))
    assert [r.status_code for r in rs] == [200, 500, 500, 200]
    assert "not encodable as UTF-8" in rs[1].json()["error"] and "cannot be an array" in rs[2].json()["error"]
    assert model.batches == [4]  # one batch, two rows failing in it


def test_a_huge_shape_without_elements_is_refused_before_numpy_sees_it():
    """[1, 2**31-1, 2**31-1, 0] holds no elements, yet numpy refuses to make it: a 400, never the batch's error."""
    from types import SimpleNamespace

    from engine.custom import Tensor
    from gateway.errors import APIError

    model = SimpleNamespace(name="m", inputs=[Tensor("m", "FP32", (-1, -1, -1))], outputs=[Tensor("y", "FP32")])
    raw = orjson.dumps(
        {"inputs": [{"name": "m", "shape": [1, 2**31 - 1, 2**31 - 1, 0], "datatype": "FP32", "data": []}]}
    )
    with pytest.raises(APIError, match="too large") as refused:
        parse_infer(raw, None, model, 8)
    assert refused.value.status == 400
    fine = orjson.dumps({"inputs": [{"name": "m", "shape": [1, 3, 2**31 - 1, 0], "datatype": "FP32", "data": []}]})
    assert parse_infer(fine, None, model, 8).rows[0].tensors["m"][1] == [3, 2**31 - 1, 0]
