"""Schemathesis hooks for the fuzz test (loaded by the CLI through SCHEMATHESIS_HOOKS).

`positive_data_acceptance` is run through a wrapper: a schema-valid request must be
accepted, except for the few refusals JSON Schema cannot express. Each has its own error
code, so the exemption is exact: a schema-valid request refused with any other code (or any
other status) still fails the run."""
from __future__ import annotations

import json

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# 422 codes whose rule needs more than the request's own JSON: the prompts' number (per-
# prompt lists), the tokenizer (prompt lengths), the chat template, the uploaded file's
# content (batch creation), the live queue size (a request larger than the whole queue;
# for generation prompts x n).
NOT_IN_JSON_SCHEMA = frozenset({
    "prompt_count_mismatch",
    "request_too_large",
    "context_length_exceeded",
    "too_many_tokens",
    "chat_template_error",
    "invalid_batch_file",
})


def _error_code(response) -> str | None:
    try:
        return json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@schemathesis.check
def positive_data_acceptance_with_semantic_refusals(ctx, response, case):
    try:
        return positive_data_acceptance(ctx, response, case)
    except AssertionError:
        if response.status_code == 422 and _error_code(response) in NOT_IN_JSON_SCHEMA:
            return None
        raise
