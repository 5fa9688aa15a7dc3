"""A `ferry serve` subprocess over the torch-free fake engines, shared by the load-test tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.openloop import GatewayProcess

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "tune-secret"


@pytest.fixture(scope="session")
def fake_gateway():
    env = {"FERRY_FAKE_ENGINES": "1", "FERRY_FAKE_DELAY": "0.004"}
    with GatewayProcess("--admin-token", ADMIN_TOKEN, "--max-wait-ms", "2", env=env, ready_timeout=60) as gw:
        yield gw


def clean_env() -> dict[str, str]:
    """The environment without locust/ferry load-test settings that would change a run."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("LOCUST_", "FERRY_LOAD_", "FERRY_TUNE_"))}


def run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *cmd], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout
    )
