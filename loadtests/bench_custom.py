"""A user's own batched model (issue #34): the example custom model (docs/examples/
custom_model.py, a zero-shot topic classifier over all-MiniLM-L6-v2) three ways, side by
side in one run on this machine:

1. the ceiling: the same class called in a plain loop without HTTP, batches of
   `--batch` texts, with 1 torch thread (what Ferry's engine core gives it on 2 cores) and
   with every core;
2. Ferry: `ferry serve --config` with that model alone (its engine core), Open Inference
   Protocol requests of one text each under open-loop Poisson arrivals at rising rates;
3. Seldon MLServer (`--mlserver-python`, its own venv) serving the same class through its
   adaptive batching (loadtests/mlserver_topics.py: max_batch_size `--batch`,
   max_batch_time `--mlserver-batch-ms`), the same requests at the same rates.

    python -m loadtests.bench_custom --mlserver-python /tmp/mlserver-venv/bin/python \\
        [--rates 0.5,0.8,1.0,1.3] [--duration 20] [--slo-ms 200]

Each request carries the SLO as its latency budget (`parameters.latency_budget_ms`, which
MLServer ignores; `--no-budget`: none). Rates are fractions of the 1-thread ceiling.
Prints throughput, goodput (answers within the SLO, per second), p50/p99 and the ratios:
Ferry / ceiling (its best throughput against the best ceiling) and Ferry / MLServer goodput
at each rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tuner.traffic import sentence

from .openloop import GatewayProcess, free_port, open_loop, post_json, summarise

ROOT = Path(__file__).resolve().parents[1]
MODEL = "topics"
CEILING = """
import sys, time, torch
sys.path.insert(0, {root!r})
from docs.examples.custom_model import TopicClassifier
from tuner.traffic import sentence
torch.set_num_threads({threads})
m = TopicClassifier(); m.load(device="cpu", dtype="float32")
m.predict([{{"text": sentence(i)}} for i in range({batch})])
done, i, start = 0, 0, time.perf_counter()
while time.perf_counter() - start < {seconds}:
    m.predict([{{"text": sentence(i + k)}} for k in range({batch})])
    done += {batch}; i += {batch}
