"""The locustfile runs headless against a fake gateway: every user class, no failures."""

from __future__ import annotations

import csv
import json

import pytest

from tuner.sweep import LOCUSTFILE

from .conftest import run

CLASSES = {  # class -> (its weight option, the entries it must produce)
    "interactive": ("--weight-interactive", ["chat (stream)", "TTFT chat"]),
    "batch": ("--weight-batch", ["batch chat"]),
    "embed": ("--weight-embed", ["embeddings"]),
}


def locust(url: str, tmp_path, *extra: str, seconds: int = 2) -> tuple[object, dict, dict]:
    prefix = tmp_path / "run"
    report = tmp_path / "report.json"
    proc = run(
        [
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "--host",
            url,
            "-t",
            f"{seconds}s",
            "--stop-timeout",
            "10",
            "--only-summary",
            "--csv",
            str(prefix),
            "--ferry-report",
            str(report),
            "--ferry-chat-model",
            "fake-chat",
            "--ferry-embed-model",
            "fake-embed",
            "--chat-max-tokens",
            "4",
            "--batch-max-tokens",
            "4",
            "--batch-conversations",
            "3",
            *extra,
        ],
        timeout=60,
    )
    stats = {}
    if (tmp_path / "run_stats.csv").exists():
        with open(tmp_path / "run_stats.csv", newline="") as f:
            stats = {row["Name"]: row for row in csv.DictReader(f)}
    summary = json.loads(report.read_text()) if report.exists() else {}
    return proc, stats, summary


@pytest.mark.parametrize("cls", list(CLASSES))
def test_each_user_class_runs_open_loop_without_failures(fake_gateway, tmp_path, cls):
    weights = []
    for other, (flag, _) in CLASSES.items():
        weights += [flag, "1" if other == cls else "0"]
    proc, stats, summary = locust(fake_gateway.url, tmp_path, "--arrival-rate", "12", *weights)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for entry in CLASSES[cls][1]:
        assert entry in stats, f"no locust entry {entry!r}: {sorted(stats)}"
        assert int(stats[entry]["Request Count"]) > 0
        assert int(stats[entry]["Failure Count"]) == 0
    assert int(stats["Aggregated"]["Failure Count"]) == 0
    others = {e for c, (_, es) in CLASSES.items() if c != cls for e in es}
    assert not others & set(stats), "a class with weight 0 sent requests"
    # Open loop: every scheduled arrival was sent and recorded (nothing left unfinished).
    request_entry = CLASSES[cls][1][0]
    assert summary["mode"] == "open"
    assert summary["scheduled"] == int(stats[request_entry]["Request Count"])
    if cls == "interactive":  # one time-to-first-token entry per successful stream
        assert stats["TTFT chat"]["Request Count"] == stats["chat (stream)"]["Request Count"]


def test_tags_pick_the_mix_closed_loop(fake_gateway, tmp_path):
    """`--tags embeddings` leaves only embeddings; `--arrival-rate 0` is locust's closed loop of -u users."""
    proc, stats, summary = locust(
        fake_gateway.url, tmp_path, "--tags", "embeddings", "--arrival-rate", "0", "-u", "2", "-r", "10"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["mode"] == "closed"
    assert set(stats) == {"embeddings", "Aggregated"}
    assert int(stats["embeddings"]["Request Count"]) > 0 and int(stats["embeddings"]["Failure Count"]) == 0


def test_stepped_rates_mix_of_all_classes(fake_gateway, tmp_path):
    proc, stats, summary = locust(
        fake_gateway.url,
        tmp_path,
        "--rate-steps",
        "6:1,18:1",
        "--arrivals",
        "uniform",
        "--ferry-slo-ms",
        "5000",
        seconds=10,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Evenly spaced arrivals: 6/s for 1 s then 18/s for 1 s, split over three classes; the
    # run ends with the last step (before -t).
    assert 18 <= summary["scheduled"] <= 30, summary
    assert summary["window_s"] <= 2.0
    for entry in ("chat (stream)", "TTFT chat", "batch chat", "embeddings"):
        assert int(stats[entry]["Failure Count"]) == 0
        assert summary["entries"][entry]["within_slo"] == summary["entries"][entry]["n"]


def test_refuses_a_non_loopback_host(tmp_path):
    proc = run(
        ["-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", "http://192.0.2.1:8000", "-t", "1s"], timeout=60
    )
    assert proc.returncode != 0
    assert "127.0.0.1 / localhost only" in proc.stderr


def test_arrivals_that_find_every_user_busy_are_counted_not_dropped(fake_gateway, tmp_path):
    """Coordinated omission, made visible: one user cannot keep up with 100 batch requests/s
    (each takes several engine steps), the arrivals it never got to are reported as offered
    load that was not served, and `ferry tune` counts them as errors."""
    from tuner.sweep import cell_figures

    proc, stats, summary = locust(
        fake_gateway.url,
        tmp_path,
        "--arrival-rate",
        "100",
        "--pool-size",
        "1",
        "--weight-interactive",
        "0",
        "--weight-embed",
        "0",
        "--ferry-slo-ms",
        "1000",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sent = int(stats["batch chat"]["Request Count"])
    assert summary["never_sent"] > 0
    assert summary["scheduled"] == sent + summary["never_sent"]
    figures = cell_figures(stats, summary, ["batch"], slo_ms=1000)
    assert figures["unfinished"] == summary["never_sent"]
    assert figures["error_rate"] >= summary["never_sent"] / summary["scheduled"] - 1e-3
