"""One cell's figures from locust's CSV and the locustfile's report."""

from __future__ import annotations

import math

from tuner.sweep import cell_figures


def test_cell_figures_count_unfinished_requests_as_errors():
    stats = {
        "embeddings": {
            "Request Count": "90",
            "Failure Count": "0",
            "50%": "20",
            "95%": "40",
            "99%": "60",
            "Max Response Time": "70.2",
        }
    }
    report = {"window_s": 3.0, "scheduled": 100, "entries": {"embeddings": {"within_slo": 85}}, "late_starts": 0}
    f = cell_figures(stats, report, ["embed"], slo_ms=50)
    assert f["unfinished"] == 10 and math.isclose(f["error_rate"], 0.1)
    assert f["throughput_rps"] == 30.0 and math.isclose(f["goodput_rps"], 85 / 3, rel_tol=1e-3)
    assert f["p99_ms"] == 60.0
    # Interactive chat: the SLO applies to time to first token; the worst class decides.
    stats.update(
        {
            "chat (stream)": {"Request Count": "10", "Failure Count": "1"},
            "TTFT chat": {
                "Request Count": "9",
                "Failure Count": "0",
                "50%": "30",
                "95%": "90",
                "99%": "95",
                "Max Response Time": "99",
            },
        }
    )
    report["scheduled"] = 100
    f = cell_figures(stats, report, ["embed", "interactive"], slo_ms=50)
    assert f["sent"] == 100 and f["failures"] == 1 and f["p99_ms"] == 95.0
