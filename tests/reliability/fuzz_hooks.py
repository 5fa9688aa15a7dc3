"""Schemathesis hooks for the fuzz test (loaded by the CLI through SCHEMATHESIS_HOOKS).

`positive_data_acceptance` is run through a wrapper: a schema-valid request must be
accepted, except for the few refusals JSON Schema cannot express. Each has its own error
code, so the exemption is exact: a schema-valid request refused with any other code (or any
other status) still fails the run.

Real batches: the fuzzer never writes a valid batch input file, so without help the
stateful phase reaches the batch operations only with made-up ids. Some of its positive
uploads are replaced by a valid JSONL file, and a batch created from one gets the `endpoint`
its lines use, so the links from `POST /v1/files` lead to real batches, and from them to
`GET`, `cancel` and the output file."""

from __future__ import annotations

import json
import urllib.request

import hypothesis.strategies as st
import jsonschema
import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# 422 codes whose rule needs more than the request's own JSON: the prompts' number (per-
# prompt lists), the tokenizer (prompt lengths), the chat template, the uploaded file's
# content (batch creation), a JSON schema inside the request (valid JSON Schema, and
# followable by the grammar library), tool names against tool_choice, and what the served
# model can do (constrained output).
NOT_IN_JSON_SCHEMA = frozenset(
    {
        "invalid_schema",
        "invalid_tools",
        "invalid_tool_choice",
        "unsupported_parameter",
        "prompt_count_mismatch",
        "context_length_exceeded",
        "too_many_tokens",
        "chat_template_error",
        "invalid_batch_file",
        "invalid_token_id",  # a logit_bias key beyond the model's vocabulary
        "empty_prompt",  # "" tokenized to nothing (a model with no start token)
        "stream_options_without_stream",  # a rule across two fields
        "logprobs_required",  # top_logprobs without logprobs: true (a rule across two fields)
    }
)
# An Open Inference Protocol request's tensors checked against the custom model's declared
# ones (names, datatypes, row shapes, shapes against the data's length): the protocol's
# error body has no code, so the exemption is the route's 400 alone.
TENSOR_REFUSALS = frozenset(
    {("POST", "/v2/models/{model}/infer", 400), ("POST", "/v2/models/{model}/versions/{version}/infer", 400)}
)
# Refusals that depend on a resource's state, not on the request: cancelling a batch that has
# already finished (400 batch_not_cancellable, docs/batch-jobs.md).
STATE_REFUSALS = frozenset({(400, "batch_not_cancellable"), (400, "file_not_deletable")})


def _error_code(response) -> str | None:
    try:
        return json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


# The schema of each route's request body, by path.
BODY_SCHEMAS = {
    "/v1/embeddings": "EmbeddingsRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
}


def _too_large_now(response, case) -> bool:
    """Whether the server's description as it is now refuses this body. The size limits it
    states follow max_queue, which the fuzzer itself changes live (admin PATCH): a body the
    description allowed when the run began may be too large for the queue since. A 422
    request_too_large is right exactly when the description of this moment says so."""
    schema = BODY_SCHEMAS.get(case.operation.path)
    if schema is None or not isinstance(case.body, dict):
        return False
    url = response.request.url.split("/v1/")[0] + "/openapi.json"
    doc = json.loads(urllib.request.urlopen(url, timeout=10).read())
    return not jsonschema.Draft202012Validator({**doc, "$ref": f"#/components/schemas/{schema}"}).is_valid(case.body)


@schemathesis.check
def positive_data_acceptance_with_semantic_refusals(ctx, response, case):
    try:
        return positive_data_acceptance(ctx, response, case)
    except AssertionError:
        code = _error_code(response)
        if (response.status_code == 422 and code in NOT_IN_JSON_SCHEMA) or (
            response.status_code,
            code,
        ) in STATE_REFUSALS:
            return None
        if (case.operation.method.upper(), case.operation.path, response.status_code) in TENSOR_REFUSALS:
            return None
        if response.status_code == 422 and code == "request_too_large" and _too_large_now(response, case):
            return None
        raise


# -- real batches in the stateful phase -----------------------------------------------------
LINE_BODIES = {  # one valid request per batch route, for the fake models of the test server
    "/v1/embeddings": {"model": "fake-embed", "input": "fuzz"},
    "/v1/chat/completions": {"model": "fake-chat", "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2},
    "/v1/completions": {"model": "fake-chat", "prompt": "fuzz", "max_tokens": 2},
}
# The fake embedding engine blocks on this input for the server's `hang_seconds`
# (engine/fake.py): a batch with such a line is still running when the fuzzer cancels it;
# the others finish at once and have an output file to read.
SLOW = "HANG"
CUSTOM_ID = "fuzz-"
uploaded: dict[str, str] = {}  # file id -> the route of its lines, for the uploads made here


@st.composite
def batch_upload(draw) -> dict:
    slow = draw(st.integers(0, 2)) == 0
    # Slow batches are embeddings; the others generation only, so none waits behind a slow one.
    url = "/v1/embeddings" if slow else draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    lines = []
    for i in range(draw(st.integers(1, 3))):
        body = {**LINE_BODIES[url], "input": SLOW} if slow and i == 0 else LINE_BODIES[url]
        lines.append(json.dumps({"custom_id": f"{CUSTOM_ID}{i}", "method": "POST", "url": url, "body": body}))
    return {"purpose": "batch", "file": "\n".join(lines).encode()}


@schemathesis.hook.apply_to(method="POST", path="/v1/files")
def before_generate_body(ctx, strategy):
    # A positive body is a plain dict; a negative one comes wrapped with its mutation and is
    # left as it is (a valid file there would be a negative case the server rightly accepts).
    def replace(body):
        if not isinstance(body, dict):
            return st.just(body)
        return st.integers(0, 3).flatmap(lambda k: st.just(body) if k == 0 else batch_upload())

    return strategy.flatmap(replace)


def _is(case, method: str, path: str) -> bool:
    return case.operation.method.upper() == method and case.operation.path == path


@schemathesis.hook
def after_call(ctx, case, response):
    if not (_is(case, "POST", "/v1/files") and response.status_code == 200 and isinstance(case.body, dict)):
        return
    content = case.body.get("file")
    if isinstance(content, bytes) and content.startswith(b'{"custom_id": "' + CUSTOM_ID.encode()):
        uploaded[json.loads(response.content)["id"]] = json.loads(content.split(b"\n")[0])["url"]


@schemathesis.hook
def before_call(ctx, case, kwargs):
    # Only a valid endpoint is swapped for another valid one, so a case stays positive or
    # negative as it was generated.
    body = case.body
    if not (_is(case, "POST", "/v1/batches") and isinstance(body, dict)):
        return
    endpoint, file_id = body.get("endpoint"), body.get("input_file_id")
    if isinstance(endpoint, str) and endpoint in LINE_BODIES and isinstance(file_id, str) and file_id in uploaded:
        body["endpoint"] = uploaded[file_id]
