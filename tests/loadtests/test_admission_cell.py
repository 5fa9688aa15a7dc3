"""loadtests/admission_cell.py's verdicts: a request admission would have refused that met its
budget is a false refusal; one admitted without the flag that missed it, a false admit."""

from __future__ import annotations

from loadtests.admission_cell import is_probe, judge, verdict_line
from loadtests.openloop import Sample


def sample(status: int, ttft: float | None, best_effort: bool = False, probe: bool = False) -> Sample:
    return Sample(0.0, 1.0, status, ttft=ttft, tag="probe" if probe else "", headers={"best_effort": best_effort})


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
        "probes": 0,
        "refused": 1,
        "flagged": 2,
        "false_refusals": 1,
        "promised": 3,
        "false_admits": 2,
        "goodput": 1.0,
    }


def test_probes_are_the_share_asked_for_blind_to_the_load_and_spread_over_time():
    chosen = [i for i in range(1000) if is_probe(i, 0.25)]
    assert 240 <= len(chosen) <= 260
    # Spread: every run of 20 requests holds some (a window of load is never probe-free).
    assert all(any(is_probe(i, 0.25) for i in range(start, start + 20)) for start in range(980))
    assert not any(is_probe(i, 0.0) for i in range(100))


def test_the_probe_mode_estimates_false_refusals_from_its_probes():
    samples = [
        sample(200, 0.2),  # promised, on time
        sample(429, None),  # refused: no probe, nothing known of it
        sample(200, 0.3, best_effort=True, probe=True),  # a probe admission would refuse, on time: false
        sample(200, 0.9, best_effort=True, probe=True),  # a probe admission would refuse, late: right
        sample(200, 0.1, probe=True),  # a probe admitted on its own merit, on time
        sample(200, 0.6, probe=True),  # ... and late: a false admit
    ]
    row = judge(samples, budget_ms=500, duration=2.0)
    assert (row["probes"], row["flagged"], row["false_refusals"], row["promised"], row["false_admits"]) == (
        4,
        2,
        1,
        3,
        1,
    )
    line = verdict_line("probe", 8.0, row)
    assert (
        "probes   4, would refuse   2, of which met the budget   1 (25.0% of requests, 50% of refusals false)" in line
    )
