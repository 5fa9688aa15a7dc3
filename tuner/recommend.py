"""The recommendation: among the cells within the latency SLO and the error budget, the
most throughput; ties within a tolerance go to the lower p99, then the smaller
max_wait_ms, then the smaller max_batch_size. And the text that shows the evidence."""

from __future__ import annotations

import math
from typing import Any

from .scrape import REASONS


def passes(row: dict, slo_ms: float, max_error_rate: float) -> bool:
    p99, er, ok = row.get("p99_ms"), row.get("error_rate"), row.get("ok")
    if p99 in (None, "") or er in (None, "") or not ok or row.get("error"):
        return False
    return float(p99) <= slo_ms and float(er) <= max_error_rate and int(float(ok)) > 0


def _tiebreak(row: dict) -> tuple:
    return (float(row["p99_ms"]), float(row["max_wait_ms"]), int(float(row["max_batch_size"])), str(row["policy"]))


def recommend(rows: list[dict], slo_ms: float, max_error_rate: float, tolerance: float = 0.02) -> dict | None:
    """The cell with the most throughput among those within the SLO (see the module doc)."""
    ok = [r for r in rows if passes(r, slo_ms, max_error_rate)]
    if not ok:
        return None
    best = max(float(r["throughput_rps"]) for r in ok)
    tied = [r for r in ok if float(r["throughput_rps"]) >= best * (1 - tolerance)]
    return min(tied, key=_tiebreak)


def recommend_throughput(rows: list[dict], max_error_rate: float, tolerance: float = 0.02) -> dict | None:
    """No latency cap (batch traffic): the most throughput with few errors."""
    return recommend(rows, math.inf, max_error_rate, tolerance)


def setting_label(row: dict) -> str:
    return f"{row['policy']} size={int(float(row['max_batch_size']))} wait={float(row['max_wait_ms']):g}ms"


def setting_key(row: dict) -> tuple:
    return (str(row["policy"]), int(float(row["max_batch_size"])), float(row["max_wait_ms"]))


def evidence(rows: list[dict], rec: dict | None, args) -> str:
    lines = []
    slo = args.slo_ms
    if rec is None:
        lines.append(
            f"No setting kept p99 within {slo:g} ms with at most {args.max_error_rate:.1%} errors "
            "at any tested rate: lower the rates, raise --slo-ms, or add capacity."
        )
    else:
        lines.append(
            f"Recommended for p99 <= {slo:g} ms: policy={rec['policy']} "
            f"max_batch_size={int(float(rec['max_batch_size']))} max_wait_ms={float(rec['max_wait_ms']):g}"
        )
        lines.append("  evidence: " + describe(rec))
    lines.append("  per setting (best rate within the SLO | first rate that failed it):")
    by_setting: dict[tuple, list[dict]] = {}
    for r in rows:
        by_setting.setdefault(setting_key(r), []).append(r)
    for key, rs in sorted(by_setting.items()):
        rs = sorted(rs, key=lambda r: float(r["rate"]))
        good = [r for r in rs if passes(r, slo, args.max_error_rate)]
        bad = [r for r in rs if not passes(r, slo, args.max_error_rate)]
        last_good = good[-1] if good else None
        left = (
            f"{float(last_good['rate']):g}/s -> {float(last_good['throughput_rps']):.1f}/s"
            f" p99 {fmt_ms(last_good['p99_ms'])}"
            if last_good
            else "none"
        )
        right = f"{float(bad[0]['rate']):g}/s: {why(bad[0], slo, args.max_error_rate)}" if bad else "none failed"
        mark = " <-" if rec is not None and setting_key(rec) == key else ""
        lines.append(f"    {setting_label(rs[0]):34s} {left:38s} | {right}{mark}")
    thr = recommend_throughput(rows, args.max_error_rate, args.tie_tolerance)
    if thr is not None:
        lines.append(
            f"Without a latency cap (batch traffic) the most throughput: {setting_label(thr)}: {describe(thr)}"
        )
    return "\n".join(lines)


def fmt_ms(ms: Any) -> str:
    return "n/a" if ms in (None, "") else f"{float(ms):.0f} ms"


def describe(r: dict) -> str:
    reasons = ", ".join(
        f"{x} {int(float(r.get(f'dispatch_{x}') or 0))}" for x in REASONS if float(r.get(f"dispatch_{x}") or 0)
    )
    mb = r.get("mean_batch_size")
    return (
        f"at {float(r['rate']):g} req/s offered: {float(r['throughput_rps']):.1f} req/s served, "
        f"p50 {fmt_ms(r.get('p50_ms'))}, p99 {fmt_ms(r.get('p99_ms'))}, errors {float(r['error_rate']):.1%}, "
        f"goodput {float(r['goodput_rps']):.1f} req/s, mean batch {mb if mb not in (None, '') else 'n/a'}"
        + (f" (dispatches: {reasons})" if reasons else "")
    )


def why(r: dict, slo: float, max_er: float) -> str:
    if r.get("error"):
        return str(r["error"])
    parts = []
    if r.get("p99_ms") not in (None, "") and float(r["p99_ms"]) > slo:
        parts.append(f"p99 {float(r['p99_ms']):.0f} ms")
    if float(r.get("error_rate") or 0) > max_er:
        parts.append(f"errors {float(r['error_rate']):.1%}")
    return ", ".join(parts) or "no successful request"
