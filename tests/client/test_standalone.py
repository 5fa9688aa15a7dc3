"""ferry_client installs and runs on its own: it imports neither the server's packages nor
torch, starlette or transformers (nor numpy until `numpy=True` asks for it)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "client"
SERVER_SIDE = ["torch", "starlette", "transformers", "numpy", "gateway", "batcher", "engine", "tuner", "loadtests"]


def test_importing_and_using_the_client_loads_nothing_of_the_server():
    code = (
        "import sys, ferry_client\n"
        "from ferry_client import AsyncFerryClient, FerryClient, FerryError\n"
        "c = FerryClient('http://127.0.0.1:9', timeout=2)\n"
        "try:\n"
        "    c.models()\n"
        "except FerryError as e:\n"
        "    assert e.status is None, e  # nothing listens on port 9: a connection error, typed\n"
        "c.close()\n"
        "AsyncFerryClient('http://127.0.0.1:9')\n"
        f"print(sorted(m for m in {SERVER_SIDE!r} if m in sys.modules))\n"
    )
    path = [str(CLIENT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_package_imports_only_the_standard_library_and_httpx():
    """What `client/pyproject.toml` promises: httpx is the one dependency (numpy, optional, is
    imported inside the one function that needs it)."""
    allowed = set(sys.stdlib_module_names) | {"httpx"}
    for path in sorted((CLIENT / "ferry_client").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: what `import ferry_client` pulls in
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
