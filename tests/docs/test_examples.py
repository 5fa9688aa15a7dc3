"""The embedded-mode examples of README.md and docs/client.md run as a newcomer pastes them:
saved as an unguarded script (the README's) or fed on standard input (the others), each in
a fresh interpreter on the built-in models; each finishes cleanly and leaves no process
behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = ("README.md", "docs/client.md")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
RUN_TIMEOUT_S = 240  # two models load in the engine cores; far less on a quiet machine


def embedded_examples() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for n, code in enumerate(BLOCK.findall(text)):
            if re.search(r"\bwith Ferry\(", code):
                found.append((f"{doc}#{n}", code))
    return found


def session_processes(sid: int) -> list[str]:
    """The processes still in session `sid`, as 'pid: command line'."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != sid:
                continue
            cmdline = (Path("/proc") / entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile
        left.append(f"{entry}: {cmdline.strip()}")
    return left


def run(args: list[str], *, stdin: bytes | None, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its children join its session: what is left is findable
    )
    try:
        out, err = proc.communicate(stdin, timeout=RUN_TIMEOUT_S)
        left = session_processes(proc.pid)
    finally:
        if session_processes(proc.pid):  # timed out, or left some: end them all
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not left, f"processes left behind: {left}"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_the_docs_have_embedded_examples() -> None:
    assert {name.split("#")[0] for name, _ in embedded_examples()} == set(DOCS)


def example_runs() -> list[tuple[str, str, str]]:
    """Every example once: the README's saved as a script, the others fed on standard
    input. How the interpreter gets its `__main__` (a file, or `-` with no file to re-import
    in a spawned engine core) is what the two ways check, the same for any example: each way
    once is enough (each run loads both built-in models, ~15 s of make test's budget)."""
    found = embedded_examples()
    assert found[0][0].startswith("README.md") and len(found) > 1
    return [(*found[0], "script")] + [(name, code, "stdin") for name, code in found[1:]]


@pytest.mark.parametrize(("name", "code", "how"), example_runs(), ids=[f"{n}-{h}" for n, _, h in example_runs()])
def test_an_embedded_example_runs_as_written(name: str, code: str, how: str, tmp_path: Path) -> None:
    if how == "script":
        script = tmp_path / "example.py"
        script.write_text(code, encoding="utf-8")
        done = run([sys.executable, str(script)], stdin=None, cwd=tmp_path)
    else:
        done = run([sys.executable, "-"], stdin=code.encode(), cwd=tmp_path)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 0, f"{name} as {how} exited {done.returncode}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert done.stdout.strip(), f"{name} printed nothing"  # each example prints what it got
