"""The supervisor of `--api-workers N` (gateway/cores/supervisor.py) refusing to start: one line,
exit status 1. (Its life with front ends and cores:
tests/gateway/cores/test_api_workers.py.)"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

from gateway.config import ServerConfig
from gateway.cores.supervisor import supervise
from gateway.jobs.store import lock_data_dir
from loadtests.openloop import free_port


def refusal(cfg: ServerConfig) -> tuple[int, list[str]]:
    lines: list[str] = []
    code = asyncio.run(supervise(cfg, report=lines.append))
    return code, lines


def test_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = refusal(ServerConfig(host="127.0.0.1", port=port, api_workers=2))
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"cannot listen on 127.0.0.1:{port}"), lines


def test_a_data_directory_another_server_holds_is_one_line(tmp_path):
    fd = lock_data_dir(tmp_path)
    try:
        code, lines = refusal(ServerConfig(port=free_port(), api_workers=2, data_dir=str(tmp_path)))
    finally:
        os.close(fd)
    assert code == 1 and lines == [f"data directory {tmp_path} is in use by another Ferry process"]


def test_a_core_that_cannot_load_its_model_ends_ferry_serve_with_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--api-workers",
            "2",
            "--port",
            str(free_port()),
            "--data-dir",
            str(tmp_path / "data"),
            "--embedding-model",
            str(missing),
            "--chat-model",
            "none",
        ],
        env={**env, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert last == f"ferry: cannot load the embedding model {missing}: no such file or directory", stderr[-2000:]
    assert "Traceback" not in stderr


def test_the_supervisor_imports_neither_starlette_nor_torch():
    code = (
        "import sys; import gateway.cores.supervisor; from gateway.config import ServerConfig; "
        "from gateway.models.catalogue import default_specs; default_specs(ServerConfig()); "
        "print(sorted(m for m in ('starlette', 'uvicorn', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr
