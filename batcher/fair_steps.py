"""Fair shares a step at a time: which running rows of a chat model sit out a decode step.

Admission in the tenants' fair order (batcher/fairness.py) shares out the slots as they
free, but a sequence keeps its slot to its last token: with long answers and slow steps the
split corrects only as fast as slots turn over. So the rows of a tenant whose counter ran
more than `fair_hold_margin` ahead of the lowest among the tenants decoding in its priority
class sit out the step, their KV kept (an engine that `holds_rows`): the step is shorter,
and the others' tokens come sooner. That gains the others something only where a step's
time follows its rows (a step bound by its arithmetic; one bound by reading the weights, as
a GPU's small steps, costs as much with fewer rows), so rows are held, the furthest ahead
first, only while the decode cost model predicts the step keeps `HOLD_EFFICIENCY` of the
tokens a second all its rows would give. Never every row, never the rows of the lowest
tenant, and never a sequence whose whole answer is due (budget_scope total) before twice its
steps left.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cost import CostModel
from .fairness import Tenants
from .running import RunningSet, _Seq
from .settings import BatchingSettings
from .types import Priority

# What fair shares may cost in throughput: a step with rows held keeps at least this share
# of the tokens a second of all its rows (issue "Fair shares between tenants": 0.97x).
HOLD_EFFICIENCY = 0.97


def fair_holds(
    running: RunningSet,
    decoding: Sequence[int],
    tenants: Tenants,
    settings: BatchingSettings,
    decode: CostModel,
    now: float,
) -> frozenset[int]:
    """The ids of the `decoding` sequences that sit out this step (module docstring)."""
    if not tenants.enabled or settings.fair_hold_margin <= 0 or len(decoding) < 2:
        return frozenset()
    classes: dict[Priority, dict[str, list[_Seq]]] = {}
    for i in decoding:
        seq = running.get(i)
        if seq is not None and seq.tokens:  # (one with no token yet is still prefilling)
            classes.setdefault(seq.item.priority, {}).setdefault(seq.item.tenant, []).append(seq)
    ahead: list[tuple[float, _Seq]] = []
    for of_class in classes.values():
        if len(of_class) < 2:
            continue
        counters = {t: tenants.counter(t) for t in of_class}
        floor = min(counters.values())
        ahead += [
            (counters[t] - floor, seq)
            for t, seqs in of_class.items()
            if counters[t] - floor > settings.fair_hold_margin
            for seq in seqs
        ]
    if not ahead:
        return frozenset()
    n = len(decoding)
    step = decode.predict(n)
    full = n / max(step, 1e-9)
    held: list[int] = []
    for _, seq in sorted(ahead, key=lambda a: -a[0]):
        k = n - len(held) - 1  # rows left in the step with this one held too
        if k < 1 or k / max(decode.predict(k), 1e-9) < HOLD_EFFICIENCY * full:
            break
        if _may_miss_a_step(seq, settings, now, step):
            held.append(seq.item.id)
    return frozenset(held)


def _may_miss_a_step(seq: _Seq, settings: BatchingSettings, now: float, step: float) -> bool:
    """Not where the whole answer must come by a deadline the missed step could make it miss
    (twice its steps left, and one more, at this step's time)."""
    d = seq.item.deadline
    if settings.budget_scope != "total" or d is None or seq.item.best_effort:
        return True
    return d - now > 2 * (seq.limit - seq.tokens + 1) * step
