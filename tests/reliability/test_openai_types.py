"""Every OpenAI-compatible route's response parses with the official `openai` package's own
response types, strictly (no coercion): nothing required is missing and nothing has the
wrong type; Ferry's extra fields (prompt_index, a model card's type) are allowed."""

from __future__ import annotations

import base64
import json
from typing import Literal

import httpx
import numpy as np
import pytest
from openai.types import Batch, Completion, CreateEmbeddingResponse, ErrorObject, FileObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import CompletionChoice

from engine.fake import FakeGenerationEngine

from ..conftest import fake_app
from ..live import live
from ..waiting import wait_until


class StreamedCompletionChoice(CompletionChoice):
    # openai's client parses completion stream chunks as `Completion`, whose finish_reason is
    # not nullable, yet OpenAI itself streams null until the last chunk (the client builds
    # chunks without validation). Only that field is relaxed, and only for stream chunks.
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class CompletionChunk(Completion):
    choices: list[StreamedCompletionChoice]


CONVS = [[{"role": "user", "content": "a"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}]]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    app = fake_app(data_dir=str(tmp_path_factory.mktemp("jobs")))
    with live(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def strict(model, raw):
    return model.model_validate(raw, strict=True)


def events(r: httpx.Response) -> list:
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_embeddings_float_and_base64(api):
    r = api.post("/v1/embeddings", json={"model": "fake-embed", "input": ["a", "b"]})
    assert len(strict(CreateEmbeddingResponse, r.json()).data) == 2
    raw = api.post("/v1/embeddings", json={"model": "fake-embed", "input": "a", "encoding_format": "base64"}).json()
    for d in raw["data"]:  # what the openai client does before parsing
        d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
    strict(CreateEmbeddingResponse, raw)


def test_chat_completions_whole_and_streamed(api):
    body = {"model": "fake-chat", "messages": CONVS, "max_tokens": 3, "n": 2}
    res = strict(ChatCompletion, api.post("/v1/chat/completions", json=body).json())
    assert len(res.choices) == 4
    chunks = events(
        api.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    )
    for c in chunks:
        strict(ChatCompletionChunk, c)
    assert chunks[-1]["usage"] and all(c["choices"][0]["prompt_index"] in (0, 1) for c in chunks[:-1])


def test_completions_whole_and_streamed(api):
    body = {"model": "fake-chat", "prompt": ["a", "b"], "max_tokens": 3}
    assert len(strict(Completion, api.post("/v1/completions", json=body).json()).choices) == 2
    for c in events(api.post("/v1/completions", json={**body, "stream": True})):
        strict(CompletionChunk, c)


def test_models(api):
    listing = api.get("/v1/models").json()
    assert listing["object"] == "list"
    for card in listing["data"]:
        strict(Model, card)
    strict(Model, api.get("/v1/models/fake-chat").json())


def test_files_and_batches(api):
    line = {"custom_id": "1", "method": "POST", "url": "/v1/embeddings", "body": {"model": "fake-embed", "input": "x"}}
    f = api.post("/v1/files", files={"file": ("in.jsonl", json.dumps(line).encode())}, data={"purpose": "batch"}).json()
    strict(FileObject, f)
    strict(FileObject, api.get(f"/v1/files/{f['id']}").json())
    b = api.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/embeddings"}).json()
    strict(Batch, b)
    strict(Batch, api.get(f"/v1/batches/{b['id']}").json())
    listing = api.get("/v1/batches").json()
    assert listing["object"] == "list" and listing["data"]
    for item in listing["data"]:
        strict(Batch, item)
    done = wait_until(
        lambda: (got := api.get(f"/v1/batches/{b['id']}").json())["status"] == "completed" and got,
        timeout=10,
        interval=0.01,
        message="a one-line batch over fake engines to complete",
    )
    assert strict(Batch, done).output_file_id
    other = api.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/embeddings"}).json()
    r = api.post(f"/v1/batches/{other['id']}/cancel")
    if r.status_code == 200:
        strict(Batch, r.json())
    else:  # it finished first
        assert (r.status_code, r.json()["error"]["code"]) == (400, "batch_not_cancellable")


def test_an_errored_prompt_ends_with_a_chunk_of_openai_type(tmp_path):
    # The fake engine fails the prefill of prompts whose first token is listed: "Z..."
    # completion prompts, and every chat prompt (a conversation starts with "<").
    failing = FakeGenerationEngine(fail_prompts={ord("Z"), ord("<")})
    with (
        live(fake_app(chat=failing, data_dir=str(tmp_path))) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        chat = events(
            c.post(
                "/v1/chat/completions", json={"model": "fake-chat", "messages": CONVS, "max_tokens": 3, "stream": True}
            )
        )
        completions = events(
            c.post(
                "/v1/completions",
                json={
                    "model": "fake-chat",
                    "prompt": ["Zap", "ok"],
                    "max_tokens": 3,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        )
    for chunk in chat:
        strict(ChatCompletionChunk, chunk)
    for chunk in completions:
        strict(CompletionChunk, chunk)
    errored = [ch for chunk in chat + completions for ch in chunk["choices"] if "error" in ch]
    assert [(ch["prompt_index"], ch["finish_reason"]) for ch in errored] == [
        (0, "content_filter"),
        (1, "content_filter"),
        (0, "content_filter"),
    ]
    for ch in errored:  # OpenAI's error object, plus where it belongs
        err = strict(ErrorObject, ch["error"])
        assert (err.code, ch["error"]["status"], ch["error"]["prompt_index"], ch["error"]["index"]) == (
            "engine_error",
            500,
            ch["prompt_index"],
            ch["index"],
        )
    finished = {
        ch["prompt_index"]: ch["finish_reason"]
        for chunk in completions
        for ch in chunk["choices"]
        if ch["finish_reason"]
    }
    assert finished == {0: "content_filter", 1: "length"}  # the other prompt carried on
