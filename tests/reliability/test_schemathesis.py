"""schemathesis against /openapi.json: generated requests on every route never get a 5xx
and every response matches the documented schema (fake engines, real socket).

Driven through schemathesis' hypothesis strategies (bounded examples per operation)
rather than its pytest plugin, which does not load under this pytest version."""
from __future__ import annotations

import pytest
import schemathesis
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)
from hypothesis import HealthCheck, given, settings

from ..conftest import fake_app
from ..live import live

AUTH = {"Authorization": "Bearer admin-secret"}
# Positive-data acceptance is left out on purpose: limits such as max_completion_tokens or
# max_prompts are server settings, not schema constants, so schema-valid requests over a
# limit are rightly refused with 422.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("jobs"))
    with live(fake_app(admin_token="admin-secret", max_completion_tokens=64, max_prompts=8, data_dir=data_dir)) as server:
        yield server


def operations(url: str):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_every_operation_conforms_to_its_schema(api):
    ops = operations(api.url)
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {
        "POST /v1/embeddings", "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
        "GET /readyz", "PATCH /admin/models/{model}/batching"}
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(timeout=30, headers=AUTH)
            assert response.status_code < 500, (op.path, response.status_code, response.text[:500])
            case.validate_response(response, checks=CHECKS)

        check()
