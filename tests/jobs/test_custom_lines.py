"""Batch jobs over a custom model (engine/fake.py's FakeCustomModel): Open Inference Protocol
lines (`/v2/models/NAME/infer`) run as work items like any other line, their output records
hold what a direct request answers, a failing row fails its line alone, and a bad line is
named when the batch is created."""

from __future__ import annotations

import httpx

from engine.fake import FakeCustomModel

from .test_batches_http import stable

INFER = "/v2/models/fake-custom/infer"


def infer_line(cid: str, *texts: str, url: str = INFER, **extra) -> dict:
    body = {
        "inputs": [
            {"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": list(texts)},
            {"name": "vector", "shape": [len(texts), 1], "datatype": "FP32", "data": [[2.0]] * len(texts)},
        ],
        **extra,
    }
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_custom_model_lines_match_direct_requests_and_fail_alone(jobs_server):
    s, api = jobs_server(custom=FakeCustomModel())
    lines = [infer_line("one", "hello"), infer_line("two", "a", "bc", id="r2"), infer_line("bad", "ok", "FAIL_ITEM")]
    done = api.wait(api.create(lines, endpoint="/v2/models/{model}/infer")["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out = {o["custom_id"]: o for o in api.content(done["output_file_id"])}
    for line in lines[:2]:
        direct = httpx.post(s.url + INFER, json=line["body"], timeout=30)
        assert out[line["custom_id"]]["response"]["status_code"] == 200
        assert stable(out[line["custom_id"]]["response"]["body"]) == stable(direct.json())
    assert out["two"]["response"]["body"]["outputs"][2]["data"] == ["A", "BC"]
    [err] = api.content(done["error_file_id"])
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 500


def test_bad_custom_lines_are_named_when_the_batch_is_created(jobs_server):
    _, api = jobs_server(custom=FakeCustomModel())
    lines = [
        infer_line("fine", "x"),
        infer_line("nobody", "x", url="/v2/models/nobody/infer"),
        infer_line("binary", "x", parameters={"binary_data_output": True}),
        {
            **infer_line("tensors", "x"),
            "body": {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
        },
        infer_line("route", "x", url="/v2/models/fake-custom/ready"),
    ]
    error = api.create(lines, expect=422)["error"]
    assert error["lines"] == [2, 3, 4, 5]
    messages = [e["message"] for e in error["errors"]["data"]]
    assert "does not exist" in messages[0] and "binary outputs" in messages[1]
    assert "missing ['vector']" in messages[2] and "not a batch route" in messages[3]
    mismatch = api.create([infer_line("x", "x")], endpoint="/v1/embeddings", expect=422)["error"]
    assert "does not match the batch endpoint" in mismatch["errors"]["data"][0]["message"]


class Codes:
    """A text's character codes: an output whose length differs from row to row."""

    from engine.custom import Tensor

    inputs = (Tensor("text", "BYTES"),)
    outputs = (Tensor("codes", "INT32", (-1,)),)
    del Tensor

    def load(self, device: str, dtype: str) -> None:
        pass

    def predict(self, batch):
        return [{"codes": [ord(c) for c in row["text"]]} for row in batch]


def test_a_line_whose_outputs_cannot_make_a_response_fails_once(jobs_server):
    model = Codes()
    s, api = jobs_server(custom=model)
    line = {
        "custom_id": "ragged",
        "method": "POST",
        "url": INFER,
        "body": {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["ab", "abc"]}]},
    }
    done = api.wait(api.create([line])["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    [err] = api.content(done["error_file_id"])
    assert err["response"]["status_code"] == 500 and "different shapes" in err["response"]["body"]["error"]["message"]
    direct = httpx.post(s.url + INFER, json=line["body"], timeout=30)
    assert direct.status_code == 500 and "different shapes" in direct.json()["error"]