print(done / (time.perf_counter() - start))
"""


def _ceiling(threads: int, batch: int, seconds: float = 8.0) -> float:
    """Texts per second of the class in a plain loop (a subprocess: torch stays out of this one)."""
    code = CEILING.format(root=str(ROOT), threads=threads, batch=batch, seconds=seconds)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


BUDGET_MS: float | None = None  # sent as parameters.latency_budget_ms (`--budget-ms`)


def _infer_body(i: int) -> dict:
    body: dict = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [sentence(i)]}]}
    if BUDGET_MS is not None:  # Ferry's deadline; MLServer ignores the parameter
        body["parameters"] = {"latency_budget_ms": BUDGET_MS}
    return body


async def _send(session, i):
    return await post_json(session, f"/v2/models/{MODEL}/infer", _infer_body(i))


def _run_rates(url: str, rates: list[float], duration: float, slo_ms: float) -> list[dict]:
    rows = []
    for rate in rates:
        samples = asyncio.run(open_loop(rate, duration, _send, url, seed=int(rate)))
        rows.append({"rate": rate, **summarise(samples, duration, slo_ms)})
        r = rows[-1]
        print(
            f"    {rate:7.1f}/s: throughput {r['throughput']:7.1f}/s goodput {r['goodput']:7.1f}/s "
            f"p50 {r['p50_ms']:7.1f} ms p99 {r['p99_ms']:7.1f} ms rejected {r['rejected']} expired {r['expired']} "
            f"errors {r['errors']}",
            flush=True,
        )
    return rows


def ferry_config(batch: int, wait_ms: float) -> str:
    return (
        "models:\n"
        f"  - name: {MODEL}\n"
        "    kind: custom\n"
        "    source: docs.examples.custom_model:TopicClassifier\n"
        "    device: cpu\n"
        "    dtype: float32\n"
        f"    batching: {{max_batch_size: {batch}, max_wait_ms: {wait_ms}}}\n"
    )


class MLServerProcess:
    """`mlserver start` on free ports, serving loadtests/mlserver_topics.py."""

    def __init__(self, python: str, batch: int, batch_ms: float, threads: int, workers: int = 1):
        self.dir = Path(tempfile.mkdtemp(prefix="ferry-mlserver-"))
        port, grpc, metrics = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        (self.dir / "settings.json").write_text(
            json.dumps(
                {
                    "http_port": port,
                    "grpc_port": grpc,
                    "metrics_port": metrics,
                    "debug": False,
                    "parallel_workers": workers,
                }
            )
        )
        model_dir = self.dir / MODEL
        model_dir.mkdir()
        (model_dir / "model-settings.json").write_text(
            json.dumps(
                {
                    "name": MODEL,
                    "implementation": "loadtests.mlserver_topics.TopicsRuntime",
                    "max_batch_size": batch,
                    "max_batch_time": batch_ms / 1000.0,
                }
            )
        )
        bin_dir = Path(python).parent
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "FERRY_BENCH_THREADS": str(threads),
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        }
        self.log = open(self.dir / "mlserver.log", "w")  # noqa: SIM115 (open while it runs)
        self.proc = subprocess.Popen(
            [str(bin_dir / "mlserver"), "start", str(self.dir)],
            env=env,
            cwd=str(ROOT),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlserver exited: {(self.dir / 'mlserver.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/v2/models/{MODEL}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("mlserver not ready in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,0.8,1.0,1.3", help="fractions of the 1-thread ceiling")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--slo-ms", type=float, default=200.0)
    p.add_argument("--batch", type=int, default=32, help="largest batch (ceiling, Ferry and MLServer alike)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="Ferry's max_wait_ms")
    p.add_argument("--ferry-args", default="", help="extra flags of ferry serve (e.g. --torch-threads 2)")
    p.add_argument("--mlserver-python", default=None, help="the python of a venv with mlserver, torch, transformers")
    p.add_argument("--mlserver-batch-ms", type=float, default=5.0, help="MLServer's max_batch_time")
    p.add_argument(
        "--mlserver-workers", type=int, default=0, help="MLServer's parallel_workers (0, its best here: in-process)"
    )
    p.add_argument("--threads", type=int, default=1, help="MLServer's torch threads (Ferry's core: 1 on 2 cores)")
    p.add_argument("--budget-ms", type=float, default=None, help="each request's latency budget (default: the SLO)")
    p.add_argument("--no-budget", action="store_true", help="send no latency budget")
    a = p.parse_args()
    global BUDGET_MS
    BUDGET_MS = None if a.no_budget else (a.budget_ms or a.slo_ms)

    print("ceiling: the class in a plain loop, no HTTP", flush=True)
    ceilings = {t: _ceiling(t, a.batch) for t in sorted({1, len(os.sched_getaffinity(0))})}
    for t, rate in ceilings.items():
        print(f"    {t} torch thread(s), batches of {a.batch}: {rate:7.1f} texts/s", flush=True)
    rates = [round(float(f) * ceilings[1], 1) for f in a.rates.split(",")]
    results: dict[str, list[dict]] = {}

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(ferry_config(a.batch, a.max_wait_ms))
    print(f"ferry (engine core) {a.ferry_args}", flush=True)
    with GatewayProcess("--config", f.name, *a.ferry_args.split(), cwd=str(ROOT)) as gw:
        _run_rates(gw.url, rates[:1], 3.0, a.slo_ms)  # warm: the cost model's first fit
        results["ferry"] = _run_rates(gw.url, rates, a.duration, a.slo_ms)
    if a.mlserver_python:
        print(
            f"mlserver (adaptive batching: {a.batch} rows, {a.mlserver_batch_ms} ms; "
            f"{a.mlserver_workers} parallel workers)",
            flush=True,
        )
        ml = MLServerProcess(a.mlserver_python, a.batch, a.mlserver_batch_ms, a.threads, a.mlserver_workers)
        try:
            _run_rates(ml.url, rates[:1], 3.0, a.slo_ms)
            results["mlserver"] = _run_rates(ml.url, rates, a.duration, a.slo_ms)
        finally:
            ml.stop()

    best_ceiling = max(ceilings.values())
    best_ferry = max(r["throughput"] for r in results["ferry"])
    print(
        f"\nFerry's best throughput / best ceiling: {best_ferry:.1f} / {best_ceiling:.1f} = "
        f"{best_ferry / best_ceiling:.2f}x"
    )
    print(f"Ferry's best throughput / 1-thread ceiling: {best_ferry / ceilings[1]:.2f}x")
    if "mlserver" in results:
        for f_row, m_row in zip(results["ferry"], results["mlserver"], strict=True):
            ratio = f_row["goodput"] / m_row["goodput"] if m_row["goodput"] else float("inf")
            print(
                f"  at {f_row['rate']:7.1f}/s goodput within {a.slo_ms:.0f} ms: Ferry {f_row['goodput']:7.1f}/s, "
                f"MLServer {m_row['goodput']:7.1f}/s: {ratio:.2f}x"
            )


if __name__ == "__main__":
    main()
