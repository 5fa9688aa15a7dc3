"""schemathesis against /openapi.json, the whole CLI run (docs/reliability.md, "API description"):
every check (`--checks all`), positive and negative data, the coverage, fuzzing and stateful
phases, against a real uvicorn with fake engines; then a stateful run over the batch API
alone, which follows the OpenAPI links from uploaded files to real batches.

Fixed seed and case count in CI; a long local run:
    FERRY_FUZZ_EXAMPLES=1000 FERRY_FUZZ_SEED=random .venv/bin/python -m pytest -q -s \\
        tests/reliability/test_schemathesis.py

`positive_data_acceptance` runs through tests/reliability/fuzz_hooks.py, which exempts only
the refusals JSON Schema cannot state, and which gives the fuzzer valid batch input files."""

from __future__ import annotations

import base64
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.fake import FakeCustomModel, FakeEmbeddingEngine

from ..conftest import fake_app
from ..live import live

ROOT = Path(__file__).resolve().parents[2]
# 50 cases per operation: at 40, seed 1 already found every problem of issue 15 (the
# refused tool role, null in the admin PATCH, the free-form batch endpoint, dimensions,
# the Allow headers, the upload's extra fields); about 25 s here.
EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "25"))
SEED = os.environ.get("FERRY_FUZZ_SEED", "15")
_seed = str(random.randrange(2**31)) if SEED == "random" else SEED


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("jobs"))
    # A batch line with "HANG" holds the embedding engine this long (fuzz_hooks.SLOW): such a
    # batch is still running when the fuzzer cancels it.
    embed = FakeEmbeddingEngine(hang_seconds=0.5)
    with live(
        fake_app(
            embed,
            custom=FakeCustomModel(),  # the Open Inference Protocol routes (/v2)
            admin_token="admin-secret",
            max_completion_tokens=64,
            max_prompts=8,
            max_queue=100,  # below max_inputs and max_prompts x n: the size limits per model hold
            data_dir=data_dir,
        )
    ) as server:
        yield server


def schemathesis(url: str, report_dir: Path, *args: str, config: str | None = None) -> str:
    cmd = [sys.executable, "-m", "schemathesis.cli"]
    if config is not None:
        (report_dir / "schemathesis.toml").write_text(config)
        cmd += ["--config-file", str(report_dir / "schemathesis.toml")]
    cmd += [
        "run",
        url + "/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--mode",
        "all",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        _seed,
        "-H",
        "Authorization: Bearer admin-secret",
        "--generation-database",
        "none",
        "--no-color",
        "--workers",
        "1",
        "--report-dir",
        str(report_dir),
        *args,
    ]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.reliability.fuzz_hooks",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run(cmd, cwd=report_dir, env=env, capture_output=True, text=True, timeout=540)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"schemathesis (seed {_seed}) found problems:\n{out[-20000:]}"
    return out


@pytest.mark.timeout(600)
def test_the_api_contract_holds_under_fuzzing(api, tmp_path):
    out = schemathesis(api.url, tmp_path, "--phases", "examples,coverage,fuzzing,stateful", "--report", "junit")
    ops = re.search(r"Operations:\s+(\d+) selected", out)
    assert ops and int(ops.group(1)) >= 17, out[-3000:]  # every operation, batch API included
    cases = re.search(r"(\d+) generated, \1 passed", out)
    assert cases and int(cases.group(1)) > 20 * EXAMPLES, out[-3000:]
    print(f"\nschemathesis: seed {_seed}, {EXAMPLES} examples per operation, {cases.group(1)} cases passed")


def stateful_steps(report_dir: Path) -> list[tuple[str, str, int, dict]]:
    """(method, path, status, JSON body or {}) of every request of the stateful phase, from
    schemathesis's own NDJSON report."""
    steps = []
    (report,) = report_dir.glob("*.ndjson")
    for line in report.read_text().splitlines():
        scenario = json.loads(line).get("ScenarioFinished")
        if not scenario or scenario["phase"] != "stateful":
            continue
        for it in scenario["recorder"].get("interactions", {}).values():
            if not it or not it.get("response"):
                continue
            req, resp = it["request"], it["response"]
            content = resp.get("content") or ""
            raw = base64.b64decode(content["$base64"]) if isinstance(content, dict) else content.encode()
            try:
                body = json.loads(raw)
            except ValueError:
                body = {}
            path = re.sub(r"^https?://[^/]+", "", req["uri"]).split("?")[0]
            steps.append((req["method"], path, resp["status_code"], body if isinstance(body, dict) else {}))
    return steps


@pytest.mark.timeout(600)
def test_the_stateful_phase_reaches_real_batches(api, tmp_path):
    # Only the batch API (files and batches), so that scenarios chain upload -> create ->
    # get / cancel / output instead of spreading over every operation; scenarios of up to 20
    # steps (6 by default), as a fast batch completes only after a few reads (~20 ms).
    out = schemathesis(
        api.url,
        tmp_path,
        "--phases",
        "stateful",
        "--include-tag",
        "batch",
        "--report",
        "ndjson",
        config="[phases.stateful]\nmax-steps = 20\n",
    )
    steps = stateful_steps(tmp_path)
    created = {b["id"] for m, p, s, b in steps if (m, p, s) == ("POST", "/v1/batches", 200)}
    got = {p for m, p, s, _ in steps if m == "GET" and s == 200 and p.removeprefix("/v1/batches/") in created}
    cancelled = {
        p
        for m, p, s, _ in steps
        if m == "POST" and s == 200 and p.endswith("/cancel") and p[len("/v1/batches/") : -len("/cancel")] in created
    }
    outputs = {
        b["output_file_id"]
        for _, p, s, b in steps
        if s == 200 and p.startswith("/v1/batches") and b.get("output_file_id")
    }
    read = {
        p
        for m, p, s, _ in steps
        if m == "GET" and s == 200 and p.endswith("/content") and p[len("/v1/files/") : -len("/content")] in outputs
    }
    links = re.search(r"Scenarios:\s+(\d+)\s+API Links:\s+(\d+ covered / \d+ selected)", out)
    summary = (
        f"{links and links.group(1)} scenarios, links {links and links.group(2)}: {len(created)} batches "
        f"created, {len(got)} read, {len(cancelled)} cancelled, {len(read)} output files read (2xx, real ids)"
    )
    assert created and got and cancelled and read, f"{summary}\n{out[-3000:]}"
    print(f"\nschemathesis stateful (seed {_seed}): {summary}")
