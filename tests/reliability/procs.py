"""`ferry serve` in a subprocess over the fake engines (FERRY_FAKE_ENGINES=1), for tests
that send signals or measure a server's memory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from loadtests.openloop import free_port


class FakeGatewayProcess:
    def __init__(self, *args: str, delay: float = 0.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="ferry-test-", suffix=".log", delete=False)
        env = {**os.environ, "FERRY_FAKE_ENGINES": "1", "FERRY_FAKE_DELAY": str(delay)}
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port), *args],
                                     env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(open(self.log.name).read()[-2000:])
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("fake gateway did not become ready")

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

    def log_text(self) -> str:
        return open(self.log.name).read()
