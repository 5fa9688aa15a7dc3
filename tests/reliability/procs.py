"""`ferry serve` in a subprocess over the fake engines (FERRY_FAKE_ENGINES=1), for tests
that send signals or measure a server's memory."""

from __future__ import annotations

import signal

from loadtests.openloop import GatewayProcess


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
