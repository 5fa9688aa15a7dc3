"""`ferry serve` in a subprocess over the fake engines (FERRY_FAKE_ENGINES=1), for tests
that send signals or measure a server's memory."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator

import psutil

from loadtests.openloop import GatewayProcess


@contextlib.contextmanager
def whole_tree_killed(gw: GatewayProcess) -> Iterator[GatewayProcess]:
    """Yield `gw`; on the way out kill it and every process it started (engine cores, front
    ends, replacements started since), so no stray process outlives a failed assertion."""
    tree = [gw.proc.pid] + [p.pid for p in psutil.Process(gw.proc.pid).children(recursive=True)]
    try:
        yield gw
    finally:
        with contextlib.suppress(psutil.Error):
            tree += [p.pid for p in psutil.Process(gw.proc.pid).children(recursive=True)]
        for pid in tree:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            gw.proc.wait(10)


class FakeGatewayProcess(GatewayProcess):
    def __init__(self, *args: str, delay: float = 0.0):
        super().__init__(*args, env={"FERRY_FAKE_ENGINES": "1", "FERRY_FAKE_DELAY": str(delay)}, ready_timeout=60)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
