"""GET /openapi.json states the size limits the running server enforces: a request the
description allows is never refused for its size, and one it refuses is refused, per model
and as max_queue changes live."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

ADMIN = {"Authorization": "Bearer admin-secret"}


def described(doc: dict, schema_name: str) -> jsonschema.Draft202012Validator:
    """A validator for one request schema of the description, its $refs resolved in it."""
    return jsonschema.Draft202012Validator({**doc, "$ref": f"#/components/schemas/{schema_name}"})


def bodies() -> list[tuple[str, str, dict]]:
    """(route, schema, body) around every limit of a server with max_queue 10, max_prompts 8."""
    conv = [{"role": "user", "content": "hi"}]
    out = []
    for k in (1, 9, 10, 11, 40):
        out.append(("/v1/embeddings", "EmbeddingsRequest", {"model": "fake-embed", "input": ["x"] * k}))
    for prompts in (1, 2, 3, 5, 8, 9):
        for n in (None, 1, 2, 3, 4, 5, 10, 11, 16):
            extra = {} if n is None else {"n": n}
            out.append(
                (
                    "/v1/chat/completions",
                    "ChatCompletionRequest",
                    {"model": "fake-chat", "messages": [conv] * prompts, "max_tokens": 1, **extra},
                )
            )
            out.append(
                (
                    "/v1/completions",
                    "CompletionRequest",
                    {"model": "fake-chat", "prompt": ["x"] * prompts, "max_tokens": 1, **extra},
                )
            )
    for n in (10, 11):  # one conversation, more candidates than the queue holds
        out.append(
            (
                "/v1/chat/completions",
                "ChatCompletionRequest",
                {"model": "fake-chat", "messages": conv, "max_tokens": 1, "n": n},
            )
        )
    return out


@pytest.fixture
def server(fake_server_factory):
    return fake_server_factory(admin_token="admin-secret", max_queue=10, max_prompts=8)


def test_a_request_is_refused_for_its_size_exactly_when_the_description_says(server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        doc = http.get("/openapi.json").json()
        assert doc["components"]["schemas"]["EmbeddingsRequest"]["properties"]["input"]["anyOf"][1]["maxItems"] == 10
        agreed = 0
        for route, schema, body in bodies():
            allowed = described(doc, schema).is_valid(body)
            r = http.post(route, json=body)
            assert r.status_code in (200, 422), (route, body, r.text)
            assert allowed == (r.status_code == 200), (route, body, allowed, r.text)
            agreed += 1
        assert agreed == len(bodies())


def test_the_description_follows_a_live_change_of_max_queue(server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        body = {"model": "fake-embed", "input": ["x"] * 8}
        doc = http.get("/openapi.json").json()
        assert described(doc, "EmbeddingsRequest").is_valid(body)
        r = http.patch("/admin/models/fake-embed/batching", json={"max_queue": 5}, headers=ADMIN)
        assert r.status_code == 200, r.text
        doc = http.get("/openapi.json").json()
        assert not described(doc, "EmbeddingsRequest").is_valid(body)
        assert http.post("/v1/embeddings", json=body).json()["error"]["code"] == "request_too_large"
        assert described(doc, "EmbeddingsRequest").is_valid({**body, "input": ["x"] * 5})
        # The chat model's queue is its own: its limits did not move.
        chat = {"model": "fake-chat", "messages": [[{"role": "user", "content": "hi"}]] * 8, "max_tokens": 1}
        assert described(doc, "ChatCompletionRequest").is_valid(chat)


def test_every_request_body_states_the_body_limit(fake_server_factory) -> None:
    server = fake_server_factory(max_body_bytes=65536)
    doc = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/embeddings", "/v1/chat/completions", "/v1/completions"):
        assert "At most 65536 bytes" in doc["paths"][path]["post"]["requestBody"]["description"]


def test_a_per_prompt_list_of_n_counts_its_sum(server) -> None:
    """`n` as a per-prompt list: each prompt's candidates in prompt order, each choice with
    its prompt_index; the queue cap counts the list's sum (which the description says in
    words); a list of the wrong length names `n`."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        body = {"model": "fake-chat", "prompt": ["a", "b", "c"], "max_tokens": 1, "n": [1, 3, 2]}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert [(c["index"], c["prompt_index"]) for c in r.json()["choices"]] == [
            (0, 0),
            (1, 1),
            (2, 1),
            (3, 1),
            (4, 2),
            (5, 2),
        ]
        too_many = http.post("/v1/completions", json={**body, "n": [4, 4, 3]})  # 11 items, queue 10
        assert too_many.status_code == 422 and too_many.json()["error"]["code"] == "request_too_large"
        wrong = http.post("/v1/completions", json={**body, "n": [1, 2]})
        err = wrong.json()["error"]
        assert wrong.status_code == 422 and (err["code"], err["param"]) == ("prompt_count_mismatch", "n")
        doc = http.get("/openapi.json").json()
        assert "its sum" in doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["description"]
