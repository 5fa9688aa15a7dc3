"""Front-end cost benchmark (issue: Front ends and engine cores in separate processes, "a lean
request path"): requests/s that one Ferry front end answers with zero-cost engines
(`FERRY_FAKE_ENGINES=1 ferry serve --chat-model none`) against the minimal micro-batching
skeleton of loadtests/skeleton.py, both driven by `wrk` (Debian package; `make wrk` installs
it) with POST /v1/embeddings and a small JSON body. The two alternate, side by side in one run,
so a noisy or shared machine hits both alike; medians are printed with the ratio.

    python -m loadtests.bench_gateway [--rounds 3] [--duration 10] [--connections 64] [--baseline DIR]

`--baseline DIR` adds a third server to each round: Ferry from another checkout (say
`git archive <commit> | tar -x -C DIR`), to measure a change before and after in one run.
The ratio printed per server is the median of its per-round ratios to the skeleton of the
same round, which a shared machine disturbs less than a ratio of medians.

`--front-ends 1,2` (the default) runs Ferry with one front-end process and with two
(`--api-workers 2`, engine cores behind them), each beside the skeleton in every round.
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .openloop import GatewayProcess, free_port

BODY = '{"model": "fake-embed", "input": "the quick brown fox jumps over the lazy dog"}'
LUA = f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{BODY}'
"""


class Skeleton:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "loadtests.skeleton", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("skeleton exited")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("skeleton not listening in time")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def wrk(url: str, lua: str, duration: float, connections: int, threads: int) -> tuple[float, int]:
    """Requests/s and the count of non-2xx answers (which must be zero for a fair figure)."""
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration:g}s", "-s", lua, url + "/v1/embeddings"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=duration + 60).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if rps is None:
        raise RuntimeError(f"no Requests/sec in wrk output:\n{out}")
    return float(rps.group(1)), int(bad.group(1)) if bad else 0


def run_once(name: str, lua: str, a: argparse.Namespace) -> float:
    server: Skeleton | GatewayProcess
    if name == "skeleton":
        server = Skeleton()
    elif name == "baseline":
        env = {"FERRY_FAKE_ENGINES": "1", "PYTHONPATH": a.baseline}
        server = GatewayProcess("--chat-model", "none", env=env, cwd=a.baseline)
    else:
        workers = int(name.removeprefix("ferry x")) if name.startswith("ferry x") else 1
        extra = ["--api-workers", str(workers)] if workers > 1 else []
        server = GatewayProcess("--chat-model", "none", *extra, env={"FERRY_FAKE_ENGINES": "1"})
    try:
        wrk(server.url, lua, a.warmup, a.connections, a.threads)
        rps, bad = wrk(server.url, lua, a.duration, a.connections, a.threads)
    finally:
        server.stop()
    if bad:
        raise RuntimeError(f"{name}: {bad} non-2xx answers")
    print(f"  {name:9s} {rps:9.0f} req/s", flush=True)
    return rps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline", help="directory of another Ferry checkout to run beside this one")
    p.add_argument("--front-ends", default="1,2", help="Ferry cells: counts of front-end processes (--api-workers)")
    a = p.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: run `make wrk` (Debian package 'wrk')")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(LUA)
    lua = f.name
    try:
        runs: dict[str, list[float]] = {"skeleton": []}
        for n in (int(x) for x in a.front_ends.split(",")):
            runs["ferry" if n == 1 else f"ferry x{n}"] = []
        if a.baseline:
            runs["baseline"] = []
        for r in range(a.rounds):
            print(f"round {r + 1}/{a.rounds}", flush=True)
            for name in runs:
                runs[name].append(run_once(name, lua, a))
    finally:
        Path(lua).unlink(missing_ok=True)
    skeleton = runs.pop("skeleton")
    print(f"\nwrk -t{a.threads} -c{a.connections} -d{a.duration:g}s, medians of {a.rounds} alternations:")
    print(f"  skeleton {statistics.median(skeleton):9.0f} req/s")
    for name, rps in runs.items():
        ratio = statistics.median(r / s for r, s in zip(rps, skeleton, strict=True))
        fronts = "one front end" if name in ("ferry", "baseline") else f"{name.removeprefix('ferry x')} front ends"
        print(f"  {name:9s} {statistics.median(rps):9.0f} req/s, {ratio:.2f}x the skeleton ({fronts})")


if __name__ == "__main__":
    main()
