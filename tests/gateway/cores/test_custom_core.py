"""A custom model (engine/fake.py's FakeCustomModel, named in a config file) in its own engine
core, as `ferry serve --config` runs it: rows and outputs cross the process boundary, the cost
hints are the core's, a SIGKILL of the core is recovered from as for the built-in kinds, and a
class that cannot be imported stops the server with one line."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import tritonclient.http as triton

from loadtests.openloop import GatewayProcess, free_port
from tests.reliability.procs import whole_tree_killed
from tests.waiting import wait_until

from .test_core import cores_of, ready_again, restarts

MODEL = "fake-custom"
INFER = f"/v2/models/{MODEL}/infer"
CONFIG = f"""
models:
  - name: {MODEL}
    kind: custom
    source: engine.fake:FakeCustomModel
    device: cpu
    options: {{hang_seconds: 30}}
    batching: {{max_wait_ms: 2}}
"""


def rows(*texts: str) -> dict:
    return {
        "inputs": [
            {"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": list(texts)},
            {"name": "vector", "shape": [len(texts), 1], "datatype": "FP32", "data": [[1.0]] * len(texts)},
        ]
    }


def test_a_custom_model_in_its_core_serves_is_recovered_after_sigkill_and_stops_cleanly(tmp_path):
    config = tmp_path / "custom.yaml"
    config.write_text(CONFIG)
    with whole_tree_killed(GatewayProcess("--config", str(config), "--engine-cores", ready_timeout=120)) as gw:
        [core] = cores_of(gw.proc.pid)
        client = triton.InferenceServerClient(gw.url.removeprefix("http://"))
        text = triton.InferInput("text", [2], "BYTES")
        text.set_data_from_numpy(np.array(["héllo", "x" * 40], dtype=object))
        vector = triton.InferInput("vector", [2, 2], "FP32")
        vector.set_data_from_numpy(np.ones((2, 2), dtype=np.float32))
        result = client.infer(MODEL, [text, vector])
        assert [v.decode() for v in result.as_numpy("upper")] == ["HÉLLO", "X" * 40]
        assert result.as_numpy("sum").tolist() == [2.0, 2.0]
        client.close()
        # The rows' cost hints (1 and 6) were computed in the core, where the class is.
        tokens = 'ferry_batch_size_tokens_sum{model="fake-custom",phase="predict"} '
        scraped = httpx.get(gw.url + "/metrics", timeout=30).text.splitlines()
        assert float(next(line for line in scraped if line.startswith(tokens)).split()[-1]) == 7.0

        def scraped(prefix: str) -> float:
            lines = httpx.get(gw.url + "/metrics", timeout=30).text.splitlines()
            return sum(float(line.split()[-1]) for line in lines if line.startswith(prefix))

        def batches() -> float:
            return scraped('ferry_batches_total{model="fake-custom"')

        def queued() -> float:
            return scraped('ferry_queue_depth{class="interactive",model="fake-custom"}')

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
                before = await asyncio.to_thread(batches)
                hung = asyncio.create_task(c.post(INFER, json=rows("HANG")))
                await asyncio.to_thread(wait_until, lambda: batches() > before, message="the hung batch to leave")
                waiting = [asyncio.create_task(c.post(INFER, json=rows(f"queued {i}"))) for i in range(3)]
                await asyncio.to_thread(wait_until, lambda: queued() == 3, message=lambda: f"3 queued: {queued()}")
                core.send_signal(signal.SIGKILL)
                return list(await asyncio.gather(hung, *waiting))

        for r in asyncio.run(scenario()):
            assert r.status_code == 503 and set(r.json()) == {"error"}, r.text
            assert "SIGKILL" in r.json()["error"] and int(r.headers["Retry-After"]) >= 1
        ready_again(gw)
        assert restarts(gw, MODEL) == 1
        after = httpx.post(gw.url + INFER, json=rows("after"), timeout=30)
        assert after.status_code == 200 and after.json()["outputs"][2]["data"] == ["AFTER"]
        assert httpx.get(gw.url + f"/v2/models/{MODEL}/ready", timeout=30).status_code == 200
        [new_core] = cores_of(gw.proc.pid)
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(60) == 0
        wait_until(lambda: not new_core.is_running(), message="the core to exit with the server")


def test_a_class_that_cannot_be_imported_stops_ferry_serve_with_one_line(tmp_path: Path):
    config = tmp_path / "custom.yaml"
    config.write_text(CONFIG.replace("engine.fake:FakeCustomModel", "no_such_package.models:Classifier"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "ferry: cannot load the custom model no_such_package.models:Classifier: "
        "ModuleNotFoundError: No module named 'no_such_package'"
    ), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
