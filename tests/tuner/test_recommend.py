"""The recommendation rule on hand-made rows."""

from __future__ import annotations

from tuner.recommend import recommend, recommend_throughput


def _row(policy="fixed", size=8, wait=5.0, rate=40.0, tp=40.0, p99=100.0, er=0.0, **kw):
    return {
        "policy": policy,
        "max_batch_size": size,
        "max_wait_ms": wait,
        "rate": rate,
        "throughput_rps": tp,
        "p99_ms": p99,
        "error_rate": er,
        "ok": 100,
        "error": "",
        "goodput_rps": tp,
        **kw,
    }


def test_recommend_is_the_most_throughput_within_the_slo():
    rows = [
        _row(size=1, wait=0, rate=120, tp=60, p99=3000),  # overloaded: over the SLO
        _row(size=32, wait=10, rate=120, tp=119, p99=150),
        _row(size=8, wait=0, rate=120, tp=118, p99=90),  # within 2 % of the best: tie, lower p99 wins
        _row(size=8, wait=0, rate=200, tp=190, p99=80, er=0.2),  # too many errors
        _row(size=8, wait=0, rate=40, tp=40, p99=20),
    ]
    rec = recommend(rows, slo_ms=200, max_error_rate=0.01, tolerance=0.02)
    assert (rec["max_batch_size"], rec["rate"]) == (8, 120)
    assert recommend(rows, slo_ms=200, max_error_rate=0.01, tolerance=0.0)["max_batch_size"] == 32
    assert recommend(rows, slo_ms=10, max_error_rate=0.01) is None
    # Without a latency cap the errors still count, the latency does not.
    assert recommend_throughput(rows, max_error_rate=0.01, tolerance=0.0)["max_batch_size"] == 32
    assert recommend_throughput(rows, max_error_rate=0.5)["rate"] == 200
