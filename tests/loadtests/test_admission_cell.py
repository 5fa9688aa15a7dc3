"""loadtests/admission_cell.py's verdicts: a request admission would have refused that met its
budget is a false refusal; one admitted without the flag that missed it, a false admit."""

from __future__ import annotations

from loadtests.admission_cell import judge
from loadtests.openloop import Sample


def sample(status: int, ttft: float | None, best_effort: bool = False) -> Sample:
    return Sample(0.0, 1.0, status, ttft=ttft, headers={"best_effort": best_effort})


def test_false_refusals_and_false_admits_are_counted_apart():
    samples = [
        sample(200, 0.2),  # promised, on time
        sample(200, 0.7),  # promised, late: a false admit
        sample(504, None),  # promised, expired in the queue: a false admit
        sample(200, 0.3, best_effort=True),  # would have been refused, on time: a false refusal
        sample(200, 0.9, best_effort=True),  # would have been refused, late: a right refusal
        sample(429, None),  # refused
    ]
    row = judge(samples, budget_ms=500, duration=2.0)
    assert row == {
        "sent": 6,
        "refused": 1,
        "flagged": 2,
        "false_refusals": 1,
        "promised": 3,
        "false_admits": 2,
        "goodput": 1.0,
    }
