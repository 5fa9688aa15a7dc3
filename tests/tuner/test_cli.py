"""`ferry tune` end to end on a grid of two policies' settings (2 sizes x 1 wait: each cell
starts a locust of its own, ~4 s) with short cells against a fake gateway, and its
argument checks."""

from __future__ import annotations

import ast
import csv
import json
import re

import pytest

from tuner.cli import main, parse_mix

from .conftest import ADMIN_TOKEN, ROOT, run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SLO_MS = 500.0


def independent_recommendation(rows: list[dict], slo_ms: float, max_error_rate: float, tol: float):
    """The documented rule, written again from the CSV alone: p99 within the SLO and few errors;
    the most throughput (ties within `tol`), then the lowest p99, max_wait_ms, max_batch_size."""
    passing = [
        r
        for r in rows
        if r["p99_ms"] != ""
        and r["error"] == ""
        and float(r["ok"]) > 0
        and float(r["p99_ms"]) <= slo_ms
        and float(r["error_rate"]) <= max_error_rate
    ]
    if not passing:
        return None
    top = max(float(r["throughput_rps"]) for r in passing)
    tied = [r for r in passing if float(r["throughput_rps"]) >= top * (1 - tol)]
    best = min(tied, key=lambda r: (float(r["p99_ms"]), float(r["max_wait_ms"]), int(r["max_batch_size"]), r["policy"]))
    return best["policy"], int(best["max_batch_size"]), float(best["max_wait_ms"])


def test_tune_sweeps_a_grid_and_recommends_from_its_own_csv(fake_gateway, tmp_path):
    out = tmp_path / "tune"
    proc = run(
        [
            "-m",
            "gateway.cli",
            "tune",
            "--host",
            fake_gateway.url,
            "--admin-token",
            ADMIN_TOKEN,
            "--model",
            "fake-embed",
            "--sizes",
            "1,8",
            "--waits",
            "5",
            "--policies",
            "fixed",
            "--rates",
            "30",
            "--cell-seconds",
            "1",
            "--drain-seconds",
            "5",
            "--slo-ms",
            f"{SLO_MS:g}",
            "--out",
            str(out),
        ],
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert {(r["max_batch_size"], r["max_wait_ms"]) for r in rows} == {("1", "5.0"), ("8", "5.0")}
    for r in rows:
        assert r["error"] == "", r
        assert int(r["sent"]) > 0 and r["p99_ms"] != ""
        assert float(r["throughput_rps"]) > 0
        assert r["mean_batch_size"] != "" and float(r["mean_batch_size"]) >= 1  # scraped from Ferry's /metrics
        assert float(r["batches"]) > 0
    # max_batch_size 1 can only ever run batches of one.
    assert all(float(r["mean_batch_size"]) == 1.0 for r in rows if r["max_batch_size"] == "1")

    for name in ("p99_vs_throughput.png", "goodput_vs_rate.png", "batch_size_vs_rate.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1024, name

    meta = json.loads((out / "results.json").read_text())
    assert len(meta["rows"]) == 2
    expected = independent_recommendation(rows, SLO_MS, meta["max_error_rate"], meta["tie_tolerance"])
    printed = re.search(
        r"Recommended for p99 <= ([\d.]+) ms: policy=(\w+) max_batch_size=(\d+) max_wait_ms=([\d.]+)", proc.stdout
    )
    if expected is None:
        assert printed is None and "No setting kept p99 within" in proc.stdout
        assert meta["recommendation"] is None
    else:
        assert printed, proc.stdout
        assert float(printed.group(1)) == SLO_MS
        assert (printed.group(2), int(printed.group(3)), float(printed.group(4))) == expected
        rec = meta["recommendation"]
        assert (rec["policy"], int(rec["max_batch_size"]), float(rec["max_wait_ms"])) == expected
    assert "evidence:" in proc.stdout or expected is None

    # The gateway's original setting is back.
    import httpx

    got = httpx.get(
        f"{fake_gateway.url}/admin/models/fake-embed/batching", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ).json()
    assert (got["max_batch_size"], got["max_wait_ms"], got["policy"]) == (32, 2.0, "adaptive")


@pytest.mark.parametrize("host", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1"])
def test_tune_refuses_non_loopback_hosts(host):
    with pytest.raises(SystemExit, match=re.escape("127.0.0.1 / localhost only")):
        main(["--host", host, "--admin-token", "x", "--dry-run"])


def test_grid_is_bounded():
    with pytest.raises(SystemExit, match="max-cells"):
        main(["--sizes", "1,2,3,4,5", "--waits", "0,1,2,3,4", "--rates", "1,2,3", "--max-cells", "50", "--dry-run"])
    with pytest.raises(SystemExit, match="max-minutes"):
        main(["--rates", "1,2,3", "--cell-seconds", "600", "--max-minutes", "5", "--dry-run"])
    assert main(["--sizes", "1,8", "--waits", "0", "--rates", "10", "--dry-run"]) == 0


def test_parse_mix():
    assert parse_mix("embeddings=3,chat=1") == {"embed": 3.0, "interactive": 1.0}
    with pytest.raises(SystemExit):
        parse_mix("video=1")


def test_the_product_never_imports_the_benchmarks():
    """loadtests/ holds benchmarks; what ships (the gateway, the tuner, the client) must work
    without it."""
    for package in ("gateway", "batcher", "engine", "tuner", "client"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
                assert not any(n.split(".")[0] == "loadtests" for n in names), f"{path} imports loadtests"
