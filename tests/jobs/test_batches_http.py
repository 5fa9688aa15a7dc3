"""The batch API over a real socket with fake engines: results, validation, cancel,
expiry, resume after a graceful restart, listing, metrics, the openai client."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from engine.fake import FakeEmbeddingEngine, FakeGenerationEngine

from ..waiting import wait_until
from .conftest import Api, chat_line, completion_line, embed_line, jsonl

VOLATILE = ("id", "created")


def stable(body: dict) -> dict:
    """A body without what differs between two runs of one request: ids, times and the
    cached prompt tokens (the second run finds the first's prompt in the prefix cache)."""
    out = {k: v for k, v in body.items() if k not in VOLATILE}
    if isinstance(out.get("usage"), dict):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def test_mixed_job_matches_direct_requests(jobs_server):
    s, api = jobs_server()
    lines = [
        chat_line("chat-1", "hello ferry"),
        chat_line(
            "chat-2",
            "two",
            messages=[[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
            max_tokens=[2, 5],
            stop=[None, ["w3"]],
        ),
        chat_line("chat-n", "candidates", n=2, max_tokens=2),
        completion_line("cmpl-1", ["p one", "p two"], max_tokens=[1, 3]),
        completion_line("cmpl-2", "just one"),
        embed_line("emb-1", ["some text", "other words here"]),
        embed_line("emb-b64", "base64 please", encoding_format="base64"),
        embed_line("emb-bad", ["fine", "FAIL_ITEM here"]),  # fails alone, like a direct request
        chat_line("chat-long", "x" * 600),  # longer than the context: found when it runs (tokenizer), fails alone
    ]
    batch = api.create(lines)
    assert batch["object"] == "batch" and batch["request_counts"]["total"] == len(lines)
    done = api.wait(batch["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 9, "completed": 7, "failed": 2}
    assert done["completed_at"] and done["finalizing_at"] and done["in_progress_at"]
    out = api.content(done["output_file_id"])
    err = api.content(done["error_file_id"])
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines[:-2])
    assert [e["custom_id"] for e in err] == ["emb-bad", "chat-long"]
    by_id = {o["custom_id"]: o for o in out + err}
    for line in lines:
        direct = httpx.post(s.url + line["url"], json=line["body"], timeout=30)
        record = by_id[line["custom_id"]]
        assert record["response"]["status_code"] == direct.status_code
        assert record["error"] is None and record["id"].startswith("batch_req_") and record["response"]["request_id"]
        assert stable(record["response"]["body"]) == stable(direct.json()), line["custom_id"]
    assert err[0]["response"]["body"]["error"]["code"] == "engine_error"
    assert err[1]["response"]["status_code"] == 422
    assert err[1]["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_whole_file_is_validated_and_bad_lines_are_named(jobs_server):
    embed, chat = FakeEmbeddingEngine(), FakeGenerationEngine()
    _s, api = jobs_server(embed, chat)
    good = chat_line("ok-1", "fine")
    lines = [
        good,  # 1
        b"{not json",  # 2
        {**chat_line("x3", "hi"), "url": "/v1/images/generations"},  # 3 unknown route
        chat_line("ok-1", "same custom id"),  # 4 duplicate custom_id
        chat_line("x5", "hi", temperature=5),  # 5 schema
        {**embed_line("x6", "hi"), "body": {"model": "no-such-model", "input": "hi"}},  # 6 unknown model
        {**chat_line("x7", "hi"), "method": "GET"},  # 7 method
        completion_line("ok-8", "fine"),  # 8
        b"   ",  # 9 blank: skipped
        chat_line("x10", "hi", stream=True),  # 10 streaming
        chat_line("x11", "hi", messages=[[{"role": "user", "content": "a"}]], max_tokens=[1, 2]),  # 11 per-prompt list
        embed_line("x12", "hi", dimensions=3),  # 12 route limit
        [1, 2],  # 13 not an object
        embed_line("x14", [[101, 7, 102], [101, 1 << 31, 102]]),  # 14 a token id outside the vocabulary
        embed_line("ok-15", [101, 7, 102]),  # 15 token ids
    ]
    fid = api.upload(lines)
    r = api.http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "*", "completion_window": "24h"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_batch_file" and error["type"] == "invalid_request_error"
    assert error["lines"] == [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14]
    details = {d["line"]: d for d in error["errors"]["data"]}
    assert details[4]["code"] == "duplicate_custom_id" and "line 1" in details[4]["message"]
    assert details[3]["code"] == "invalid_url" and details[6]["code"] == "model_not_found"
    assert details[5]["param"].startswith("body.temperature")
    assert details[14]["code"] == "invalid_token_id" and "input[1]" in details[14]["message"]
    assert "line 2" in error["message"]
    # Nothing was created, nothing ran.
    assert api.http.get("/v1/batches").json()["data"] == []
    assert embed.calls == [] and chat.calls == []
    # A line whose url is a batch route but not the batch's endpoint.
    fid = api.upload([embed_line("e", "x"), chat_line("c", "y")])
    r = api.http.post(
        "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    )
    assert r.status_code == 422 and r.json()["error"]["lines"] == [2]


def test_request_level_errors(jobs_server):
    _s, api = jobs_server()
    h = api.http
    assert h.post("/v1/files", files={"file": ("a.jsonl", b"x\n")}, data={"purpose": "fine-tune"}).status_code == 422
    assert h.post("/v1/files", data={"purpose": "batch"}).status_code == 422
    assert h.get("/v1/files/file-nope").status_code == 404
    assert h.get("/v1/batches/batch_nope").status_code == 404
    assert h.post("/v1/batches", json={"input_file_id": "file-nope", "endpoint": "*"}).status_code == 404
    # Raw JSONL body upload (curl convenience).
    r = h.post("/v1/files?purpose=batch&filename=raw.jsonl", content=jsonl([embed_line("a", "x")]))
    assert r.status_code == 200 and r.json()["filename"] == "raw.jsonl" and r.json()["purpose"] == "batch"
    fid = r.json()["id"]
    for bad in (
        {"completion_window": "1d"},
        {"completion_window": "0h"},
        {"endpoint": "/v1/moderations"},
        {"bogus": 1},
    ):
        body = {"input_file_id": fid, "endpoint": "*", "completion_window": "24h", **bad}
        assert h.post("/v1/batches", json=body).status_code == 422, bad
    b = api.wait(api.create([embed_line("a", "x")], endpoint="/v1/embeddings")["id"])
    r = h.post(f"/v1/batches/{b['id']}/cancel")
    assert r.status_code == 400 and r.json()["error"]["code"] == "batch_not_cancellable"
    assert h.get("/v1/batches?limit=0").status_code == 422


def test_list_is_newest_first_and_paginated(jobs_server):
    _s, api = jobs_server()
    ids = [api.create([embed_line("a", f"x{i}")])["id"] for i in range(3)]
    page = api.http.get("/v1/batches", params={"limit": 2}).json()
    assert page["object"] == "list" and [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"]
    assert page["first_id"] == ids[2] and page["last_id"] == ids[1]
    rest = api.http.get("/v1/batches", params={"limit": 2, "after": page["last_id"]}).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and not rest["has_more"]


def test_cancel_mid_job_computes_nothing_more(jobs_server):
    embed = FakeEmbeddingEngine(fixed=0.05)
    _s, api = jobs_server(embed, max_batch_size=2)
    lines = [embed_line(f"l{i}", f"text {i}") for i in range(40)]
    batch = api.create(lines, endpoint="/v1/embeddings")
    api.wait(batch["id"], lambda b: b["request_counts"]["completed"] >= 2)
    r = api.http.post(f"/v1/batches/{batch['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
    calls_at_cancel = len(embed.calls)
    completed_at_cancel = r.json()["request_counts"]["completed"]
    done = api.wait(batch["id"])
    time.sleep(0.3)  # not a wait for something: a chance for work that must not run to show up
    assert done["status"] == "cancelled" and done["cancelled_at"] and done["cancelling_at"]
    # At most the batches already dispatched when the cancel arrived ran afterwards: the
    # engine thread's and, with no interactive work lately, the one beside it (two lines
    # each); nothing else.
    assert len(embed.calls) <= calls_at_cancel + 2
    counts = done["request_counts"]
    assert counts["completed"] - completed_at_cancel <= 2 * 2 and counts["completed"] < 40
    # Every computed input belongs to a line whose result was kept: no computed line was dropped.
    assert sum(embed.calls) == counts["completed"]
    out, err = api.content(done["output_file_id"]), api.content(done["error_file_id"])
    assert len(out) == counts["completed"] and all(o["response"]["status_code"] == 200 for o in out)
    assert len(err) == 40 - counts["completed"]
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"} and all(e["response"] is None for e in err)
    assert sorted(o["custom_id"] for o in out + err) == sorted(line["custom_id"] for line in lines)
    # Cancelling again is harmless.
    assert api.http.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] == "cancelled"


def test_completion_window_expires_with_partial_results(jobs_server):
    embed = FakeEmbeddingEngine(fixed=0.1)
    _s, api = jobs_server(embed, max_batch_size=1)
    lines = [embed_line(f"l{i}", f"text {i}") for i in range(30)]
    batch = api.create(lines, window="1s")
    assert batch["expires_at"] - batch["created_at"] in (0, 1, 2)
    done = api.wait(batch["id"], timeout=20)
    assert done["status"] == "expired" and done["expired_at"]
    counts = done["request_counts"]
    assert 0 < counts["completed"] < 30
    out, err = api.content(done["output_file_id"]), api.content(done["error_file_id"])
    assert len(out) == counts["completed"] and len(err) == 30 - counts["completed"]
    assert {e["error"]["code"] for e in err} == {"batch_expired"}
    assert sum(embed.calls) == counts["completed"]


def test_graceful_restart_resumes_without_rerunning(fake_server_factory, tmp_path):
    data = str(tmp_path / "data")
    first = FakeEmbeddingEngine(fixed=0.03)
    s1 = fake_server_factory(first, max_batch_size=1, data_dir=data)
    api1 = Api(s1.url)
    lines = [embed_line(f"l{i}", f"text {i}") for i in range(30)]
    batch = api1.create(lines)
    api1.wait(batch["id"], lambda b: b["request_counts"]["completed"] >= 5)
    s1.stop()  # drain: queued lines go back to pending, the running one finishes and is committed
    second = FakeEmbeddingEngine()
    s2 = fake_server_factory(second, data_dir=data)
    api2 = Api(s2.url)
    done = api2.wait(batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    out = api2.content(done["output_file_id"])
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
    # Every input computed exactly once across both processes.
    assert sum(first.calls) + sum(second.calls) == 30 and sum(first.calls) >= 5


def test_metrics_and_openai_client(jobs_server, tmp_path):
    import openai

    s, _api = jobs_server()
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([embed_line(f"e{i}", f"words {i}") for i in range(5)]))
    with open(path, "rb") as upload:
        f = client.files.create(file=upload, purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes == path.stat().st_size
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h", metadata={"team": "evals"}
    )
    assert b.status == "in_progress" and b.metadata == {"team": "evals"}
    b = wait_until(
        lambda: (got := client.batches.retrieve(b.id)).status == "completed" and got,
        message=lambda: f"batch {b.id} to complete; now: {client.batches.retrieve(b.id)}",
    )
    assert b.request_counts.total == 5 and b.request_counts.completed == 5 and b.error_file_id is None
    out = [orjson.loads(x) for x in client.files.content(b.output_file_id).content.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"e{i}" for i in range(5)]
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    assert [x.id for x in client.batches.list(limit=10)] == [b.id]
    # The upload can go once the batch holds its requests; its results cannot (read from the batch).
    gone = client.files.delete(f.id)
    assert (gone.id, gone.deleted, gone.object) == (f.id, True, "file")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.BadRequestError, match="only uploads are deleted"):
        client.files.delete(b.output_file_id)
    assert len(client.files.content(b.output_file_id).content.splitlines()) == 5
    registry = s.ferry.metrics.registry
    assert registry.get_sample_value("ferry_jobs", {"status": "completed"}) == 1
    assert registry.get_sample_value("ferry_jobs", {"status": "in_progress"}) == 0
    assert registry.get_sample_value("ferry_job_lines_total", {"status": "completed"}) == 5
    text = httpx.get(s.url + "/metrics").text
    assert 'ferry_jobs{status="completed"} 1.0' in text


def test_batch_work_leaves_running_slots_for_interactive_prompts(jobs_server):
    chat = FakeGenerationEngine(step_delay=0.002)
    _s, api = jobs_server(chat=chat, max_running=4)
    done = api.wait(api.create([chat_line(f"c{i}", f"prompt {i}", max_tokens=6) for i in range(12)])["id"])
    assert done["request_counts"]["completed"] == 12
    # Batch sequences never held more than half of max_running at once.
    assert max(len(ids) for kind, ids in chat.calls if kind == "step") == 2


@pytest.mark.model
def test_schema_constrained_lines_with_the_tiny_chat(tmp_path):
    """Lines with response_format and forced tool calls run like direct requests; a line
    whose schema or tool_choice cannot be followed is named when the file is validated."""
    import jsonschema
    from prometheus_client import CollectorRegistry

    from gateway.app import create_app
    from gateway.config import ServerConfig
    from gateway.metrics.registry import GatewayMetrics
    from tests.gateway.routes.test_chat_structured import DOCK, MAX_TOKENS, SHIP, TIDES, fmt
    from tests.live import live

    cfg = ServerConfig(
        embedding_model="none", chat_model="tiny", data_dir=str(tmp_path / "data"), warmup=False, max_wait_ms=5.0
    )
    with live(create_app(cfg, metrics=GatewayMetrics(CollectorRegistry())), ready_timeout=300) as s:
        api = Api(s.url)
        model = {"model": "ferry-tiny-chat", "max_tokens": MAX_TOKENS}
        bad = [
            chat_line("bad-schema", "x", **model, response_format=fmt({"type": "object", "properties": {"a": 1}})),
            chat_line(
                "bad-tool", "x", **model, tools=[TIDES], tool_choice={"type": "function", "function": {"name": "x"}}
            ),
        ]
        fid = api.upload([chat_line("ok", "x", **model), *bad])
        r = api.http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "*", "completion_window": "24h"})
        assert r.status_code == 422 and r.json()["error"]["lines"] == [2, 3]
        details = {d["line"]: d for d in r.json()["error"]["errors"]["data"]}
        assert (
            details[2]["param"] == "body.response_format.json_schema.schema"
            and "/properties/a" in details[2]["message"]
        )
        assert details[3]["param"] == "body.tool_choice"

        conv = [{"role": "user", "content": "A ship, please."}]
        lines = [
            chat_line(f"ship-{i}", "A ship, please.", **model, seed=i, response_format=fmt(SHIP)) for i in range(4)
        ]
        lines.append(chat_line("two", "x", **model, messages=[conv, conv], response_format=[fmt(DOCK), fmt(SHIP)]))
        lines.append(chat_line("call", "x", **model, tools=[TIDES], tool_choice="required", seed=2))
        batch = api.create(lines)
        done = api.wait(batch["id"], timeout=600)
        assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        out = {o["custom_id"]: o["response"]["body"] for o in api.content(done["output_file_id"])}
        for i in range(4):
            jsonschema.validate(orjson.loads(out[f"ship-{i}"]["choices"][0]["message"]["content"]), SHIP)
        dock, ship = out["two"]["choices"]
        jsonschema.validate(orjson.loads(dock["message"]["content"]), DOCK)
        jsonschema.validate(orjson.loads(ship["message"]["content"]), SHIP)
        call = out["call"]["choices"][0]
        assert call["finish_reason"] == "tool_calls"
        arguments = call["message"]["tool_calls"][0]["function"]["arguments"]
        jsonschema.validate(orjson.loads(arguments), TIDES["function"]["parameters"])


def test_a_line_with_more_inputs_than_the_queue_holds_fails_at_once(jobs_server):
    """Admission refuses it for good (request_too_large): the line fails with that error and
    its job completes, instead of the line staying pending until the window ends."""
    _s, api = jobs_server(max_queue=4)
    lines = [embed_line("big", [f"text {i}" for i in range(6)]), embed_line("ok", ["a", "b"])]
    done = api.wait(api.create(lines, endpoint="/v1/embeddings")["id"], timeout=15)
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    [err] = api.content(done["error_file_id"])
    assert err["custom_id"] == "big" and err["response"]["status_code"] == 422
    assert err["response"]["body"]["error"]["code"] == "request_too_large"
    [ok] = api.content(done["output_file_id"])
    assert ok["custom_id"] == "ok" and len(ok["response"]["body"]["data"]) == 2


def test_each_api_key_sees_only_its_own_files_and_batches(jobs_server):
    """With keys, a file or batch belongs to the key that made it: another key can neither
    list, read, cancel, nor build a batch from it (404, as if it did not exist)."""
    s, _ = jobs_server(api_keys=["key-a", "key-b"])
    a, b = Api(s.url), Api(s.url)
    a.http.headers["Authorization"], b.http.headers["Authorization"] = "Bearer key-a", "Bearer key-b"
    batch = a.wait(a.create([embed_line("x", "hello")], endpoint="/v1/embeddings")["id"])
    assert batch["status"] == "completed"
    fid, out = batch["input_file_id"], batch["output_file_id"]
    assert [x["id"] for x in a.http.get("/v1/batches").json()["data"]] == [batch["id"]]
    assert b.http.get("/v1/batches").json()["data"] == []
    for path in (
        f"/v1/batches/{batch['id']}",
        f"/v1/files/{fid}",
        f"/v1/files/{fid}/content",
        f"/v1/files/{out}/content",
    ):
        assert b.http.get(path).status_code == 404, path
        assert a.http.get(path).status_code == 200, path
    assert b.http.post(f"/v1/batches/{batch['id']}/cancel").status_code == 404
    assert b.http.delete(f"/v1/files/{fid}").status_code == 404
    r = b.http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "*", "completion_window": "24h"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"
    assert b.http.get(f"/v1/batches?after={batch['id']}").status_code == 404  # not even as a cursor


def test_a_batch_jobs_lines_count_toward_its_creator_keys_tenant(jobs_server):
    """A job's lines are its key's tenant's work: their tokens are charged to that tenant
    (fair shares and quotas, batcher/fairness.py), labelled by the key's digest."""
    from gateway.tenancy import key_tenant

    s, _ = jobs_server(api_keys=["key-a"])
    a = Api(s.url)
    a.http.headers["Authorization"] = "Bearer key-a"
    batch = a.wait(a.create([embed_line("x", "hello there"), embed_line("y", "general kenobi")])["id"])
    assert batch["status"] == "completed"
    metrics = httpx.get(s.url + "/metrics").text
    line = f'ferry_tenant_tokens_total{{kind="input",model="fake-embed",tenant="{key_tenant("key-a")}"}}'
    assert any(row.startswith(line) and float(row.split()[-1]) > 0 for row in metrics.splitlines()), line
    assert "key-a" not in metrics.replace(key_tenant("key-a"), "")
